"""The loop of collected traces with the serving model's hidden state, on a real SGLang 0.5.23 CPU server:
collect (experiments.bench_collect: pbkv_lae with --hidden-state, bench --save-trace: every call's
hidden state of its last prefill token), train graphsage on what was collected with `datamodule.text_source=hidden`
(train.py, as a user runs it), serve that checkpoint under pbkv with --hidden-state, replay again.

Sized like tests/server/test_sglang_cpu.py: small hover workflows (short passages and system
prompts, outputs scaled to a tenth), two fresh servers one after the other, each stopped after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from data import store
from data.cli import compose_config
from data.generate import generate
from serving_integration.experiments import bench, bench_collect
from serving_integration.server.launch import LocalServer
from tests.conftest import REPO
from tests.server.test_sglang_cpu import SMALL_HOVER

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore")]

TINY_HIDDEN_SIZE = 128  # serving_integration/server/tiny_model.py
COLLECTED_WORKFLOWS = 16


def replay(server, dataset, split, out, *extra):
    assert bench.main(["--url", server.url, "--data", str(dataset), "--split", split, "--concurrency", "2",
                       "--tool-time-scale", "0", "--out", str(out), "--no-progress", *extra]) == 0
    (row,) = json.loads((out / "summary.json").read_text())["rows"]
    return row


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    root = tmp_path_factory.mktemp("hidden-loop")
    dataset = root / "hover"
    generate(compose_config("generate", [*SMALL_HOVER, f"out={dataset}"]))
    ds = store.load(dataset)
    # collect: a fresh pbkv_lae --hidden-state server, the train split's first workflows replayed with --save-trace
    collected = root / "collected"
    assert bench_collect.main(["--data", str(dataset), "--split", "train", "--n-workflows", str(COLLECTED_WORKFLOWS),
                               "--concurrency", "2", "--out", str(collected),
                               "--json", str(root / "figures.json")]) == 0
    (collect_row,) = json.loads((collected / "bench" / "summary.json").read_text())["rows"]
    # train: graphsage on the collected hidden states (train.py, hashing identities, two epochs)
    run = root / "train"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PBKV_DATA_CACHE": str(root / "cache")}
    trained = subprocess.run([sys.executable, "train.py", "model=graphsage", f"data.path={collected / 'dataset'}",
                              "datamodule.text_source=hidden", "debug=train", f"hydra.run.dir={run}"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    # serve it: pbkv with the checkpoint that reads hidden states, the test split replayed
    launch = ["--cpu", "--max-total-tokens", "32000", "--hidden-state", "--policy", "pbkv",
              "--checkpoint", str(run / "predictor.pt")]
    with LocalServer(launch, log_path=root / "serve.log", health_timeout_s=400) as server:
        serve_row = replay(server, dataset, "test", root / "serve")
    train_ids = list(dict.fromkeys(r["workflow_id"] for r in ds.rows("train")))[:COLLECTED_WORKFLOWS]
    return {"root": root, "collect": collect_row, "serve": serve_row, "checkpoint": run / "predictor.pt",
            "n_collected": sum(r["workflow_id"] in set(train_ids) for r in ds.rows("train")),
            "figures": json.loads((root / "figures.json").read_text()), "test_calls": len(ds.rows("test"))}


def test_collected_traces_carry_the_hidden_state_of_every_call(loop):
    assert loop["collect"]["failed_calls"] == 0
    collected = store.load(loop["root"] / "collected" / "dataset")
    figures = {f["name"]: f["value"] for f in loop["figures"]["figures"]}
    assert figures["calls with a hidden state captured"] == f"{loop['n_collected']} of {loop['n_collected']} (0 failed)"
    assert figures["hidden state cost per request, mean"].endswith(" ms")
    rows = collected.rows()
    assert len(rows) == loop["n_collected"]
    assert all(len(r["hidden"]) == TINY_HIDDEN_SIZE for r in rows)
    assert len({tuple(r["hidden"][:4]) for r in rows}) > 1  # states of different prompts differ
    assert collected.meta["hidden"]["size"] == TINY_HIDDEN_SIZE
    assert collected.meta["hidden"]["model"].endswith("tiny-llama")
    counters = loop["collect"]["plugin_counters"]
    assert counters["hidden_captured"] == loop["n_collected"] and counters.get("hidden_capture_failed", 0) == 0
    assert loop["collect"]["hidden_cost_ms"]["n"] == loop["n_collected"]


def test_the_checkpoint_trained_on_them_serves_with_the_hidden_state(loop):
    from models import read_checkpoint

    assert read_checkpoint(loop["checkpoint"])["init"]["text"]["source"] == "hidden"
    row = loop["serve"]
    assert row["failed_calls"] == 0 and row["calls"] == loop["test_calls"]
    counters = row["plugin_counters"]
    assert counters["hidden_captured"] == loop["test_calls"] and counters.get("hidden_missing", 0) == 0
    assert counters["predictor_calls"] > 0 and counters["predicted_with_hidden"] > 0
    assert counters.get("hook_errors", 0) == 0 and counters.get("predictor_error", 0) == 0
    assert row["hidden_cost_ms"]["mean"] > 0
