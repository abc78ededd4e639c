"""evaluate.py's checks of the serving groups (sim, kv, pbkv, tlru, kvflow, predictor, cost_model
and the root keys), on the composed config before any work (pydantic models, one per config group,
checked by key path). The `data` node is data.config.data_config's. These checks move into the
serving groups' knobs dataclasses (data.knobs), as data/ and models/ did.

``validate(cfg, SCHEMA)`` raises :class:`data.errors.ConfigError` with one line such as
``sim.concurrency=0: Input should be greater than or equal to 1``. Unknown keys are allowed
(groups gain keys); only the keys named here are checked. Known names (policies, prefetch
modes, KV methods and layouts, model families) come from the code that defines them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from data import CONF_DIR
from data.errors import ConfigError
from data.published import located


Positive = Annotated[int, Field(gt=0, strict=True)]
Count = Annotated[int, Field(ge=1, strict=True)]
NonNegInt = Annotated[int, Field(ge=0, strict=True)]
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, strict=True)]
Text = Annotated[str, Field(min_length=1)]


def one_of(names) -> AfterValidator:
    names = tuple(names)

    def check(value):
        if value not in names:
            raise ValueError(f"should be one of {', '.join(map(str, names))}")
        return value
    return AfterValidator(check)


def _existing(kind: str):
    def check(value):
        # a file may also be found as its compressed copy NAME.gz (the traces in data/traces)
        if value is not None and not (Path(value).is_dir() if kind == "dir" else located(value).exists()):
            raise ValueError(f"no such {'directory' if kind == 'dir' else 'file or directory'}")
        return value
    return AfterValidator(check)


ExistingPath = Annotated[Optional[str], _existing("path")]
ExistingDir = Annotated[Optional[str], _existing("dir")]


class Group(BaseModel):
    model_config = ConfigDict(extra="allow")


def model_families() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))


def _values(node) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def validate(cfg: DictConfig | Mapping, schema: Mapping[str, type[BaseModel]], flags: bool = False) -> None:
    """Check each key path of `schema` ("" is the root) against its model; the first problem is
    raised as a ConfigError naming the full key, its value and what is allowed. Only the keys a
    model names are read (and resolved). `flags`: the settings are command-line options
    (argparse), named ``--some-option`` in the message."""
    for prefix, model in schema.items():
        values = {}
        for name in model.model_fields:
            key = f"{prefix}.{name}" if prefix else name
            try:
                if isinstance(cfg, DictConfig):
                    node = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=True)
                else:
                    node = cfg.get(key, _ABSENT)
                if node is not _ABSENT:
                    values[name] = _values(node)
            except OmegaConfBaseException as e:
                raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None
        try:
            model.model_validate(values)
        except ValidationError as e:
            line = message(prefix, e.errors()[0], values)
            if flags:
                line = re.sub(r"^(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), line)
            raise ConfigError(line) from None


_ABSENT = object()


def shown(value) -> str:
    """A value as one writes it in a key=value override."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{shown(v)}" for k, v in value.items()) + "}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and (value == "" or value.strip() != value):
        return repr(value)
    return str(value)


def message(prefix: str, error: dict, values: Mapping) -> str:
    loc = list(error["loc"])
    key = ".".join(p for p in [prefix, *(str(p) for p in loc if not isinstance(p, int))] if p)
    key += "".join(f"[{p}]" for p in loc if isinstance(p, int))
    reason = re.sub(r" after validation, not \d+$", "", error["msg"].removeprefix("Value error, "))
    if error["type"] == "missing":
        return f"{key} is required"
    if not loc:  # a rule across keys (model_validator): show the keys its reason names
        named = {k: v for k, v in values.items() if re.search(rf"\b{re.escape(k)}\b", reason)} or values
        where = f"{prefix}: " if prefix else ""
        return f"{where}{', '.join(f'{k}={shown(v)}' for k, v in named.items())}: {reason}"
    return f"{key}={shown(error.get('input'))}: {reason}"


def _nonempty_unique(values):
    if len(set(values)) != len(values):
        raise ValueError("should not repeat a name")
    return values


# -------------------------------------------------------------------- evaluate.py

