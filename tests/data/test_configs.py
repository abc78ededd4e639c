"""Every option of every config group composes into the root that uses it, and every `_target_` in
the composed config names an importable callable that accepts the keys given to it."""

from __future__ import annotations

import importlib
import inspect

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

from data.config_checks import SCHEMAS, validate
from tests.conftest import REPO

CONF = REPO / "conf"
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
    elif isinstance(node, ListConfig):
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
    validate(cfg, SCHEMAS[root]())  # the settings checks accept every shipped option (none too strict)
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

