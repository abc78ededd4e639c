"""What train.py runs: build data, predictor, Trainer from the config; fit; evaluate; save.

Every object comes from a ``_target_`` config (conf/train.yaml and its groups). Families
without trainable weights (markov) are fitted from counts when built and skip ``fit``; all go
through the same validation, test, metrics.json and checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from data import cpu_kernels
from data.atomic import atomic_file, hydra_run_dir, write_json
from models.base import Predictor
from models.checkpoint import save_predictor
from models.config import train_config
from models.datamodule import TraceDataModule
from models.metrics import METRIC_NAMES, time_metric_names
from models.module import PredictorModule
from models.text import encodings_kept_in, keep_encodings_in

log = logging.getLogger(__name__)

# Two CPU cores: loader workers would only compete with the model for them.
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")


COMMAND = "train.py"  # what made a run folder (data.atomic.check_run_dir): this module's job, however started


def run_train(cfg: DictConfig, run_dir: Path) -> dict:
    """train.py's job: check the config (models.config.train_config), then train into a temporary
    folder that replaces `run_dir` when complete (data.atomic.hydra_run_dir)."""
    train_config(cfg)
    with hydra_run_dir(run_dir, COMMAND, cfg, inputs=[cfg.data.get("path")]) as staging:
        return train(cfg, staging, final_dir=run_dir)


def train_here(overrides: Sequence[str], run_dir: str | Path) -> dict:
    """What ``python train.py OVERRIDES hydra.run.dir=RUN_DIR`` does, in this process: the same
    composed config, run folder and checkpoint, without starting an interpreter and importing torch,
    Lightning and PyG again (evaluate.py trains its predictors so: about 5 CPU-s less each). The
    process-wide state a training sets (torch threads, deterministic algorithms, the random
    generators, Lightning's seed variables) is put back afterwards."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    run_dir = Path(run_dir).resolve()
    overrides = [*overrides, f"hydra.run.dir={run_dir}", "hydra.job.name=train"]
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app of this repository (evaluate.py)
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    else:
        with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = str(run_dir)
    job = copy.deepcopy(cfg)
    with read_write(job), open_dict(job):
        del job["hydra"]
    with _hydra_job(cfg), _process_state_kept():
        return run_train(job, run_dir)


@contextlib.contextmanager
def _hydra_job(cfg: DictConfig) -> Iterator[None]:
    """`cfg`'s Hydra node as the job's (what ${hydra:runtime.output_dir} reads), the caller's after."""
    instance = HydraConfig.instance()
    before = instance.cfg
    instance.set_config(cfg)
    try:
        yield
    finally:
        instance.cfg = before


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """The caller's threads, generators, environment and MiniLM embeddings folder after the block: a
    training in evaluate.py must not change the replays that follow it, nor how fast they run."""
    threads, encodings = torch.get_num_threads(), encodings_kept_in()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    generators = random.getstate(), np.random.get_state(), torch.get_rng_state()
    environ = dict(os.environ)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        keep_encodings_in(encodings)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        random.setstate(generators[0])
        np.random.set_state(generators[1])
        torch.set_rng_state(generators[2])
        for name in set(os.environ) - set(environ):  # PL_GLOBAL_SEED, PL_SEED_WORKERS, CUBLAS_WORKSPACE_CONFIG
            del os.environ[name]
        os.environ.update(environ)


def build_predictor(cfg: DictConfig) -> tuple[TraceDataModule, Predictor]:
    """The data module (set up: vocabulary, call graph, examples) and an untrained predictor."""
    encoder_cfg = cfg.model.get("text_encoder")
    text_encoder = instantiate(encoder_cfg) if encoder_cfg else None
    datamodule = instantiate(cfg.datamodule, text_encoder=text_encoder, time=cfg.get("time"))  # models/timing.py
    datamodule.setup()
    predictor = instantiate(cfg.model.predictor)(datamodule.corpus)
    predictor.text_features.attach(text_encoder if predictor.text_spec.source == "encoder" else None)
    if getattr(predictor, "identity_proj", None) is not None:  # agents embedded by the same encoder
        predictor.identity_features.attach(text_encoder)
    return datamodule, predictor


def instantiate_group(group: DictConfig | None) -> list:
    """Callbacks or loggers: one object per entry of the group that has a _target_."""
    return [instantiate(c) for c in (group or {}).values() if isinstance(c, DictConfig) and "_target_" in c]


def metric_keys(horizon: int, time_levels=()) -> list[str]:
    """The per-step metrics, then the time metrics per step and over all steps (models.metrics)."""
    keys = [f"{split}/{name}_k{k}" for split in ("val", "test") for k in range(1, horizon + 1)
            for name in METRIC_NAMES]
    if time_levels:
        names = time_metric_names(time_levels)
        keys += [f"{split}/{name}{suffix}" for split in ("val", "test")
                 for suffix in [f"_k{k}" for k in range(1, horizon + 1)] + [""] for name in names]
    return keys


def time_fields(predictor: Predictor) -> dict:
    """What metrics.json says of the times: their source in the traces, whether every family fell
    back to the per-agent empirical table (no gaps), the quantile levels and the log offset."""
    spec = predictor.require_time()
    return {"time_source": spec.source, "time_fallback": spec.fallback, "time_quantiles": list(spec.quantiles),
            "time_offset_s": spec.offset_s}


def clean(value):
    return None if value is None or value != value else float(value)  # NaN -> None for JSON


def train(cfg: DictConfig, run_dir: str | Path | None = None, final_dir: str | Path | None = None) -> dict:
    """Fit (unless count-based), evaluate on val and test, write the checkpoint and metrics.json
    into `run_dir`; `final_dir`: where the run folder will be once complete (train.py writes into a
    temporary sibling), the folder metrics.json names the checkpoint in."""
    run_dir = Path(run_dir or HydraConfig.get().runtime.output_dir)
    if cfg.get("torch_threads"):
        torch.set_num_threads(cfg.torch_threads)  # results depend on it: reductions split differently
    keep_encodings_in(cfg.get("encodings_dir"))  # the data's texts, encoded once for the runs after this one
    pl.seed_everything(cfg.seed, workers=True)
    datamodule, predictor = build_predictor(cfg)
    optimizer, scheduler = cfg.model.get("optimizer"), cfg.model.get("scheduler")
    module = PredictorModule(predictor, instantiate(optimizer) if optimizer else None,
                             instantiate(scheduler) if scheduler else None, time_weight=datamodule.time.loss_weight)
    loggers = instantiate_group(cfg.get("logger"))
    trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=instantiate_group(cfg.get("callbacks")),
                                      logger=loggers or False)
    config = OmegaConf.to_container(cfg, resolve=True)
    for logger in loggers:
        logger.log_hyperparams(config)

    started = time.perf_counter()
    best = None
    if predictor.trainable:
        trainer.fit(module, datamodule=datamodule)
        checkpointing = trainer.checkpoint_callback
        best = "best" if checkpointing is not None and checkpointing.best_model_path else None
    train_seconds = time.perf_counter() - started
    results = {**trainer.validate(module, datamodule=datamodule, ckpt_path=best, verbose=False)[0],
               **trainer.test(module, datamodule=datamodule, ckpt_path=best, verbose=False)[0]}

    exact = {**module.split_metrics.get("val", {}), **module.split_metrics.get("test", {})}
    keys = metric_keys(predictor.horizon, predictor.time_quantiles)
    metrics = {key: clean(exact.get(key, results.get(key))) for key in keys}
    metrics.update(time_fields(predictor))
    metrics["cpu_kernels"] = cpu_kernels.fingerprint()  # they decide the floats too (data/cpu_kernels.py)
    training = {"train_seconds": round(train_seconds, 3), "epochs": trainer.current_epoch if predictor.trainable else 0,
                "n_parameters": predictor.n_parameters(), "family": predictor.family}
    checkpoint = save_predictor(predictor, run_dir / cfg.checkpoint_name, config, metrics, training)
    metrics["checkpoint"] = str(Path(final_dir or run_dir) / checkpoint.name)
    ceiling = datamodule.dataset.meta.get("bayes_ceiling")
    if ceiling:  # generated data: the best top-1 any predictor can reach (data/generators.py)
        metrics["bayes_ceiling"] = ceiling
    write_json(run_dir / "metrics.json", metrics)
    finish_loggers(loggers, metrics, training, OmegaConf.to_yaml(config))
    log.info("%s: %s", predictor.family, summary_line(metrics, predictor.horizon, training))
    return {**metrics, **{k: clean(v) for k, v in results.items()}}


