"""Every option of every config group composes into the root that uses it, through the groups'
structured-config schemas where they have one (an unknown key or a wrong type fails at compose
time), and every `_target_` in the composed config names an importable callable that accepts the
keys given to it."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

from data.config_checks import SCHEMAS, validate
from serving_integration.experiments import config as evaluate_config  # registers evaluate's schemas

CONF = Path(__file__).resolve().parents[1] / "conf"
# the groups each root selects in its defaults list (experiments and debug configs belong to one root)
ROOT_GROUPS = {
    "train": ["data", "model", "model/text_encoder", "trainer", "callbacks", "logger", "train_experiment",
              "hparams_search", "debug"],
    "evaluate": ["data", "cost_model", "sim", "predictor", "pbkv", "tlru", "kvflow", "kv", "wandb", "experiment",
                 "debug"],
}
ROOT_ONLY = {"debug": {"train": ["train"], "evaluate": ["evaluate"]}}


def options(group: str, root: str) -> list[str]:
    names = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    return ROOT_ONLY.get(group, {}).get(root, names)


CASES = [(root, group, option) for root, groups in ROOT_GROUPS.items() for group in groups
         for option in options(group, root)]


def test_every_group_option_is_covered():
    covered = {group for groups in ROOT_GROUPS.values() for group in groups}
    on_disk = {str(p.relative_to(CONF)) for p in CONF.rglob("*") if p.is_dir() and any(p.glob("*.yaml"))}
    # workload/ is composed inside data/ (data/*.yaml select it); hydra/ holds launchers
    assert on_disk - covered == {"workload", "hydra", "hydra/launcher"}


def test_experiments_do_not_cross_roots():
    assert not set(options("experiment", "evaluate")) & set(options("train_experiment", "train"))
    for name in options("train_experiment", "train"):
        with initialize_config_dir(str(CONF), version_base="1.3"), pytest.raises(Exception):
            compose(config_name="evaluate", overrides=[f"train_experiment={name}"])


def targets(node, path="cfg"):
    """(path, node) of every mapping with a `_target_` in a composed config."""
    if isinstance(node, DictConfig):
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
    # the settings checks accept every shipped option (none too strict)
    if root == "evaluate":
        evaluate_config.settings(cfg)
    else:
        validate(cfg, SCHEMAS[root]())
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



# ------------------------------------------------------------------ the schemas of evaluate's groups

SCHEMA_GROUPS = {"sim": "SimConfig", "pbkv": "PbkvConfig", "kvflow": "KvflowConfig", "tlru": "TlruConfig",
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


def leaves(node, path):
    """(dotted key, its type) of every leaf of a composed group."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            yield from leaves(child, f"{path}.{key}")
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
        for key, kind in leaves(cfg[group], group):
            bad = {int: "notanumber", float: "notanumber", bool: "notabool", str: [1, 2]}.get(kind)
            if bad is None:
                continue
            with pytest.raises(ValidationError):
                OmegaConf.update(cfg.copy(), key, bad, merge=True)
            checked += 1
    assert checked > 40
