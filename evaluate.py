"""Replay workflows through the serving simulator under each cache policy (docs/simulator.md).

    python evaluate.py                                              # every policy on hover
    python evaluate.py policies=[lru,kvflow,pbkv_lae,pbkv,oracle] sim.gpu_tokens=300000 sim.concurrency=32
    python evaluate.py predictor.checkpoint=RUN/predictor.pt prefetch=[none,conservative]
    python evaluate.py -m sim.gpu_tokens=150000,300000,600000

Writes summary.json, hit_rate.png and latency.png to the run directory (all at once or not at all:
data.atomic.hydra_run_dir; a run folder is only replaced when evaluate.py made it), prints the table
and logs both to W&B (offline unless WANDB_MODE says otherwise). Logic:
serving_integration/experiments/evaluation.py.
"""

import logging
import sys
from pathlib import Path

from data import cpu_kernels

cpu_kernels.pin()  # before anything loads torch: the same kernels on every x86-64 machine (data/cpu_kernels.py)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import data.config  # noqa: F401  (registers the data schemas conf/ names)
from data.atomic import hydra_run_dir
from data.cli import exit_2_if_not_composed
from data.errors import run_reported
from serving_integration.experiments.config import settings  # registers the schemas Hydra composes with
from serving_integration.experiments.evaluation import evaluate
from serving_integration.experiments.presentation import format_table, log_wandb, plot

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    status = run_reported(run, cfg, Path(HydraConfig.get().runtime.output_dir))
    if status:
        sys.exit(status)


COMMAND = "evaluate.py"


def run(cfg: DictConfig, run_dir: Path) -> None:
    """Check the config (serving_integration/experiments/config.py), then evaluate into a temporary
    folder that replaces the run directory when complete."""
    knobs = settings(cfg)
    with hydra_run_dir(run_dir, COMMAND, cfg, inputs=[cfg.data.path, knobs.predictor.checkpoint]) as staging:
        summary = evaluate(cfg, staging, knobs)
        plots = plot(summary["rows"], staging)
        if knobs.wandb.enabled:
            log_wandb(cfg, summary, plots, staging)
    print(format_table(summary["rows"]))
    print(f"summary: {run_dir / 'summary.json'}")


if __name__ == "__main__":
    exit_2_if_not_composed(main, "evaluate")