def finish_loggers(loggers: list, metrics: dict, training: dict, config_yaml: str) -> None:
    final = {k: v for k, v in metrics.items() if isinstance(v, float)}
    final.update({f"train/{k}": v for k, v in training.items() if isinstance(v, (int, float))})
    for logger in loggers:
        logger.log_metrics(final)
        logger.finalize("success")
        if isinstance(logger, pl.loggers.WandbLogger):
            run = logger.experiment
            run.summary.update(final)
            # Offline runs keep config and summary only inside the binary .wandb file; files in
            # run.dir are readable now and uploaded by `wandb sync` with the run.
            with atomic_file(Path(run.dir, "run_config.yaml")) as tmp:
                tmp.write_text(config_yaml)
            write_json(Path(run.dir, "metrics.json"), {**metrics, **training})
            run.finish()


def summary_line(metrics: dict, horizon: int, training: dict) -> str:
    top1 = " ".join(f"k{k}={metrics[f'test/top1_k{k}']:.3f}" for k in range(1, horizon + 1)
                    if metrics[f"test/top1_k{k}"] is not None)
    return f"test top-1 {top1}; {training['n_parameters']} parameters; trained {training['train_seconds']:.1f}s"


def optimized_value(cfg: DictConfig, metrics: dict) -> float | None:
    """The value a Hydra sweeper (optuna) minimises or maximises, named by cfg.optimized_metric."""
    name = cfg.get("optimized_metric")
    if not name:
        return None
    if name not in metrics:
        raise KeyError(f"optimized_metric {name!r} is not among the run's metrics: {sorted(metrics)}")
    return metrics[name]
