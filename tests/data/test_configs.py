"""Every option of every config group composes into the root that uses it, through the groups'
structured-config schemas where they have one (an unknown key or a wrong type fails at compose
time), and every `_target_` in the composed config names an importable callable that accepts the
keys given to it."""

from __future__ import annotations

import importlib
import inspect

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

import data.config
import models.config
from tests.conftest import REPO
from serving_integration.experiments import config as evaluate_config  # registers evaluate's schemas

CONF = REPO / "conf"
# the groups each root selects in its defaults list (experiments and debug configs belong to one root)
ROOT_GROUPS = {
    "train": ["data", "model", "model/text_encoder", "trainer", "callbacks", "logger", "train_experiment",
              "hparams_search", "debug", "signal"],
    "evaluate": ["data", "cost_model", "sim", "predictor", "pbkv", "tlru", "kvflow", "continuum", "kv", "wandb",
                 "experiment", "debug"],
}
ROOT_ONLY = {"debug": {"train": ["train"], "evaluate": ["evaluate"]}}


CHECKS = {"train": models.config.train_config, "evaluate": evaluate_config.settings}


def options(group: str, root: str) -> list[str]:
    names = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    return ROOT_ONLY.get(group, {}).get(root, names)


CASES = [(root, group, option) for root, groups in ROOT_GROUPS.items() for group in groups
         for option in options(group, root)]


def test_every_group_option_is_covered():
    covered = {group for groups in ROOT_GROUPS.values() for group in groups}
    on_disk = {str(p.relative_to(CONF)) for p in CONF.rglob("*") if p.is_dir() and any(p.glob("*.yaml"))}
    # workload/ is composed inside data/ (data/*.yaml select it); hydra/ holds launchers and logging
    assert on_disk - covered == {"workload", "hydra", "hydra/launcher", "hydra/job_logging"}


def test_experiments_do_not_cross_roots():
    assert not set(options("experiment", "evaluate")) & set(options("train_experiment", "train"))
    for name in options("train_experiment", "train"):
        with initialize_config_dir(str(CONF), version_base="1.3"), pytest.raises(Exception):
            compose(config_name="evaluate", overrides=[f"train_experiment={name}"])


def targets(node, path="cfg"):
    """(path, node) of every mapping with a `_target_` in a composed config."""
    if isinstance(node, DictConfig) and not node._is_none():  # a typed group set to null is a None DictConfig
        if "_target_" in node:
            yield path, node
        for key in node:
            if key != "hydra":
                yield from targets(node._get_node(key), f"{path}.{key}")
    elif isinstance(node, ListConfig) and not node._is_none():
        for i, item in enumerate(node):
            yield from targets(item, f"{path}[{i}]")


def resolve_target(name: str):
    module, _, attr = name.rpartition(".")
    try:
        obj = importlib.import_module(module)
        return getattr(obj, attr)
    except (ImportError, AttributeError):  # Class.method
        module, _, cls = module.rpartition(".")
        return getattr(getattr(importlib.import_module(module), cls), attr)


@pytest.mark.parametrize("root,group,option", CASES, ids=[f"{r}:{g}={o}" for r, g, o in CASES])
def test_option_composes_and_targets_bind(root, group, option):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(config_name=root, overrides=[f"{group}={option}"], return_hydra_config=True)
    assert cfg.task_name
    CHECKS[root](cfg)  # the settings checks accept every shipped option (none too strict)
    for path, node in targets(cfg):
        if path.startswith("cfg.hydra"):
            continue
        target = resolve_target(node._target_)
        kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=False).items() if not k.startswith("_")}
        if inspect.isclass(target) or callable(target):
            try:
                signature = inspect.signature(target)
            except (TypeError, ValueError):  # builtins without a signature
                continue
            if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
                unknown = set(kwargs) - set(signature.parameters)
                assert not unknown, f"{path}: {node._target_} takes no {sorted(unknown)}"



# ------------------------------------------------------------------ data/ and models/ groups: typed by their schemas
# Each option of these groups is composed against its knobs dataclass (data/config.py, models/config.py):
# every node has the dataclass as its type, so an unknown key or a value of the wrong type fails as
# Hydra composes, and no YAML file writes a value equal to its dataclass's default (one home per knob).

