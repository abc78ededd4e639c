"""python -m data.generate workload=hover n_workflows=1000 seed=0 out=DIR   (knobs: data.config.GenerateConfig)"""

from __future__ import annotations

import sys
import time

from hydra.utils import instantiate

from data.atomic import check_replaceable
from data.cli import run_command, store_traces
from data.config import GenerateConfig
from data.store import DATASET_WRITERS
from data.generators import generate as generate_traces


def generate(cfg) -> None:
    started = time.perf_counter()
    check_replaceable(cfg.out, DATASET_WRITERS)  # before the work: a refusal costs nothing
    workload = instantiate(cfg.workload, _convert_="all")
    store_traces(workload.label, generate_traces(workload, cfg.n_workflows, cfg.seed), cfg, "data.generate")
    print(f"wrote {cfg.out} in {time.perf_counter() - started:.2f}s")


def main(argv: list[str] | None = None) -> int:
    return run_command("generate", GenerateConfig, generate, argv)


if __name__ == "__main__":
    sys.exit(main())
