"""train.py end to end through Hydra, on tiny data (CPU, well under a minute)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from data import cpu_kernels, store
from data.generators import Hover
from models import WorkflowPrefix, load_predictor, read_checkpoint
from models.training import metric_keys, train
from tests.conftest import REPO as ROOT

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*treespec")]

OFFLINE = {"WANDB_MODE": "offline", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(ROOT / ".cache" / "huggingface"), "TOKENIZERS_PARALLELISM": "false"}
TINY = ["debug=train"]  # hashing text encoder, two epochs, batch 64, csv logger, 30 workflows


def run_train(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE, "PBKV_DATA_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "hover"
    store.save(store.build(Hover().generate(40, seed=1), val=0.2, test=0.2, seed=0), out)
    return out


def test_train_with_data_path_and_run_dir(dataset_dir, tmp_path):
    run = tmp_path / "run"
    run_train(["model=graphsage", f"data.path={dataset_dir}", f"hydra.run.dir={run}", *TINY],
              tmp_path)
    metrics = json.loads((run / "metrics.json").read_text())
    levels = [0.1, 0.5, 0.9]  # models.config.TimeConfig.quantiles
    assert set(metrics) == set(metric_keys(3, levels)) | {"checkpoint", "time_source", "time_fallback",
                                                          "time_quantiles", "time_offset_s", "cpu_kernels"}
    assert metrics["cpu_kernels"] == cpu_kernels.fingerprint()  # train.py pinned them as this process is pinned
    assert all(isinstance(metrics[k], float) for k in metric_keys(3, levels))
    assert 0.0 <= metrics["test/top1_k1"] <= 1.0 and metrics["test/top3_k1"] >= metrics["test/top1_k1"]
    assert metrics["time_source"] == "tool_time" and metrics["time_fallback"] is False
    assert all(0.0 <= metrics[f"test/time_below_{q}"] <= 1.0 for q in ("q10", "q50", "q90"))
    predictor = load_predictor(metrics["checkpoint"], agents=["retriever", "summarizer", "verifier"])
    probs, seconds = predictor.predict_when([WorkflowPrefix(["retriever", "summarizer"], "Verify the claim. Claim: X.")])
    assert probs.shape == (1, 3, len(predictor.agent_names) + 1) and seconds.shape == (1, 3, len(levels))
    payload = read_checkpoint(metrics["checkpoint"])
    assert payload["config"]["model"]["name"] == "graphsage" and payload["metrics"]["test/top1_k1"] == \
        metrics["test/top1_k1"]
    assert payload["init"]["text"]["encoder"]["kind"] == "hashing"
    assert (run / "checkpoints" / "best.ckpt").is_file() and (run / "csv" / "metrics.csv").is_file()


def test_multirun_all_families_with_wandb_offline(tmp_path):
    sweep = tmp_path / "sweep"
    run_train(["-m", "model=graphsage,rgcn,markov,intent_residual",
               f"hydra.sweep.dir={sweep}", "logger=wandb", *TINY], tmp_path)
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "metrics.json").exists())
    assert [p.name.split("_", 1)[1] for p in runs] == ["graphsage", "rgcn", "markov", "intent_residual"]
    for run in runs:
        metrics = json.loads((run / "metrics.json").read_text())
        assert Path(metrics["checkpoint"]).is_file()
        (wandb_run,) = (run / "wandb").glob("offline-run-*")
        assert (wandb_run / f"run-{wandb_run.name.rsplit('-', 1)[1]}.wandb").is_file()
        config = yaml.safe_load((wandb_run / "files" / "run_config.yaml").read_text())
        assert config["model"]["name"] == run.name.split("_", 1)[1]
        logged = json.loads((wandb_run / "files" / "metrics.json").read_text())
        assert logged["test/top1_k1"] == metrics["test/top1_k1"]


def compose_train(overrides: list[str], run: Path):
    paths = [f"trainer.default_root_dir={run}", f"callbacks.model_checkpoint.dirpath={run}/checkpoints"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, *paths, "logger=none"])


def test_same_config_gives_same_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("PBKV_DATA_CACHE", str(tmp_path / "cache"))
    overrides = ["model=intent_residual", *TINY]
    first = train(compose_train(overrides, tmp_path / "a"), run_dir=tmp_path / "a")
    second = train(compose_train(overrides, tmp_path / "b"), run_dir=tmp_path / "b")
    keys = metric_keys(3)
    assert [first[k] for k in keys] == [second[k] for k in keys]


def test_train_keeps_the_minilm_embeddings_of_its_texts_for_the_runs_after_it(tmp_path, monkeypatch):
    """encodings_dir: the first run encodes the data's texts and keeps them; the next one reads them
    (not one text encoded) and trains the same weights; null keeps nothing."""
    import torch

    import models.text as text

    monkeypatch.setenv("PBKV_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(text, "_MINILM_TEXTS", text.OrderedDict())  # nothing answered from this process's memory
    monkeypatch.setattr(text, "_minilm_disk", [])
    monkeypatch.setattr(text, "_shelves", {})
    monkeypatch.setattr(text, "MINILM_DISK_MIN_TEXTS", 2)  # the tiny data's 30 task texts are kept too
    kept = tmp_path / "kept"
    overrides = ["model=graphsage", "model/text_encoder=minilm", *TINY, "trainer.max_epochs=1"]
    first = train(compose_train([*overrides, f"encodings_dir={kept}"], tmp_path / "a"), run_dir=tmp_path / "a")
    files = sorted(kept.glob("minilm-*.npz"))
    assert files  # the task texts and the agents' identity texts
    text._MINILM_TEXTS.clear()
    text._shelves.clear()
    monkeypatch.setattr(text.MiniLMTextEncoder, "_encode", lambda self, texts: pytest.fail("encoded again"))
    second = train(compose_train([*overrides, f"encodings_dir={kept}"], tmp_path / "b"), run_dir=tmp_path / "b")
    assert [first[k] for k in metric_keys(3)] == [second[k] for k in metric_keys(3)]
    weights = [read_checkpoint(tmp_path / run / "predictor.pt")["state_dict"] for run in ("a", "b")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    monkeypatch.undo()
    monkeypatch.setenv("PBKV_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(text, "_minilm_disk", [])
    train(compose_train([*overrides, "encodings_dir=null"], tmp_path / "c"), run_dir=tmp_path / "c")
    assert text.encodings_kept_in() is None and sorted(kept.glob("*.npz")) == files


def test_training_in_process_equals_train_py(dataset_dir, tmp_path, monkeypatch):
    """evaluate.py trains its predictors with models.training.train_here: the same predictor, metrics
    and run folder as the command, and the process's threads, generators and environment as before."""
    import random

    import numpy as np
    import torch

    from models.text import encodings_kept_in, keep_encodings_in
    from models.training import train_here

    args = ["model=graphsage", f"data.path={dataset_dir}", *TINY]
    run_train([*args, f"hydra.run.dir={tmp_path / 'command'}"], tmp_path)
    monkeypatch.setenv("PBKV_DATA_CACHE", str(tmp_path / "cache"))
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)  # the config's torch_threads is 1
    torch.use_deterministic_algorithms(False)  # the trainer's `deterministic` turns them on
    try:
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        environ = dict(os.environ)
        expected = random.random(), np.random.rand(), torch.rand(1).item()
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        monkeypatch.setattr("models.text._minilm_disk", [])  # the caller's folder, put back after the test
        keep_encodings_in(tmp_path / "callers")
        train_here(args, tmp_path / "here")
        assert encodings_kept_in() == tmp_path / "callers"  # the training's own folder is not left behind
        assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected and dict(os.environ) == environ
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)

    command, here = (read_checkpoint(tmp_path / name / "predictor.pt") for name in ("command", "here"))
    assert command["state_dict"].keys() == here["state_dict"].keys()
    assert all(torch.equal(command["state_dict"][k], here["state_dict"][k]) for k in command["state_dict"])
    assert command["metrics"] == here["metrics"] and command["init"].keys() == here["init"].keys()
    metrics = json.loads((tmp_path / "here" / "metrics.json").read_text())
    assert metrics["checkpoint"] == str(tmp_path / "here" / "predictor.pt")
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == sorted(p.name for p in (tmp_path / "command").iterdir())
    assert "model=graphsage" in (tmp_path / "here" / ".hydra" / "overrides.yaml").read_text()
