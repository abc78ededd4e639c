"""The knobs of models/: one dataclass per component, each field with its one default, its range
and a help line (data.knobs), registered as the Hydra schemas of train.py's config groups:

    conf/model/*.yaml               MarkovModel, GraphSAGEModel, RGCNModel, IntentResidualModel
        predictor                   MarkovConfig, GraphSAGEConfig, RGCNConfig, IntentResidualConfig
        optimizer                   AdamWConfig
    conf/model/text_encoder/*.yaml  HashingConfig, MiniLMConfig                  (models/text.py)
    conf/trainer/*.yaml             TrainerConfig                                (pytorch_lightning.Trainer)
    conf/callbacks/*.yaml           ModelCheckpointConfig, EarlyStoppingConfig, RichProgressBarConfig
    conf/logger/*.yaml              CsvLoggerConfig, WandbLoggerConfig
    conf/train.yaml                 TrainConfig (seed, horizon, checkpoint_name, torch_threads, datamodule, time, ...)
        time                        TimeConfig: the time-until-call quantiles every family predicts
    conf/intentkv_train.yaml        IntentKVTrainConfig                          (python -m models.intentkv.train)

The predictors and encoders take their hyper-parameters as keyword arguments and check them here
(``GraphSAGEPredictor.from_corpus(corpus, dim=16)``): the constructors write no default of their own.
:func:`train_config` builds the composed train.py config into its checked form; a bad value is one
line, ``model.predictor.layers=0: Input should be greater than or equal to 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
import re
from typing import Any, List, Optional

from data.config import PREDICTOR_CACHE, TEXT_ENCODINGS, data_config
from data.knobs import (above, at_least, below, broken_rule, build, check, each, knob, nonempty, one_of, probability,
                        register)

TEXT_SOURCES = ("auto", "hidden", "encoder", "none")  # auto: the trace's hidden vectors when every call has one


class Knobs:
    """What every knobs dataclass of this module does after construction: check its fields."""

    def __post_init__(self):
        check(self)


# ------------------------------------------------------------------ predictor families

@dataclass
class MarkovConfig(Knobs):
    order: int = knob(1, "n: agents of context", at_least(0))
    alpha: float = knob(0.1, "additive smoothing of the unigram base (keeps every probability non-zero)", above(0))
    backoff: float = knob(1.0, "beta: weight of the lower-order distribution", above(0))


@dataclass
class GraphSAGEConfig(Knobs):
    dim: int = knob(128, "d: width of node states, path attention and text projection", at_least(1))
    hidden: int = knob(256, "width of the MLP head's two hidden layers", at_least(1))
    layers: int = knob(2, "GNN layers over the call graph", at_least(1))
    max_steps: int = knob(64, "absolute step positions the path attention distinguishes", at_least(1))
    dropout: float = knob(0.1, "dropout of the MLP head", at_least(0), below(1))
    use_cur: bool = knob(True, "h_cur, the current agent's GNN state (false: zeroed, an ablation)")
    use_path: bool = knob(True, "h_path, attention over the path (false: zeroed, an ablation)")
    use_text: bool = knob(True, "h_txt, the text signal (false: zeroed, an ablation)")
    identity: bool = knob(True, "embed agents by name + system prompt (the text encoder), so an agent never seen in "
                                "training is not just <unk>")
    identity_dropout: float = knob(0.15, "share of path tokens trained on their edge-less identity state",
                                   probability)


@dataclass
class RGCNConfig(GraphSAGEConfig):
    num_bases: Optional[int] = knob(None, "basis decomposition of the relation weights (null: one matrix per "
                                          "relation)", at_least(1))


@dataclass
class IntentResidualConfig(Knobs):
    prior: MarkovConfig = knob(None, "the Markov prior the residual is added to",
                               factory=lambda: MarkovConfig(order=2))
    dim: int = knob(64, "width of the request embeddings and the intent memory", at_least(1))
    hidden: int = knob(128, "width of the residual head's hidden layer", at_least(1))
    decay: float = knob(0.5, "lambda: the memory decays by exp(-lambda) per request", at_least(0))
    alpha: float = knob(1.0, "scale of the residual", at_least(0))
    use_text: bool = knob(True, "the text signal in requests and head (false: zeroed)")


# the Hydra node of each family's predictor: its hyper-parameters and the factory that takes them
@dataclass
class MarkovTarget(MarkovConfig):
    _target_: str = "models.markov.MarkovPredictor.from_corpus"
    _partial_: bool = True


@dataclass
class GraphSAGETarget(GraphSAGEConfig):
    _target_: str = "models.graphsage.GraphSAGEPredictor.from_corpus"
    _partial_: bool = True


@dataclass
class RGCNTarget(RGCNConfig):
    _target_: str = "models.graphsage.RGCNPredictor.from_corpus"
    _partial_: bool = True


@dataclass
class IntentResidualTarget(IntentResidualConfig):
    _target_: str = "models.intent.IntentResidualPredictor.from_corpus"
    _partial_: bool = True


def hyperparameters(config) -> dict:
    """A family's knobs as constructor keywords (without the Hydra keys)."""
    return {f.name: getattr(config, f.name) for f in fields(config) if not f.name.startswith("_")}