WORKLOAD_CLASSES = {"hover": "Hover", "swebench": "SweBench", "financebench": "FinanceBench"}
WORKLOAD_CLASSES |= {f"{name}_transcript": cls for name, cls in WORKLOAD_CLASSES.items()}  # transcript memory
GENERATED = {o: data.config.GeneratedDataConfig for o in WORKLOAD_CLASSES}
TYPED = [  # (root, overrides, node, its schema)
    *[("train", [f"data={o}"], "data", GENERATED.get(o, data.config.ImportedDataConfig)) for o in options("data", "train")],
    *[("generate", ["out=x", f"workload={o}"], "workload", data.config.WORKLOAD_CONFIGS[f"data.generators.{cls}"])
      for o, cls in WORKLOAD_CLASSES.items()],
    *[("train", [f"model={o}"], "model", models.config.MODEL_CONFIGS[o]) for o in options("model", "train")],
    ("train", ["model/text_encoder=hashing"], "model.text_encoder", models.config.HashingConfig),
    ("train", ["model/text_encoder=minilm"], "model.text_encoder", models.config.MiniLMConfig),
    *[("train", [f"trainer={o}"], "trainer", models.config.TrainerConfig) for o in options("trainer", "train")],
    ("train", [], "callbacks.early_stopping", models.config.EarlyStoppingConfig),
    ("train", [], "logger.wandb", models.config.WandbLoggerConfig),
    ("train", ["debug=train"], "", models.config.TrainConfig),
    *[("train", [f"train_experiment={o}"], "", models.config.TrainConfig) for o in options("train_experiment", "train")],
    *[("train", [f"hparams_search={o}"], "", models.config.TrainConfig) for o in options("hparams_search", "train")],
    ("generate", ["out=x"], "", data.config.GenerateConfig),
    ("import_traces", ["format=chat", "src=.", "out=x"], "", data.config.ImportConfig),
    ("intentkv_train", [], "", models.config.IntentKVTrainConfig),
]


