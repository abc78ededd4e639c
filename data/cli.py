"""Shared plumbing of the `python -m data.*` commands: Hydra key=value overrides composed against
conf/ (typed by the schemas of data/config.py), the settings built into their checked dataclass,
and one way to report failures (one line on stderr; data.errors.run_reported gives the exit status)."""

from __future__ import annotations

import sys
from typing import Callable

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import data.config  # noqa: F401  (registers the schemas the configs name)
from data import CONF_DIR, store
from data.errors import run_reported
from data.knobs import build
from data.schema import Traces
from data.stats import format_stats


def compose_config(name: str, argv: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=argv)


def run_command(config_name: str, schema: type, body: Callable[[DictConfig], None],
                argv: list[str] | None = None) -> int:
    """Compose conf/<config_name>.yaml with the overrides, check it (``build(cfg, schema)``), then
    run `body`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv

    def checked():
        cfg = compose_config(config_name, argv)
        build(cfg, schema)
        body(cfg)
    return run_reported(checked)


def store_traces(name: str, traces: Traces, cfg: DictConfig, command: str, inputs=()) -> None:
    """Split, save atomically to cfg.out, and print the dataset's statistics."""
    ds = store.build(traces, **cfg.split)
    store.save(ds, cfg.out, overwrite=cfg.overwrite, command=command, inputs=inputs)
    print(format_stats(name, ds.meta["stats"]))