# ------------------------------------------------------------------ optimizer, text encoders

@dataclass
class AdamWConfig(Knobs):
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = knob(1e-3, "learning rate", above(0))
    weight_decay: float = knob(1e-4, "decoupled weight decay", at_least(0))


@dataclass
class HashingConfig(Knobs):
    _target_: str = "models.text.HashingTextEncoder"
    dim: int = knob(256, "hashed features (the text vector's width)", at_least(1))
    ngram_max: int = knob(2, "word 1..n-grams hashed", at_least(1))


@dataclass
class MiniLMConfig(Knobs):
    _target_: str = "models.text.MiniLMTextEncoder"
    batch_size: int = knob(64, "texts encoded per forward pass", at_least(1))
    device: str = knob("cpu", "torch device of the encoder", nonempty)


# ------------------------------------------------------------------ model groups (conf/model/*.yaml)

@dataclass
class ModelConfig(Knobs):
    name: str = knob("???", "the family (run names, W&B tags)", nonempty)
    predictor: Any = knob(None, "the family's predictor and its hyper-parameters")
    optimizer: Optional[AdamWConfig] = knob(None, "the optimizer of trainable families (null: fitted from counts)")
    scheduler: Any = knob(None, "a learning-rate scheduler factory (null: none)")
    text_encoder: Any = knob(None, "encoder of the task text and agent identities (conf/model/text_encoder)")

    def __post_init__(self):
        check(self)
        if isinstance(self.text_encoder, dict):
            target = self.text_encoder.get("_target_")
            encoders = {c._target_: c for c in (HashingConfig, MiniLMConfig)}
            cls = encoders.get(target)
            self.text_encoder = build(self.text_encoder, cls, "text_encoder") if cls else self.text_encoder


@dataclass
class MarkovModel(ModelConfig):
    name: str = "markov"
    predictor: MarkovTarget = knob(None, "order-n Markov chain with backoff", factory=MarkovTarget)


@dataclass
class GraphSAGEModel(ModelConfig):
    name: str = "graphsage"
    predictor: GraphSAGETarget = knob(None, "GraphSAGE over the call graph", factory=GraphSAGETarget)
    optimizer: Optional[AdamWConfig] = knob(None, "AdamW", factory=AdamWConfig)


@dataclass
class RGCNModel(ModelConfig):
    name: str = "rgcn"
    predictor: RGCNTarget = knob(None, "R-GCN over typed relations", factory=RGCNTarget)
    optimizer: Optional[AdamWConfig] = knob(None, "AdamW", factory=AdamWConfig)


@dataclass
class IntentResidualModel(ModelConfig):
    name: str = "intent_residual"
    predictor: IntentResidualTarget = knob(None, "intent-memory residual over a Markov prior",
                                           factory=IntentResidualTarget)
    optimizer: Optional[AdamWConfig] = knob(None, "AdamW (3e-3: the residual starts at zero)",
                                            factory=lambda: AdamWConfig(lr=3e-3))


MODEL_CONFIGS = {cls.name: cls for cls in (MarkovModel, GraphSAGEModel, RGCNModel, IntentResidualModel)}


# ------------------------------------------------------------------ trainer, callbacks, loggers

@dataclass
class TrainerConfig(Knobs):
    """The pytorch_lightning.Trainer arguments train.py sets; `+trainer.NAME=VALUE` passes any other
    one through, unchecked."""

    _target_: str = "pytorch_lightning.Trainer"
    default_root_dir: str = "${hydra:runtime.output_dir}"
    min_epochs: Optional[int] = knob(1, "epochs before early stopping may end the run", at_least(0))
    max_epochs: Optional[int] = knob(100, "epochs at most (-1: no limit); early stopping ends runs well before",
                                     at_least(-1))
    accelerator: str = knob("auto", "auto: the CPU here, a GPU when one is present; cpu, gpu", nonempty)
    devices: Any = knob(1, "devices to train on (Lightning's `devices`)")
    deterministic: bool = knob(True, "deterministic algorithms: same config, same metrics")
    log_every_n_steps: int = knob(10, "training steps between logged losses", at_least(1))
    check_val_every_n_epoch: int = knob(1, "epochs between validations (early stopping watches them)", at_least(1))
    enable_model_summary: bool = knob(False, "print the layer summary before training")


