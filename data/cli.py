"""Shared plumbing of the commands (`python -m data.*`; train.py and evaluate.py for their exit
status): Hydra key=value overrides composed against conf/ (typed by the schemas of data/config.py),
the settings built into their checked dataclass, and one way to report failures (one line on
stderr; data.errors.run_reported gives the exit status)."""

from __future__ import annotations

import sys
from typing import Callable

from hydra import compose, initialize_config_dir
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

import data.config  # noqa: F401  (registers the schemas the configs name)
from data import CONF_DIR, store
from data.errors import EXIT_CONFIG, run_reported
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


def exit_2_if_not_composed(main, config_name: str) -> None:
    """Run a @hydra.main entry point (train.py, evaluate.py) so that a bad setting is one line and
    exit status 2, as everywhere else. A single run's overrides are first composed with Hydra's
    compose API against the same config and schemas: an unknown key or a wrong type is then the
    project's one line. A sweep (-m) or Hydra's own flags go to Hydra as they are; there a config
    Hydra cannot compose still exits 2 (Hydra's own status is 1, and its message is its own): the
    config lists :class:`Composed` under `hydra.callbacks` to tell that from a run that failed."""
    import sys

    argv = sys.argv[1:]
    if argv and not any(a.startswith("-") for a in argv):
        status = run_reported(compose_config, config_name, argv)
        if status:
            sys.exit(status)
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not Composed.done:
            sys.exit(EXIT_CONFIG)
        raise


class Composed(Callback):
    """A Hydra callback (`hydra.callbacks.composed` in conf/evaluate.yaml and conf/hydra/default.yaml):
    records that Hydra composed the config and started the run or sweep."""

    done = False

    def on_run_start(self, config, **kwargs) -> None:
        Composed.done = True

    def on_multirun_start(self, config, **kwargs) -> None:
        Composed.done = True

