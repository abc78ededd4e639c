"""python -m data.generate workload=hover n_workflows=1000 seed=0 out=DIR"""

from __future__ import annotations

import sys
import time

from hydra.utils import instantiate

from data import store
from data.cli import run_command
from data.stats import format_stats


def generate(cfg) -> None:
    started = time.perf_counter()
    workload = instantiate(cfg.workload)
    traces = workload.generate(cfg.n_workflows, cfg.seed)
    ds = store.build(traces, **cfg.split)
    store.save(ds, cfg.out, overwrite=cfg.overwrite)
    print(format_stats(workload.name, ds.meta["stats"]))
    print(f"wrote {cfg.out} in {time.perf_counter() - started:.2f}s")


if __name__ == "__main__":
    sys.exit(run_command("generate", generate))