@dataclass
class ModelCheckpointConfig(Knobs):
    _target_: str = "pytorch_lightning.callbacks.ModelCheckpoint"
    dirpath: str = "${hydra:runtime.output_dir}/checkpoints"
    filename: str = knob("best", "the kept checkpoint's name", nonempty)
    monitor: str = knob("val/loss", "the metric that picks the kept weights", nonempty)
    mode: str = knob("min", "keep the lowest (min) or highest (max) monitored value", one_of(("min", "max")))
    save_top_k: int = knob(1, "checkpoints kept", at_least(-1))
    save_last: bool = knob(False, "also keep the last epoch's weights")
    auto_insert_metric_name: bool = knob(False, "the metric's name in the file name")


@dataclass
class EarlyStoppingConfig(Knobs):
    _target_: str = "pytorch_lightning.callbacks.EarlyStopping"
    monitor: str = knob("val/loss", "the metric watched", nonempty)
    mode: str = knob("min", "stop when it stops falling (min) or rising (max)", one_of(("min", "max")))
    patience: int = knob(8, "validations without improvement before stopping", at_least(0))
    min_delta: float = knob(1e-4, "the smallest change that counts as improvement", at_least(0))


@dataclass
class RichProgressBarConfig(Knobs):
    _target_: str = "pytorch_lightning.callbacks.RichProgressBar"


@dataclass
class CsvLoggerConfig(Knobs):
    _target_: str = "pytorch_lightning.loggers.CSVLogger"
    save_dir: str = "${hydra:runtime.output_dir}"
    name: str = knob("csv", "folder of the metrics.csv under the run directory")
    version: str = knob("", "subfolder ('' : none)")


@dataclass
class WandbLoggerConfig(Knobs):
    _target_: str = "pytorch_lightning.loggers.WandbLogger"
    save_dir: str = "${hydra:runtime.output_dir}"
    project: str = knob("pbkv", "W&B project", nonempty)
    name: str = knob("${model.name}-${data.name}-seed${seed}", "run name", nonempty)
    group: str = knob("${data.name}", "runs compared together", nonempty)
    job_type: str = knob("${task_name}", "W&B job type")
    tags: List[str] = knob(None, "run tags", factory=lambda: ["${model.name}", "${data.name}"])
    offline: bool = knob(True, "offline run (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it)")
    log_model: bool = knob(False, "upload checkpoints to W&B")


CALLBACK_CONFIGS = {"model_checkpoint": ModelCheckpointConfig, "early_stopping": EarlyStoppingConfig,
                    "rich_progress_bar": RichProgressBarConfig}
LOGGER_CONFIGS = {"csv": CsvLoggerConfig, "wandb": WandbLoggerConfig}


# ------------------------------------------------------------------ when the next calls arrive (models/timing.py)

def _quantile_list(v) -> Optional[str]:
    if list(v) != sorted(set(v)) or not all(0 < q < 1 for q in v):
        return "should be increasing, distinct, each strictly between 0 and 1"
    if 0.5 not in v:
        return "should include 0.5 (the median, whose error metrics.json reports)"
    return None


@dataclass
class TimeConfig(Knobs):
    """The time until each of the K predicted calls arrives (models/timing.py): which quantiles every
    family predicts, how the neural ones learn them, how the Markov one estimates them."""

    quantiles: List[float] = knob(None, "the quantiles of the time until each predicted call (the one list: "
                                        "Markov tables, neural heads and metrics use it)", nonempty, _quantile_list,
                                  factory=lambda: [0.1, 0.5, 0.9])
    offset_s: float = knob(0.1, "log time is log(seconds + offset_s): gaps below about this count as immediate",
                           above(0))
    loss_weight: float = knob(1.0, "weight of the time head's pinball loss beside the cross-entropy (it trains "
                                   "the time head only: the next-agent weights never see it)", at_least(0))
    hidden: int = knob(64, "width of the neural families' time head's hidden layer", at_least(1))
    min_samples: int = knob(5, "gaps an (agent -> next agent) transition (Markov) or an agent needs before its own "
                               "empirical distribution is used; fewer: back off to the agent's, then to all gaps",
                            at_least(1))
    paths: int = knob(1000, "Markov: paths sampled per chain state for the steps k >= 2 (seeded)", at_least(1))


