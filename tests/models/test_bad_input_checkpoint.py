"""Hostile checkpoint files: every loader refuses a crafted pickle without running it, and no
loader in the code unpickles code."""

import pathlib
import subprocess

import pytest
import torch

from models.checkpoint import CheckpointError, load_predictor, read_checkpoint
from tests.conftest import REPO


class Hostile:
    """Unpickling it calls Path.touch: any code could run the same way."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_crafted_pickle_raises_and_runs_nothing(tmp_path):
    from models.intentkv.train import load_residual_head

    path, marker = tmp_path / "predictor.pt", tmp_path / "ran"
    torch.save({"format": "x", "payload": Hostile(marker)}, path)
    for load in (read_checkpoint, load_predictor, load_residual_head):
        with pytest.raises(CheckpointError, match=f"{path}: not a readable"):
            load(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the file is hostile indeed: a plain load runs its code
    assert marker.exists()


def test_no_loader_unpickles_code():
    found = subprocess.run(["grep", "-rn", "--include=*.py", "weights_only=False", "data", "models",
                            "serving_integration", "train.py", "evaluate.py"], cwd=REPO, capture_output=True, text=True)
    assert found.stdout == ""
