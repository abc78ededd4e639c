"""Replay workflows through the serving simulator under each cache policy (docs/simulator.md).

    python evaluate.py                                              # every policy on hover
    python evaluate.py policies=[lru,kvflow,pbkv_lae,pbkv,oracle] sim.gpu_tokens=300000 sim.concurrency=32
    python evaluate.py predictor.checkpoint=RUN/predictor.pt prefetch=[none,conservative]
    python evaluate.py -m sim.gpu_tokens=150000,300000,600000

Writes summary.json, hit_rate.png and latency.png to the run directory, prints the table and logs
both to W&B (offline unless WANDB_MODE says otherwise). Logic: serving_integration/experiments/evaluation.py.
"""

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data.atomic import check_output
import data.config  # noqa: F401  (registers the data schemas conf/ names)
from data.errors import EXIT_CONFIG, run_reported
from serving_integration.experiments.config import Composed, settings  # registers the schemas Hydra composes with
from serving_integration.experiments.evaluation import evaluate
from serving_integration.experiments.presentation import format_table, log_wandb, plot

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    status = run_reported(run, cfg, Path(HydraConfig.get().runtime.output_dir))
    if status:
        sys.exit(status)


def run(cfg: DictConfig, run_dir: Path) -> None:
    """Check the config (serving_integration/experiments/config.py) and the run directory, then evaluate."""
    knobs = settings(cfg)
    check_output(run_dir, [cfg.data.path, knobs.predictor.checkpoint])
    summary = evaluate(cfg, run_dir, knobs)
    plots = plot(summary["rows"], run_dir)
    if knobs.wandb.enabled:
        log_wandb(cfg, summary, plots, run_dir)
    print(format_table(summary["rows"]))
    print(f"summary: {run_dir / 'summary.json'}")


def cli() -> None:
    """`python evaluate.py ...`. Hydra exits with status 1 when it cannot compose the config (a value
    of the wrong type, an unknown key or option, named in its message): a bad setting, so status 2,
    as for every other; a run or sweep that started keeps its own status."""
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not Composed.done:
            sys.exit(EXIT_CONFIG)
        raise


if __name__ == "__main__":
    cli()