def composed(root, overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(config_name=root, overrides=overrides)


def node_at(cfg, key):
    return OmegaConf.select(cfg, key) if key else cfg


def first_knob(schema) -> tuple[str, object]:
    """A knob with a plain (bool or number) default, in the schema or a group nested in it: (key, default)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if not f.name.startswith("_") and isinstance(f.default, (bool, int, float)):
            return f.name, f.default
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            name, default = first_knob(hints[f.name])
            return f"{f.name}.{name}", default
    raise AssertionError(f"{schema.__name__} has no scalar knob")


@pytest.mark.parametrize("root, overrides, key, schema", TYPED, ids=[f"{r}:{' '.join(o)}:{k}" for r, o, k, _ in TYPED])
def test_data_and_model_configs_are_typed_by_their_knobs(root, overrides, key, schema):
    from hydra.errors import ConfigCompositionException

    cfg = composed(root, overrides)
    node = node_at(cfg, key)
    assert OmegaConf.get_type(node) is schema
    prefix = f"{key}." if key else ""
    with pytest.raises(ConfigCompositionException, match="Could not override"):
        composed(root, overrides + [f"{prefix}no_such_knob=1"])
    name, default = first_knob(schema)
    wrong = "not-a-number" if not isinstance(default, bool) else "maybe"
    with pytest.raises(ConfigCompositionException):
        composed(root, overrides + [f"{prefix}{name}={wrong}"])


def yaml_files():
    groups = ["data", "workload", "model", "model/text_encoder", "trainer", "callbacks", "logger", "debug",
              "train_experiment", "hparams_search", "signal"]
    roots = ["train.yaml", "generate.yaml", "import_traces.yaml", "intentkv_train.yaml"]
    return [CONF / r for r in roots] + [p for g in groups for p in sorted((CONF / g).glob("*.yaml"))]


def leaves(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            if k not in ("defaults", "hydra"):
                yield from leaves(v, f"{path}.{k}" if path else str(k))
    else:
        yield path, node


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(CONF)))
def test_no_yaml_file_repeats_a_default(path):
    """A value a YAML file writes differs from the one its schema would give (the composed config
    without that file's own values is the schema's)."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    group = str(path.parent.relative_to(CONF))
    repeated = []
    for key, value in leaves(raw):
        if key.startswith("_") or "." not in key and group in ("debug", "train_experiment", "hparams_search"):
            continue
        schema_default = default_of(group, path.stem, key)
        if schema_default is not NO_DEFAULT and schema_default == value:
            repeated.append(f"{key}={value}")
    assert repeated == [], f"{path.name} repeats its schema's defaults: {repeated}"


NO_DEFAULT = object()


def default_of(group, option, key):
    """The schema default of `key` in the config a YAML file of `group` is merged into."""
    if group == ".":
        schema = {"train": models.config.TrainConfig, "generate": data.config.GenerateConfig,
                  "import_traces": data.config.ImportConfig, "intentkv_train": models.config.IntentKVTrainConfig}[option]
    elif group == "workload":
        schema = data.config.WORKLOAD_CONFIGS[f"data.generators.{WORKLOAD_CLASSES[option]}"]
    elif group == "data":
        schema = GENERATED.get(option, data.config.ImportedDataConfig)
    elif group == "model":
        schema = models.config.MODEL_CONFIGS[option]
    elif group == "model/text_encoder":
        schema = {"hashing": models.config.HashingConfig, "minilm": models.config.MiniLMConfig}[option]
    elif group == "trainer":
        schema = models.config.TrainerConfig
    else:  # @package _global_ files, callbacks and loggers: compared against the root's composed defaults
        return NO_DEFAULT
    value = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return NO_DEFAULT
        value = value[part]
    return value


# ------------------------------------------------------------------ docs/configuration-data.md shows the dataclasses
def _fields(cls):
    import dataclasses

    return tuple(f.name for f in dataclasses.fields(cls))


DOCUMENTED = [  # (knobs class, fields left out: shown in another table, or wiring)
    (data.config.SplitConfig, ()), (data.config.WorkloadConfig, ()),
    *[(cls, _fields(data.config.WorkloadConfig)) for cls in data.config.WORKLOAD_CONFIGS.values()],
    (data.config.GeneratedDataConfig, ()), (data.config.GeneratedSourceConfig, ()),
    (data.config.ImportedSourceConfig, ()), (data.config.GenerateConfig, ()), (data.config.ImportConfig, ()),
    (models.config.TrainConfig, ("task_name", "datamodule", "time", "data", "model", "trainer", "callbacks", "logger")),
    (models.config.DataModuleConfig, ("data", "horizon", "seed")), (models.config.TimeConfig, ()),
    (models.config.MarkovConfig, ()), (models.config.GraphSAGEConfig, ()),
    (models.config.RGCNConfig, _fields(models.config.GraphSAGEConfig)), (models.config.IntentResidualConfig, ()),
    (models.config.AdamWConfig, ()), (models.config.HashingConfig, ()), (models.config.MiniLMConfig, ()),
    (models.config.TrainerConfig, ("default_root_dir",)), (models.config.ModelCheckpointConfig, ("dirpath",)),
    (models.config.EarlyStoppingConfig, ()), (models.config.CsvLoggerConfig, ("save_dir",)),
    (models.config.WandbLoggerConfig, ("save_dir",)), (models.config.IntentKVTrainConfig, ()),
]


@pytest.mark.parametrize("cls, skip", DOCUMENTED, ids=[c.__name__ for c, _ in DOCUMENTED])
def test_the_configuration_docs_show_each_dataclass_as_it_is(cls, skip):
    from data.knobs import knob_table

    doc = (CONF.parent / "docs" / "configuration-data.md").read_text()
    assert f"`{cls.__module__}.{cls.__name__}`" in doc and knob_table(cls, skip) in doc


# ------------------------------------------------------------------ the schemas of evaluate's groups

SCHEMA_GROUPS = {"sim": "SimConfig", "pbkv": "PbkvConfig", "kvflow": "KvflowConfig", "tlru": "TlruConfig",
                 "continuum": "ContinuumConfig",
                 "cost_model": "CostModel", "predictor": "PredictorConfig", "kv": "KvConfig", "wandb": "WandbConfig"}
SCHEMA_CASES = [(group, option) for group in SCHEMA_GROUPS for option in options(group, "evaluate")]


def compose_evaluate(overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(config_name="evaluate", overrides=overrides)


@pytest.mark.parametrize("group,option", SCHEMA_CASES, ids=[f"{g}={o}" for g, o in SCHEMA_CASES])
def test_every_shipped_option_is_typed_by_its_schema(group, option):
    cfg = compose_evaluate([f"{group}={option}"])
    assert OmegaConf.get_type(cfg[group]).__name__ == SCHEMA_GROUPS[group]
    assert OmegaConf.get_type(cfg).__name__ == "EvaluateSchema"


def typed_leaves(node, path):
    """(dotted key, its type) of every leaf of a composed group."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            yield from typed_leaves(child, f"{path}.{key}")
        else:
            yield f"{path}.{key}", OmegaConf.get_type(node, key)


@pytest.mark.parametrize("group", list(SCHEMA_GROUPS) + ["root"])
def test_an_unknown_key_fails_at_compose_time(group, tmp_path):
    """A YAML typo: a group file (here one written beside the shipped ones) with a key its schema lacks."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    if group == "root":
        (conf / "experiment" / "typo.yaml").write_text("# @package _global_\npolices: [lru]\n")
        override = "experiment=typo"
    else:
        target = conf / group / "typo.yaml"
        target.write_text(f"defaults:\n  - {options(group, 'evaluate')[0]}\n  - _self_\n\nnot_a_knob: 1\n")
        override = f"{group}=typo"
    with initialize_config_dir(str(conf), version_base="1.3"), pytest.raises(Exception) as e:
        compose(config_name="evaluate", overrides=[override])
    assert "polices" in str(e.value.__cause__ or e.value) or "not_a_knob" in str(e.value.__cause__ or e.value)


def test_a_wrong_type_is_refused_by_every_typed_leaf():
    """Each scalar leaf of every typed group refuses a value its type cannot hold, as Hydra's merge of
    an override does (a string where a number belongs, a list where a string belongs); Any, lists
    and dicts are checked by the dataclass itself (tests/test_bad_input_evaluate.py)."""
    from omegaconf.errors import ValidationError

    cfg = compose_evaluate([])
    checked = 0
    for group in SCHEMA_GROUPS:
        for key, kind in typed_leaves(cfg[group], group):
            bad = {int: "notanumber", float: "notanumber", bool: "notabool", str: [1, 2]}.get(kind)
            if bad is None:
                continue
            with pytest.raises(ValidationError):
                OmegaConf.update(cfg.copy(), key, bad, merge=True)
            checked += 1
    assert checked > 40
