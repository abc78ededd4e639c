"""evaluate.py's own knobs, one dataclass per config group: its root keys (`EvaluateConfig`), what
drives pbkv's predictions (`PredictorConfig`, conf/predictor), the IntentKV rows (`KvConfig`,
conf/kv) and W&B (`WandbConfig`, conf/wandb). The policies' and the simulator's knobs live with
them (serving_integration/cache/config.py, serving_integration/simulator/config.py).

Importing this module registers every schema evaluate.py composes with (these and the cache's and
simulator's, imported here): conf/evaluate.yaml and each group's YAML start their defaults list
with `- schema`, so an unknown key or a value of the wrong type fails when Hydra composes the
config. `settings(cfg)` then builds the checked objects, one ConfigError line for a bad value
(docs/configuration.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from data import CONF_DIR
from data.config import PREDICTOR_CACHE
from data.errors import ConfigError
from data.knobs import at_least, build, check, each, knob, nonempty, one_of, probability, register, unique
from serving_integration.cache.config import PREFETCH_MODES, ContinuumConfig, KvflowConfig, NoiseConfig, \
    OnlineBackoffConfig, PbkvConfig, TlruConfig
from serving_integration.simulator.config import SimConfig
from serving_integration.simulator.cost_model import CostModel

SPLITS = ("train", "val", "test", "all")


def evaluated_policies() -> tuple[str, ...]:
    """Every eviction policy (cache/policies.py), plus pbkv_perfect and pbkv_time_perfect: pbkv and
    pbkv_time fed the true future agents (and tool times)."""
    from serving_integration.cache.policies import POLICIES

    return (*POLICIES, "pbkv_perfect", "pbkv_time_perfect")


def model_families() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))


def kv_methods() -> tuple[str, ...]:
    from models.intentkv.pruning import METHODS

    return METHODS


def kv_layouts() -> tuple[str, ...]:
    from models.intentkv.pruning import LAYOUTS

    return LAYOUTS


def unpredicted_policies() -> tuple[str, ...]:
    from serving_integration.cache.policies import POLICIES

    return tuple(n for n, cls in POLICIES.items() if not cls.uses_predictions)


def existing_path(value) -> Optional[str]:
    return None if Path(value).exists() else "no such file or directory"


def strings(value) -> Optional[str]:
    return each(lambda v: None if isinstance(v, str) else "Input should be a valid string")(value)


@dataclass(frozen=True)
class EvaluateConfig:
    """conf/evaluate.yaml's own keys."""

    task_name: str = knob("evaluate", "names the run folder (runs/TASK_NAME/...; experiments set their own)",
                          nonempty)
    seed: int = knob(0, "seeds the workload, the simulator and the predictor of a single replay", at_least(0))
    seeds: Optional[list] = knob(None, "e.g. [0,1,2]: one replay per seed; rows: the mean, {metric}_ci95 (95% CI, "
                                 "Student t) and {metric}_per_seed", nonempty, each(at_least(0)), unique)
    split: str = knob("test", "replay this split (test: unseen by the predictor; val: to choose knobs; all)",
                      one_of(SPLITS))
    policies: list = knob(None, "the policies replayed (experiments/evaluation.py)", nonempty,
                          each(one_of(evaluated_policies)), unique,
                          factory=lambda: ["lru", "lfu", "tlru", "kvflow", "kvflow_ideal", "continuum", "lru_prefetch",
                                                  "pbkv_lae", "pbkv", "pbkv_perfect", "oracle"])
    prefetch: list = knob(None, "prefetch modes of pbkv, pbkv_perfect and oracle (PBKV as the paper runs it: "
                          "conservative)", nonempty, each(one_of(PREFETCH_MODES)), unique,
                          factory=lambda: ["none", "conservative"])
    headroom: bool = knob(False, "attribute each row's eviction-bound headroom (rows without prefetch): by reuse "
                                 "distance in time, by what the reading workflow was doing, by how many workflows "
                                 "keep cache (serving_integration/simulator/headroom.py)")
    headroom_integer: list = knob(None, "with headroom: the policies whose rows also search the integer optimum of "
                                  "their eviction bound (how loose the LP is; HiGHS's branch and bound, "
                                  "simulator/headroom.py INTEGER_NODES nodes: up to minutes a row on the real "
                                  "traces)", each(one_of(evaluated_policies)), unique, factory=list)
    per_workload: dict = knob(None, "values other settings look up by data.name, e.g. "
                              "${per_workload.gpu_tokens.${data.name}} (experiment=robust)", factory=dict)

    def __post_init__(self):
        check(self)
        if self.headroom_integer and not self.headroom:
            raise ConfigError(f"headroom_integer={list(self.headroom_integer)}: it searches the integer optimum "
                              "beside the headroom attribution; set headroom=true too")


@dataclass(frozen=True)
class PredictorConfig(NoiseConfig, OnlineBackoffConfig):
    """conf/predictor: what drives pbkv's predictions: a checkpoint, a family train.py trains on the
    dataset (once, cached), or neither: Markov (order 1) fitted on the train split."""

    checkpoint: Optional[str] = knob(None, "a train.py checkpoint (predictor.pt); its horizon must be pbkv.horizon",
                                     existing_path)
    train: Optional[str] = knob(None, "or a family that train.py trains on this dataset", one_of(model_families))
    train_overrides: list = knob(None, "extra train.py overrides for predictor.train (e.g. ['trainer.max_epochs=5'])",
                                 strings, factory=list)
    cache_dir: str = knob(PREDICTOR_CACHE, "where predictor.train's checkpoints (and the MiniLM embeddings of "
                                           "their data's texts) are cached", nonempty)
    max_unknown: float = knob(0.5, "share of the data's agents the checkpoint may not know (they map to <unk>)",
                              probability)
    tabulate: bool = knob(True, "a network's predictions of every prefix computed before the replay, in large "
                                "batches (false: once per scheduler step, as a server does; float32 rows then "
                                "differ by a few 1e-7 with the batch they share)")


