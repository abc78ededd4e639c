"""Workflow traces: formats, validation, importers, workload generators and the dataset store."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root: train.py, evaluate.py, conf/
CONF_DIR = REPO / "conf"