# ------------------------------------------------------------------ train.py's root

@dataclass
class DataModuleConfig(Knobs):
    _target_: str = "models.datamodule.TraceDataModule"
    _recursive_: bool = False  # data.source is built and cached by data.store.resolve, not by instantiate
    # wiring, not knobs: train.py's data node and root knobs (checked there)
    data: Any = "${data}"
    horizon: Any = "${horizon}"
    seed: Any = "${seed}"
    max_path: int = knob(32, "agents of the path the predictor sees (older calls are dropped)", at_least(1))
    batch_size: int = knob(256, "examples per training step", at_least(1))
    text_source: str = knob("auto", "h_txt from: auto (the trace's hidden vectors when every call has one, else "
                                    "the text encoder), hidden, encoder, none", one_of(TEXT_SOURCES))
    hidden_dim: Optional[int] = knob(None, "with hidden vectors: the predictor's input size, reached by a fixed "
                                           "random projection seeded by `seed` (stored in the checkpoint); null: "
                                           "the vectors as they are", at_least(1))


def _checkpoint_file_name(name: str) -> Optional[str]:
    """A file name of the run folder, not a path: `../../x.pt` would write outside it, and
    `metrics.json` would be replaced by the checkpoint."""
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.pt", name) and name != "metrics.json":
        return None
    return "should be a file name ending in .pt (no folder, not starting with a dot)"


@dataclass
class TrainConfig(Knobs):
    task_name: str = "train"
    seed: int = knob(0, "seeds everything: same config, same metrics", at_least(0))
    horizon: int = knob(3, "K: steps predicted per forward pass", at_least(1))
    checkpoint_name: str = knob("predictor.pt", "the checkpoint's file name in the run directory (a name, not a "
                                "path; not metrics.json, which the run writes too)", _checkpoint_file_name)
    torch_threads: Optional[int] = knob(1, "intra-op threads: 1 is fastest for these small models on 2 cores and "
                                           "gives the same numbers under every launcher (null: torch's default)",
                                        at_least(1))
    optimized_metric: Optional[str] = knob(None, "the metric returned to a sweeper (hparams_search sets it)")
    encodings_dir: Optional[str] = knob(f"{PREDICTOR_CACHE}/{TEXT_ENCODINGS}",
                                        "where MiniLM embeddings of the data's texts are kept for later runs, "
                                        "the very floats encoding them again gives (null: this run only)")
    datamodule: DataModuleConfig = knob(None, "examples: one per agent call", factory=DataModuleConfig)
    time: TimeConfig = knob(None, "the time until each predicted call (quantiles, head, loss weight)",
                            factory=TimeConfig)
    data: Any = knob(None, "the dataset (conf/data, data/config.py)")
    model: Any = knob(None, "the predictor family (conf/model)")
    trainer: Any = knob(None, "the Lightning Trainer (conf/trainer)")
    callbacks: Any = knob(None, "Lightning callbacks (conf/callbacks)")
    logger: Any = knob(None, "csv and W&B loggers (conf/logger)")


def train_config(cfg) -> TrainConfig:
    """train.py's composed config as its checked form: each group by its own knobs class."""
    top = build({k: cfg[k] for k in ("task_name", "seed", "horizon", "checkpoint_name", "torch_threads",
                                     "optimized_metric", "encodings_dir", "datamodule", "time") if k in cfg},
                TrainConfig)
    top.data = data_config(cfg.data)
    name = cfg.model.get("name")
    if name not in MODEL_CONFIGS:
        raise_unknown("model.name", name, MODEL_CONFIGS)
    top.model = build(cfg.model, MODEL_CONFIGS[name], "model")
    # trainer, callbacks and loggers name the run directory (${hydra:runtime.output_dir}), known only
    # inside a Hydra run: their knobs are checked unresolved (none of them is an interpolation)
    trainer = {k: v for k, v in unresolved(cfg.trainer).items() if k in {f.name for f in fields(TrainerConfig)}}
    top.trainer = build(trainer, TrainerConfig, "trainer")
    top.callbacks = _entries(cfg.get("callbacks"), CALLBACK_CONFIGS, "callbacks")
    top.logger = _entries(cfg.get("logger"), LOGGER_CONFIGS, "logger")
    return top


def unresolved(node) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=False) if node is not None else {}


def _entries(group, classes: dict, prefix: str) -> dict:
    return {name: build(node, classes[name], f"{prefix}.{name}") if name in classes else node
            for name, node in unresolved(group).items() if node is not None}


def raise_unknown(key: str, value, known) -> None:
    from data.errors import ConfigError

    raise ConfigError(f"{key}={value}: should be one of {', '.join(known)}")