@dataclass(frozen=True)
class KvConfig:
    """conf/kv: IntentKV rows (docs/intentkv.md), off unless kv.budget is set."""

    budget: Optional[int] = knob(None, "KV tokens kept per request (null: no IntentKV rows)", at_least(1))
    method: str = knob("intent", "the pruning method", one_of(kv_methods))
    layouts: list = knob(None, "how a pruned request is laid out, a row each", nonempty, each(one_of(kv_layouts)),
                         unique, factory=lambda: ["compaction", "sentinel"])
    policy: str = knob("lru", "eviction policy of the KV rows", one_of(unpredicted_policies))
    chunk_tokens: int = knob(64, "pruning granularity in the simulator", at_least(1))
    lam: float = knob(0.5, "intent memory decay: M_t = exp(-lam) M_(t-1) + Enc(q_t)", at_least(0))

    def __post_init__(self):
        check(self)


@dataclass(frozen=True)
class WandbConfig:
    """conf/wandb: one W&B run per evaluate run (`wandb sync` uploads an offline one)."""

    enabled: bool = knob(True, "log the summary and plots to W&B")
    project: str = knob("pbkv", "the W&B project", nonempty)
    mode: str = knob("${oc.env:WANDB_MODE,offline}", "online | offline | disabled (default: $WANDB_MODE, else "
                     "offline)", one_of(("online", "offline", "disabled")))

    def __post_init__(self):
        check(self)


@dataclass(frozen=True)
class EvaluateSchema(EvaluateConfig):
    """The root schema of conf/evaluate.yaml: its own keys, and one slot per group (each typed by the
    group's own schema when the group is composed)."""

    data: Any = None
    cost_model: Any = None
    sim: Any = None
    predictor: Any = None
    pbkv: Any = None
    tlru: Any = None
    kvflow: Any = None
    continuum: Any = None
    kv: Any = None
    wandb: Any = None


@dataclass(frozen=True)
class Settings:
    """Everything evaluate.py reads of its config, checked: one object per group."""

    run: EvaluateConfig
    sim: SimConfig
    cost_model: CostModel
    predictor: PredictorConfig
    pbkv: PbkvConfig
    tlru: TlruConfig
    kvflow: KvflowConfig
    continuum: ContinuumConfig
    kv: KvConfig
    wandb: WandbConfig


GROUPS = {"predictor": PredictorConfig, "sim": SimConfig, "cost_model": CostModel, "pbkv": PbkvConfig,
          "tlru": TlruConfig, "kvflow": KvflowConfig, "continuum": ContinuumConfig, "kv": KvConfig,
          "wandb": WandbConfig}


def settings(cfg: DictConfig) -> Settings:
    """The composed evaluate config as checked objects; the first bad value is raised as a one-line
    ConfigError naming its full key (`sim.concurrency=0: ...`). The `data` group is checked by
    data/ (data.config.data_config), its owner."""
    from data.config import data_config

    unknown = sorted(set(cfg) - {f.name for f in fields(EvaluateSchema)} - {"hydra"})
    if unknown:  # added with +KEY=VALUE, which Hydra lets past the schema
        raise ConfigError(f"{unknown[0]}: not a setting of evaluate.py (known: "
                          f"{', '.join(sorted(f.name for f in fields(EvaluateSchema)))})")
    root = build(OmegaConf.masked_copy(cfg, [f.name for f in fields(EvaluateConfig)]), EvaluateConfig)
    # predictor first: a bad path is the first thing to name
    groups = {name: build(cfg[name], cls, name) for name, cls in GROUPS.items()}
    data_config(cfg.data)
    if cfg.sim.seed != SimConfig.seed:
        raise ConfigError(f"sim.seed={cfg.sim.seed}: the simulator's seed is set by seed (or seeds), not here")
    sim = groups["sim"]
    if sim.gpu_working_set_fraction is not None and sim.gpu_tokens != SimConfig.gpu_tokens:
        raise ConfigError(f"sim.gpu_working_set_fraction={sim.gpu_working_set_fraction}: sim.gpu_tokens="
                          f"{sim.gpu_tokens} is set too; give the GPU size one way")
    knobs = Settings(run=root, **groups)
    check_horizon(knobs.predictor, knobs.pbkv)
    return knobs


def check_horizon(predictor: PredictorConfig, pbkv: PbkvConfig) -> None:
    """One K per run: a checkpoint predicts its own number of steps, and the rows are labelled with
    pbkv.horizon, so the two must agree (predictor.train trains with pbkv.horizon)."""
    if not predictor.checkpoint:
        return
    from models import read_checkpoint

    horizon = read_checkpoint(predictor.checkpoint).get("init", {}).get("horizon")
    if horizon is not None and horizon != pbkv.horizon:
        raise ConfigError(f"pbkv.horizon={pbkv.horizon}: predictor.checkpoint={predictor.checkpoint} predicts "
                          f"{horizon} steps; set pbkv.horizon={horizon}")


def register_schemas() -> None:
    register(None, EvaluateSchema, "evaluate_schema")
    for group, cls in (("predictor", PredictorConfig), ("kv", KvConfig), ("wandb", WandbConfig)):
        register(group, cls)


register_schemas()
