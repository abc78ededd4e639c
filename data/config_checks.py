"""The one validation step of every command: ranges and names of its settings, checked on the
composed config before any work (pydantic models, one per config group, checked by key path).

``validate(cfg, SCHEMA)`` raises :class:`data.errors.ConfigError` with one line such as
``sim.concurrency=0: Input should be greater than or equal to 1``. Unknown keys are allowed
(groups gain keys); only the keys named here are checked. Known names (policies, prefetch
modes, KV methods and layouts, model families) come from the code that defines them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from data import CONF_DIR
from data.errors import ConfigError


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
        if value is not None and not (Path(value).is_dir() if kind == "dir" else Path(value).exists()):
            raise ValueError(f"no such {'directory' if kind == 'dir' else 'file or directory'}")
        return value
    return AfterValidator(check)


ExistingPath = Annotated[Optional[str], _existing("path")]
ExistingDir = Annotated[Optional[str], _existing("dir")]


class Group(BaseModel):
    model_config = ConfigDict(extra="allow")


class Split(Group):
    val: Fraction = 0.1
    test: Fraction = 0.1
    seed: Seed = 0

    @model_validator(mode="after")
    def _sum(self):
        if self.val + self.test >= 1:
            raise ValueError("val + test should be below 1 (the rest is the train split)")
        return self


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


def data_schema(prefix: str) -> dict[str, type[BaseModel]]:
    """The `data` group (train.py, evaluate.py): a dataset directory or a generated source."""

    class Data(Group):
        name: Text
        path: ExistingDir = None

    class Source(Group):
        n_workflows: Optional[Count] = None
        seed: Optional[Seed] = None

    class Workload(Group):  # generated workloads (data/generators.py, data/task_text.py)
        cue_noise: Probability = 0.1
        template_holdout: bool = True

    return {prefix: Data, f"{prefix}.split": Split, f"{prefix}.source": Source,
            f"{prefix}.source.workload": Workload}


# -------------------------------------------------------------------- train.py

def train_schema() -> dict[str, type[BaseModel]]:
    class Top(Group):
        seed: Seed
        horizon: Count
        checkpoint_name: Text
        torch_threads: Optional[Count] = None

    class DataModule(Group):
        max_path: Count = 32
        batch_size: Count = 256
        text_source: Annotated[str, one_of(("auto", "hidden", "encoder", "none"))] = "auto"

    class Model(Group):
        name: Annotated[str, one_of(model_families())]

    class Optimizer(Group):
        lr: Optional[Annotated[float, Field(gt=0, allow_inf_nan=False)]] = None
        weight_decay: Optional[NonNeg] = None

    class Trainer(Group):
        max_epochs: Optional[Annotated[int, Field(ge=-1, strict=True)]] = None
        min_epochs: Optional[NonNegInt] = None
        devices: Any = None

    return {"": Top, "datamodule": DataModule, "model": Model, "model.optimizer": Optimizer, "trainer": Trainer,
            **data_schema("data")}


# -------------------------------------------------------------------- data.generate / data.import_traces

def generate_schema() -> dict[str, type[BaseModel]]:
    class Top(Group):
        n_workflows: Count
        seed: Seed
        out: Text
        overwrite: bool

    return {"": Top, "split": Split}


def import_schema() -> dict[str, type[BaseModel]]:
    from data.import_traces import FORMATS

    class Top(Group):
        format: Annotated[str, one_of(FORMATS)]
        src: Annotated[str, Field(min_length=1), _existing("path")]
        out: Text
        skip_bad_lines: bool
        overwrite: bool

    return {"": Top, "split": Split}


# -------------------------------------------------------------------- models.intentkv.train

def intentkv_schema() -> dict[str, type[BaseModel]]:
    class Top(Group):
        steps: Count
        out: Text
        seed: Seed
        n_train: Count
        n_test: Count
        horizon: Count
        lam: NonNeg
        batch: Count
        lr: Annotated[float, Field(gt=0, allow_inf_nan=False)]
        weight_decay: NonNeg
        d_model: Count
        hidden: Count
        budget_frac: Probability
        model_hidden: Count
        model_layers: Count
        model_heads: Count
        threads: Count

        @model_validator(mode="after")
        def _heads(self):
            if self.model_hidden % self.model_heads:
                raise ValueError("model_hidden should be a multiple of model_heads")
            return self

    return {"": Top}


# -------------------------------------------------------------------- serving_integration.experiments.bench

def bench_schema() -> dict[str, type[BaseModel]]:
    class Args(Group):
        url: Text
        data: Annotated[str, Field(min_length=1), _existing("dir")]
        split: Annotated[str, one_of(("train", "val", "test", "all"))]
        n_workflows: NonNegInt
        concurrency: Count
        tool_time_scale: NonNeg
        token_range: Annotated[list[NonNegInt], Field(min_length=2, max_length=2)]
        request_timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)]
        out: Text
        gpu_tokens: NonNegInt
        seed: Seed

        @model_validator(mode="after")
        def _range(self):
            if self.token_range[0] >= self.token_range[1]:
                raise ValueError("token_range should be LOW HIGH with LOW < HIGH")
            return self

    return {"": Args}


# the checks of each Hydra root config, by its name in conf/
# (evaluate.py's: serving_integration/experiments/config.py settings)
SCHEMAS = {"train": train_schema, "generate": generate_schema,
           "import_traces": import_schema}
