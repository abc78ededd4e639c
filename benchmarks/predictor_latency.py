"""Latency of Predictor.predict() for batches of live workflows, and parameter counts.

    python -m benchmarks.predictor_latency runs/train/*/*/predictor.pt     # trained checkpoints
    python -m benchmarks.predictor_latency                                # untrained, from conf/model/*
    python -m benchmarks.predictor_latency runs/train/families --json OUT.json   # every predictor.pt under it

Prefixes are real ones: random (workflow, step) pairs of the data's test split (data=hover by
default), with their task text. Text encoding is excluded, as in serving, where the hidden
state comes from the LLM: every task string is encoded once before timing (the predictor's
LRU cache), so the timed calls measure vocabulary lookup, batching and the forward pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir

from data import store
from data import CONF_DIR
from models import WorkflowPrefix, load_predictor, read_checkpoint
from models.datamodule import workflows_of
from models.training import build_predictor

FAMILIES = ("markov", "graphsage", "rgcn", "intent_residual")


def train_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def live_prefixes(data: str, n: int, seed: int = 0) -> list[WorkflowPrefix]:
    """n prefixes of test-split workflows, cut after a random call of each."""
    workflows = workflows_of(store.resolve(train_config([f"data={data}"]).data).calls["test"])
    rng = np.random.default_rng(seed)
    prefixes = []
    for i in rng.integers(len(workflows), size=n):
        wf = workflows[i]
        t = int(rng.integers(len(wf.agents)))
        prefixes.append(WorkflowPrefix(wf.agents[:t + 1], wf.task, wf.hidden[t] or None))
    return prefixes


def time_predict(predictor, prefixes, repeats: int) -> tuple[float, float]:
    """Median and 90th percentile of predict() wall time, in milliseconds."""
    for _ in range(3):
        predictor.predict(prefixes)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        predictor.predict(prefixes)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), float(np.percentile(times, 90))


def predictors(args) -> list[tuple[str, torch.nn.Module]]:
    if args.checkpoints:  # a folder stands for every predictor.pt under it (a train.py sweep)
        paths = [p for path in args.checkpoints for p in (sorted(path.rglob("predictor.pt")) if path.is_dir() else [path])]
        return [(f"{read_checkpoint(path)['family']} ({path})", load_predictor(path)) for path in paths]
    built = []
    for family in args.families:
        _, predictor = build_predictor(train_config([f"data={args.data}", f"model={family}"]))
        built.append((f"{family} (untrained)", predictor.eval()))
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="*", type=Path, help="predictor.pt files (default: build each family)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--data", default="hover", help="conf/data config whose test split gives the prefixes")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64, 1024])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", help="also write the figures and table for the results page here")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prefixes = live_prefixes(args.data, max(args.batches))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; data={args.data}; "
          f"median (p90) ms per predict() call over {args.repeats} calls; text encoding excluded")
    header = f"{'predictor':<44} {'params':>9} " + " ".join(f"{f'B={b}':>16}" for b in args.batches)
    print(header)
    measured = []
    for name, predictor in predictors(args):
        predictor.predict(prefixes)  # pre-warm: encodes every task string once
        cells = []
        for batch in args.batches:
            median, p90 = time_predict(predictor, prefixes[:batch], args.repeats)
            cells.append(f"{median:8.3f} ({p90:6.3f})")
        label = name if len(name) <= 44 else "..." + name[-41:]
        print(f"{label:<44} {predictor.n_parameters():>9,} " + " ".join(f"{c:>16}" for c in cells))
        family = name.split(" (")[0]
        measured.append((family, predictor.n_parameters(), cells))
    if args.json:
        from data.atomic import write_json

        head = ["predictor", "parameters"] + [f"B={b}: median (p90) ms" for b in args.batches]
        write_json(args.json, {
            "about": f"benchmarks/predictor_latency.py: Predictor.predict() on real prefixes of data={args.data}'s "
                     f"test split, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} calls "
                     "per batch size; text encoding excluded (as in serving).",
            "figures": [{"name": f"predictor latency, {family} ({params:,} parameters)",
                         "value": ", ".join(f"{c.split('(')[0].strip()} ms at B={b}" for b, c in zip(args.batches, cells))}
                        for family, params, cells in measured],
            "tables": [{"title": "", "head": head, "rows": [[f, f"{p:,}", *(x.strip() for x in c)]
                                                            for f, p, c in measured]}]})


if __name__ == "__main__":
    main()
