"""Shared plumbing of the `python -m data.*` commands: Hydra-style key=value arguments composed
against conf/, and one way to report failures (message on stderr, exit status 1)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from data import store
from data.errors import TraceValidationError
from data.schema import Traces
from data.stats import format_stats

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(name: str, argv: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=argv)


def run_command(config_name: str, body: Callable[[DictConfig], None], argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        body(compose_config(config_name, argv))
    except TraceValidationError as e:
        print(f"error: {e}\nnothing was written", file=sys.stderr)
        return 1
    except (HydraException, OmegaConfBaseException, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def store_traces(name: str, traces: Traces, cfg: DictConfig) -> None:
    """Split, save atomically to cfg.out, and print the dataset's statistics."""
    ds = store.build(traces, **cfg.split)
    store.save(ds, cfg.out, overwrite=cfg.overwrite)
    print(format_stats(name, ds.meta["stats"]))
