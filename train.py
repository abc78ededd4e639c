"""Train a workflow predictor and write a self-contained checkpoint (docs/predictors.md).

    python train.py model=graphsage                 # also rgcn, markov, intent_residual
    python train.py model=markov data.path=DIR hydra.run.dir=RUN
    python train.py -m model=graphsage,rgcn,markov,intent_residual seed=0,1,2

Hydra key=value overrides of conf/train.yaml; each knob's default, range and help live in one
dataclass (models/config.py, data/config.py; docs/configuration.md). The run directory gets
metrics.json, predictor.pt (load it with models.load_predictor), the Lightning checkpoints and the
csv / wandb logs, all at once or not at all (data.atomic.hydra_run_dir: a run folder is only
replaced when train.py made it). The logic lives in models/training.py.
"""

import sys
from pathlib import Path

from data import cpu_kernels

cpu_kernels.pin()  # before anything loads torch: the same kernels on every x86-64 machine (data/cpu_kernels.py)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data.cli import exit_2_if_not_composed
from data.errors import run_reported
from models.training import optimized_value, run_train  # models.config registers the schemas conf/ names


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    result = []
    status = run_reported(lambda: result.append(run(cfg, Path(HydraConfig.get().runtime.output_dir))))
    if status:
        sys.exit(status)
    return result[0]


def run(cfg: DictConfig, run_dir: Path) -> float | None:
    return optimized_value(cfg, run_train(cfg, run_dir))


if __name__ == "__main__":
    exit_2_if_not_composed(main, "train")
