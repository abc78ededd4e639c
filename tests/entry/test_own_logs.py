"""A user's own logs end to end, as docs/predictors.md describes: chat-format JSONL ->
`data.import_traces format=chat` -> `train.py data.path=DIR` -> `evaluate.py data.path=DIR
predictor.train=graphsage`. The logs are a small help-desk framework written here (not Who&When)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*treespec")]
OFFLINE = {"WANDB_MODE": "offline", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
FAST_TRAINING = ["model/text_encoder=hashing", "trainer.max_epochs=2", "datamodule.batch_size=64"]
SYSTEM = {"router": "You route help-desk tickets to the right specialist.",
          "searcher": "You search the knowledge base and quote the relevant articles.",
          "answerer": "You write the reply to the customer from the quoted articles.",
          "escalator": "You escalate tickets that need a human, with a summary."}


def help_desk_logs(n: int, seed: int = 0) -> list[str]:
    """Chat-format lines: each call sees its system prompt, the ticket and the transcript so far."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        ticket = f"Ticket {i}: my {rng.choice(['invoice', 'login', 'export', 'printer'])} is broken"
        urgent = rng.random() < 0.3
        path = ["router", "searcher", "answerer"] + (["escalator"] if urgent else []) + ["router"]
        transcript = []
        for step, agent in enumerate(path):
            messages = [{"role": "system", "content": SYSTEM[agent]}, {"role": "user", "content": ticket}, *transcript]
            completion = f"{agent} output {i}.{step} " + "details " * int(rng.integers(20, 200))
            lines.append(json.dumps({"workflow_id": f"ticket-{i}", "workload": "help_desk", "agent": agent, "step": step,
                                     "messages": messages, "completion": completion}))
            transcript.append({"role": "assistant", "content": completion})
    return lines


def run(*args, env=None):
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **OFFLINE, **(env or {})})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_own_chat_logs_import_train_evaluate(tmp_path):
    src = tmp_path / "help_desk.jsonl"
    src.write_text("\n".join(help_desk_logs(40)) + "\n")
    data = tmp_path / "dataset"
    run("-m", "data.import_traces", "format=chat", f"src={src}", f"out={data}", "split.val=0.2", "split.test=0.3")
    meta = json.loads((data / "meta.json").read_text())
    assert meta["format"] == "chat" and meta["splits"]["test"]["workflows"] == 12

    run("train.py", f"data.path={data}", "logger=csv", f"hydra.run.dir={tmp_path / 'train'}", *FAST_TRAINING)
    metrics = json.loads((tmp_path / "train" / "metrics.json").read_text())
    assert 0.0 <= metrics["test/top1_k1"] <= 1.0
    from models import load_predictor

    predictor = load_predictor(tmp_path / "train" / "predictor.pt")  # agents known by name and system prompt
    assert f"router {SYSTEM['router']}" in predictor.agent_texts

    overrides = "[" + ",".join(f"'{o}'" for o in FAST_TRAINING) + "]"
    run("evaluate.py", f"data.path={data}", "predictor.train=graphsage", f"predictor.train_overrides={overrides}",
        f"predictor.cache_dir={tmp_path / 'predictors'}", "policies=[lru,pbkv_lae,pbkv]", "prefetch=[none]",
        "sim.gpu_tokens=20000", "sim.concurrency=4", "wandb.enabled=false", f"hydra.run.dir={tmp_path / 'eval'}")
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["predictor"]["family"] == "graphsage" and summary["predictor"]["online_backoff"]
    rows = {(r["policy"], r["trust"]): r for r in summary["rows"]}
    assert set(rows) == {("lru", "none"), ("pbkv_lae", "none"), ("pbkv", "outcome"), ("pbkv", "always")}
    assert all(r["workload"] == "help_desk" and r["calls"] >= 12 * 4 for r in rows.values())
    # pbkv rows carry their predictor's test top-1 (train.py's, on this dataset's test split)
    assert rows[("pbkv", "outcome")]["predictor_top1_k1"] == summary["predictor"]["test_metrics"]["test/top1_k1"]
    # the cached predictor's metrics.json names its checkpoint where it is, not the folder it was trained in
    (cached,) = (tmp_path / "predictors").glob("graphsage-*/metrics.json")
    assert json.loads(cached.read_text())["checkpoint"] == str(cached.parent / "predictor.pt")