# ------------------------------------------------------------------ python -m models.intentkv.train

INTENTKV_DATA = ("tau_bench", "synthetic")


@dataclass
class IntentKVTrainConfig(Knobs):
    """The IntentKV residual head's training and its comparison with the baselines (docs/intentkv.md)."""

    sessions: str = knob("tau_bench", "tau_bench (the published airline trajectories) or synthetic (generated, "
                                  "models/intentkv/sessions.py)", one_of(INTENTKV_DATA))
    tau_bench_src: str = knob("data/traces/tau_bench/gpt-4o-airline.json", "tau-bench trajectories file (or its "
                              ".gz beside it)", nonempty)
    trials: List[int] = knob(None, "tau-bench trials used (each of the 50 tasks was run 4 times, trials 0-3)",
                             nonempty, each(at_least(0)), factory=lambda: [0])
    n_sessions: int = knob(160, "synthetic sessions generated", at_least(3))
    val: float = knob(0.2, "share of tasks (synthetic: sessions) in the validation split", probability)
    test: float = knob(0.2, "share of tasks (synthetic: sessions) held out for test", above(0), below(1))
    steps: int = knob(200, "optimiser steps", at_least(1))
    out: str = knob("runs/intentkv", "output folder (replaced whole, only when empty or made by this command)",
                    nonempty)
    seed: int = knob(0, "first seed: of the synthetic sessions, and of the split, head and sampling of repeat 0",
                     at_least(0))
    repeats: int = knob(3, "seeds seed .. seed+repeats-1 (a split and a head each); intervals are over them",
                        at_least(1))
    horizon: int = knob(5, "label: a word in the argument values of the next `horizon` tool calls", at_least(1))
    lam: float = knob(0.5, "decay of the intent memory", at_least(0))
    window: int = knob(510, "MiniLM window: tokens per forward pass besides [CLS] and [SEP] (at most 510)",
                       at_least(1))
    stride: int = knob(255, "MiniLM windows start every `stride` tokens (divides window; = window: no overlap)",
                       at_least(1))
    snapkv_window: int = knob(32, "SnapKV's observation window: the last queries of the latest span", at_least(1))
    sink: int = knob(4, "StreamingLLM's attention sinks", at_least(0))
    batch: int = knob(8, "decision points per step", at_least(1))
    lr: float = knob(3e-3, "AdamW learning rate", above(0))
    weight_decay: float = knob(1e-4, "AdamW weight decay", at_least(0))
    d_model: int = knob(32, "residual head width", at_least(1))
    hidden: int = knob(64, "residual head hidden width", at_least(1))
    bce_weight: float = knob(1.0, "weight of the binary cross-entropy term of the loss", at_least(0))
    rank_weights: List[float] = knob(None, "weights of the hard-negative pairwise ranking term tried; the one with "
                                           "the best validation AUROC of repeat 0 is used for every repeat",
                                     nonempty, each(at_least(0)), factory=lambda: [0.5, 1.0, 2.0])
    hard_negatives: int = knob(16, "ranking term: each positive against the top-scoring negatives of its decision "
                                   "point's sample", at_least(1))
    sample_negatives: int = knob(256, "negatives per decision point per step: the top ones by rule score and random "
                                      "ones, half each (every positive is in the sample)", at_least(1))
    budgets: List[float] = knob(None, "evaluation budgets: protected + this share of the other tokens", nonempty,
                                each(probability), factory=lambda: [0.1, 0.25, 0.5])
    threads: int = knob(1, "torch threads while training", at_least(1))

    def __post_init__(self):
        check(self)
        if self.window > 510 or self.window % self.stride:
            raise broken_rule(self, ("window", "stride"), "window should be at most 510 and a multiple of stride")
        if self.val + self.test >= 1:
            raise broken_rule(self, ("val", "test"), "val + test should be below 1 (the rest is the train split)")


def register_schemas() -> None:
    for cls in MODEL_CONFIGS.values():
        register("model", cls, f"{cls.name}_schema")
    register("model/text_encoder", HashingConfig, "hashing_schema")
    register("model/text_encoder", MiniLMConfig, "minilm_schema")
    register("trainer", TrainerConfig, "schema")
    for name, cls in {**CALLBACK_CONFIGS, **LOGGER_CONFIGS}.items():
        register("callbacks" if name in CALLBACK_CONFIGS else "logger", cls, f"{name}_schema")
    register(None, TrainConfig, "train_schema")
    register(None, IntentKVTrainConfig, "intentkv_train_schema")


register_schemas()
