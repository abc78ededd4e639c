"""Train a workflow predictor and write a self-contained checkpoint (docs/predictors.md).

    python train.py model=graphsage                 # also rgcn, markov, intent_residual
    python train.py model=markov data.path=DIR hydra.run.dir=RUN
    python train.py -m model=graphsage,rgcn,markov,intent_residual seed=0,1,2

The run directory gets metrics.json, predictor.pt (load it with models.load_predictor), the
Lightning checkpoints and the csv / wandb logs, all at once or not at all (data.atomic.hydra_run_dir:
a run folder is only replaced when train.py made it). The logic lives in models/training.py.
"""

import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data.atomic import hydra_run_dir
from data.config_checks import SCHEMAS, validate
from data.errors import ConfigError, run_reported
from models.training import optimized_value, train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    result = []
    status = run_reported(lambda: result.append(run(cfg, Path(HydraConfig.get().runtime.output_dir))))
    if status:
        sys.exit(status)
    return result[0]


COMMAND = "train.py"
RUN_OUTPUTS = ("metrics.json",)  # what else the run folder holds, that a checkpoint may not replace


def run(cfg: DictConfig, run_dir: Path) -> float | None:
    """Validate the config (data.config_checks) and the run directory, then train into a temporary
    folder that replaces the run directory when complete."""
    validate(cfg, SCHEMAS["train"]())
    check_checkpoint_name(cfg.checkpoint_name)
    with hydra_run_dir(run_dir, COMMAND, cfg, inputs=[cfg.data.get("path")]) as staging:
        return optimized_value(cfg, train(cfg, staging, final_dir=run_dir))


def check_checkpoint_name(name: str) -> None:
    """A file name of the run folder, not a path: `../../x.pt` would write outside it, and
    `metrics.json` would be replaced by the checkpoint."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.pt", name) or name in RUN_OUTPUTS:
        raise ConfigError(f"checkpoint_name={name}: should be a file name ending in .pt (no folder, "
                          "not starting with a dot)")


if __name__ == "__main__":
    main()