def evaluate_schema() -> dict[str, type[BaseModel]]:
    from models.intentkv.pruning import LAYOUTS, METHODS
    from serving_integration.cache.policies import PBKV, POLICIES as EVICTION_POLICIES, Prefetch
    from serving_integration.cache.predictions import NoisySource
    from serving_integration.experiments.evaluation import POLICIES
    from serving_integration.cache.router import ROUTERS

    class Top(Group):
        seed: Seed
        split: Annotated[str, one_of(("train", "val", "test", "all"))]
        policies: Annotated[list[Annotated[str, one_of(POLICIES)]], Field(min_length=1),
                            AfterValidator(_nonempty_unique)]
        prefetch: Annotated[list[Annotated[str, one_of(Prefetch.MODES)]], Field(min_length=1),
                            AfterValidator(_nonempty_unique)]

    class Sim(Group):
        gpu_tokens: Positive
        hicache_ratio: NonNeg
        page_size: Count
        concurrency: Count
        max_prefill_tokens: Count
        max_running_requests: Count
        predictor_cost_s: NonNeg = 0.0
        charge_measured_predictor_time: bool = False
        n_workflows: Optional[Count] = None
        replicas: Count = 1
        routing: Annotated[str, one_of(ROUTERS)] = "none"

        @model_validator(mode="after")
        def _routed(self):
            if self.replicas > 1 and self.routing == "none":
                raise ValueError(f"sim.replicas={self.replicas} needs a routing policy (sim.routing: "
                                 f"{', '.join(n for n in ROUTERS if n != 'none')})")
            return self

    class Kv(Group):
        budget: Optional[Count] = None
        method: Annotated[str, one_of(METHODS)]
        layouts: Annotated[list[Annotated[str, one_of(LAYOUTS)]], Field(min_length=1),
                           AfterValidator(_nonempty_unique)]
        policy: Annotated[str, one_of(n for n, cls in EVICTION_POLICIES.items() if not cls.uses_predictions)]
        chunk_tokens: Count
        lam: NonNeg

    class Pbkv(Group):
        horizon: Count
        gamma: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
        trust: Union[Annotated[str, one_of(PBKV.TRUST)],
                     Annotated[list[Annotated[str, one_of(PBKV.TRUST)]], Field(min_length=1),
                               AfterValidator(_nonempty_unique)]] = "adaptive"
        trust_threshold: Probability = 0.5
        trust_margin: Probability = 0.1
        trust_window: Count = 32

        @model_validator(mode="after")
        def _band(self):
            if not 0 <= self.trust_threshold - self.trust_margin <= self.trust_threshold + self.trust_margin <= 1:
                raise ValueError(f"pbkv.trust_threshold +- pbkv.trust_margin must lie in [0, 1]; got "
                                 f"{self.trust_threshold} +- {self.trust_margin}")
            return self

    class Tlru(Group):
        threshold: NonNeg = 0
        next_prompt_estimate: NonNeg = 0

    class Kvflow(Group):
        hold_step: NonNegInt = 3

    class Predictor(Group):
        checkpoint: ExistingPath = None
        train: Optional[Annotated[str, one_of(model_families())]] = None
        max_unknown: Probability = 0.5
        noise: Probability = 0.0
        noise_kind: Annotated[str, one_of(NoisySource.KINDS)] = "uniform"
        online: bool = True
        online_beta: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 10.0
        train_overrides: list[str] = []
        cost_s: NonNeg = 0.0

    PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]

    class CostModel(Group):  # serving_integration/simulator/cost_model.py
        name: Text
        params: PositiveFloat
        layers: Count
        q_heads: Count
        kv_heads: Count
        head_dim: Count
        dtype_bytes: Count
        peak_flops: PositiveFloat
        mem_bandwidth: PositiveFloat
        pcie_bandwidth: PositiveFloat
        mfu: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.5
        bandwidth_efficiency: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.75
        pcie_efficiency: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.8
        step_overhead_s: NonNeg = 0.002

    # predictor before sim: sim.predictor_cost_s is ${predictor.cost_s}, name the key a user sets
    return {"": Top, "predictor": Predictor, "sim": Sim, "kv": Kv, "pbkv": Pbkv, "tlru": Tlru, "kvflow": Kvflow,
            "cost_model": CostModel}
