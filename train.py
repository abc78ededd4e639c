"""Train a workflow predictor and write a self-contained checkpoint (design.md section 4).

    python train.py model=graphsage                 # also rgcn, markov, intent_residual
    python train.py model=markov data.path=DIR hydra.run.dir=RUN
    python train.py -m model=graphsage,rgcn,markov,intent_residual seed=0,1,2

The run directory gets metrics.json, predictor.pt (load it with models.load_predictor), the
Lightning checkpoints and the csv / wandb logs. The logic lives in models/training.py.
"""

import hydra
from omegaconf import DictConfig

from models.training import optimized_value, train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return optimized_value(cfg, train(cfg))


if __name__ == "__main__":
    main()
