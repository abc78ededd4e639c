"""Knobs: a component's settings as one dataclass, each field with one default, one help line and
one allowed range.

    @dataclass
    class PbkvConfig:
        horizon: int = knob(3, "K: steps of each workflow predicted per forward pass", at_least(1))
        gamma: float = knob(0.5, "discount of step k: gamma^(k-1)", above(0), at_most(1))

        def __post_init__(self):
            check(self)  # every field's range; cross-field rules follow, raising ConfigError

    register("pbkv", PbkvConfig)            # the schema of conf/pbkv/*.yaml (their defaults list
                                            # starts with `- schema`): unknown keys and wrong types
                                            # fail when Hydra composes the config
    knobs = build(cfg.pbkv, PbkvConfig, "pbkv")   # the composed group as the checked object

The dataclass is the only place a default is written: YAML files hold values and comments, never a
second default. A bad value is one line, ``pbkv.gamma=0: Input should be greater than 0``, raised as
:class:`data.errors.ConfigError` (exit status 2 at the entry points).

This module knows no component: it lives in `data/`, the bottom package, so that every package
(data, models, serving_integration) can declare its knobs without importing a package above it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Callable, Iterable, Mapping, Optional

from data.errors import ConfigError

Check = Callable[[Any], Optional[str]]  # None when the value is allowed, else the reason
MISSING = "???"  # omegaconf.MISSING: the default of a mandatory knob (knob(MISSING, ...))


def knob(default: Any = dataclasses.MISSING, help: str = "", *checks: Check, factory: Callable | None = None):
    """A dataclass field with its help line and checks; `factory` for a mutable default."""
    metadata = {"help": help, "checks": checks}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def help_of(cls, name: str) -> str:
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)


# ------------------------------------------------------------------ checks (pydantic's wording)

def at_least(n) -> Check:
    return lambda v: None if v >= n else f"Input should be greater than or equal to {n}"


def above(n) -> Check:
    return lambda v: None if v > n else f"Input should be greater than {n}"


def at_most(n) -> Check:
    return lambda v: None if v <= n else f"Input should be less than or equal to {n}"


def below(n) -> Check:
    return lambda v: None if v < n else f"Input should be less than {n}"


def probability(v) -> Optional[str]:
    return at_least(0)(v) or at_most(1)(v)


def one_of(names: Iterable | Callable[[], Iterable]) -> Check:
    """`names` may be a function, called when a value is checked (names defined by other modules)."""
    def check(v):
        allowed = tuple(names() if callable(names) else names)
        return None if v in allowed else f"should be one of {', '.join(map(str, allowed))}"
    return check


def each(*checks: Check) -> Check:
    """Every item of a list passes `checks`; the first failure names the item's index."""
    def check(values):
        for i, v in enumerate(values):
            for c in checks:
                reason = c(v)
                if reason:
                    return f"[{i}]={shown(v)}: {reason}"
        return None
    return check


def each_value(*checks: Check) -> Check:
    """Every value of a mapping passes `checks`; the first failure names its key (``name.key=v``)."""
    def check(mapping):
        for key, v in mapping.items():
            for c in checks:
                reason = c(v)
                if reason:
                    return f".{key}={shown(v)}: {reason}"
        return None
    return check


def keys(names: Iterable[str]) -> Check:
    """A mapping names exactly these keys (in any order)."""
    names = tuple(names)

    def check(mapping):
        return None if set(mapping) == set(names) else f"should name exactly {', '.join(names)}"
    return check


def distribution(v) -> Optional[str]:
    """Probabilities (a list, or a mapping's values) that sum to 1."""
    total = sum(v.values() if isinstance(v, Mapping) else v)
    return None if math.isclose(total, 1.0, abs_tol=1e-6) else f"should sum to 1 (sums to {total:g})"


def nonempty(v) -> Optional[str]:
    return None if len(v) else "should not be empty"


def unique(v) -> Optional[str]:
    return None if len(set(v)) == len(v) else "should not repeat a name"


# ------------------------------------------------------------------ checking an instance

def check(obj) -> None:
    """Check every field of a knobs dataclass in order: its type (None only where Optional),
    finiteness of floats, then its checks; a mapping given for a field typed by a knobs class is
    built into it (``build``). Raises ConfigError ``name=value: reason``."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value == MISSING:  # a mandatory value not given yet: build() and Hydra report it by name
            continue
        hint = hints.get(f.name, Any)
        nested = _knobs_class(hint)
        if nested is not None and isinstance(value, Mapping):  # a nested group, in field order
            value = build(value, nested, f.name)
            object.__setattr__(obj, f.name, value)
        reason = _type_reason(value, hint)
        if reason is None and value is not None:
            for c in f.metadata.get("checks", ()):
                reason = c(value)
                if reason:
                    break
        if reason:
            if reason.startswith(("[", ".")):  # each() / each_value(): the item's index or key, and value
                index, _, rest = reason.partition("=")
                raise ConfigError(f"{f.name}{index}={rest}")
            raise ConfigError(f"{f.name}={shown(value)}: {reason}")


def _knobs_class(hint):
    """The dataclass a field is typed by (also inside Optional[...]), else None."""
    options = [a for a in typing.get_args(hint) if a is not type(None)] \
        if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint]
    return options[0] if len(options) == 1 and dataclasses.is_dataclass(options[0]) else None


def _type_reason(value, hint) -> Optional[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None if type(None) in args else "Input should not be null"
        options = [a for a in args if a is not type(None)]
        return None if any(_type_reason(value, a) is None for a in options) else _type_reason(value, options[0])
    if value is None:
        return None if hint is Any else "Input should not be null"
    if hint is bool:
        return None if isinstance(value, bool) else "Input should be a valid boolean"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "Input should be a valid integer"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "Input should be a valid number"
        return None if math.isfinite(value) else "Input should be a finite number"
    if hint is str:
        return None if isinstance(value, str) else "Input should be a valid string"
    if origin in (list, tuple) or hint in (list, tuple):
        return None if isinstance(value, (list, tuple)) else "Input should be a valid list"
    if origin is dict or hint is dict:
        return None if isinstance(value, Mapping) else "Input should be a valid dictionary"
    return None


class RuleError(ConfigError):
    """A rule across fields, raised by a knobs class's ``__post_init__`` (see :func:`broken_rule`):
    :func:`build` shows it after the group's key, ``split: val=0.95, test=0.1: reason``."""


def broken_rule(obj, names: Iterable[str], reason: str) -> RuleError:
    """The error of a rule across fields: ``a=1, b=2: reason``, the named fields with their values."""
    return RuleError(f"{', '.join(f'{n}={shown(getattr(obj, n))}' for n in names)}: {reason}")


# ------------------------------------------------------------------ Hydra

def register(group: Optional[str], cls, name: str = "schema") -> None:
    """Store `cls` in Hydra's ConfigStore as `group/name` (the root when group is None): a YAML file
    of the group lists it first in its defaults list and is then typed by it."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    node = OmegaConf.structured(cls)
    _writable(node)  # a frozen dataclass's node is read-only: YAML values and overrides could not merge in
    ConfigStore.instance().store(group=group, name=name, node=node)


def _writable(node) -> None:
    """Clear the read-only flag of a structured node and of every node it nests."""
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, None)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            _writable(child)


def build(node, cls, prefix: str = ""):
    """The composed config node (a DictConfig, or a plain mapping) as a checked `cls` instance;
    a bad value is raised as ConfigError naming its full key (``prefix.name=value: reason``).
    Keys the node has and `cls` lacks are an error too."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        values = (OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
                  if isinstance(node, DictConfig) else dict(node))
    except OmegaConfBaseException as e:  # a missing value (???) or a broken interpolation
        key = str(getattr(e, "full_key", None) or "")  # from the root of the node's config
        if node._get_parent() is None:
            key = ".".join(k for k in (prefix, key) if k)
        if isinstance(e, MissingMandatoryValue):  # say what to give, from the knob's own help
            name = key.rsplit(".", 1)[-1]
            what = help_of(cls, name) if name in {f.name for f in dataclasses.fields(cls)} else ""
            raise ConfigError(f"{key}: required" + (f" ({what})" if what else "")) from None
        raise ConfigError(f"{key or 'config'}: {str(e).splitlines()[0]}") from None
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{where}: not a setting of {prefix or 'this command'} "
                          f"(known: {', '.join(sorted(names))})")
    try:
        return cls(**values)  # check() builds nested knobs classes from their mappings
    except RuleError as e:
        raise ConfigError(f"{prefix}: {e}" if prefix else str(e)) from None
    except ConfigError as e:
        raise ConfigError(with_prefix(prefix, str(e), names)) from None


def with_prefix(prefix: str, message: str, names: Iterable[str] = ()) -> str:
    """``name=...`` becomes ``prefix.name=...``; a message not led by a field name gets ``prefix: ``."""
    if not prefix:
        return message
    head = re.match(r"[A-Za-z_]\w*", message)
    if head and head.group(0) in set(names):
        return f"{prefix}.{message}"
    return f"{prefix}: {message}"


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


def knob_table(cls, skip: Iterable[str] = ()) -> str:
    """The knobs of `cls` as a markdown table (name, default, help): what the configuration docs show,
    so that a test can hold them to the dataclass. Hydra keys (``_target_``) and `skip` are left out."""
    rows = ["| knob | default | what it sets |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or f.name in set(skip):
            continue
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        default = "(group)" if dataclasses.is_dataclass(value) else "required" if value == MISSING else \
            f"`{shown(value)}`"
        rows.append(f"| `{f.name}` | {default} | {f.metadata.get('help', '')} |")
    return "\n".join(rows)
