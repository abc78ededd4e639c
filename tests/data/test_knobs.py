"""data.knobs: one dataclass per component holds each knob's default, help and range."""

from dataclasses import dataclass
from typing import Optional

import pytest
from omegaconf import OmegaConf

from data.errors import ConfigError
from data.knobs import above, at_least, build, check, each, help_of, knob, one_of, probability


@dataclass
class Inner:
    threshold: float = knob(0.3, "route by prefix match above this share", probability)

    def __post_init__(self):
        check(self)


@dataclass
class Example:
    count: int = knob(3, "how many", at_least(1))
    rate: float = knob(0.5, "a share", above(0), probability)
    mode: str = knob("a", "which mode", one_of(("a", "b")))
    names: list = knob(None, "names", each(one_of(lambda: ("x", "y"))), factory=lambda: ["x"])
    limit: Optional[int] = knob(None, "no limit when null", at_least(1))
    inner: Inner = knob(None, "nested", factory=Inner)

    def __post_init__(self):
        check(self)


def test_defaults_and_help_come_from_the_dataclass():
    e = build(OmegaConf.create({}), Example, "ex")
    assert (e.count, e.rate, e.mode, e.names, e.limit, e.inner.threshold) == (3, 0.5, "a", ["x"], None, 0.3)
    assert help_of(Example, "rate") == "a share"


@pytest.mark.parametrize("values, message", [
    ({"count": 0}, "ex.count=0: Input should be greater than or equal to 1"),
    ({"count": 2.5}, "ex.count=2.5: Input should be a valid integer"),
    ({"count": True}, "ex.count=true: Input should be a valid integer"),
    ({"rate": 0}, "ex.rate=0: Input should be greater than 0"),
    ({"rate": float("nan")}, "ex.rate=nan: Input should be a finite number"),
    ({"rate": 2.0}, "ex.rate=2.0: Input should be less than or equal to 1"),
    ({"mode": "c"}, "ex.mode=c: should be one of a, b"),
    ({"names": ["x", "z"]}, "ex.names[1]=z: should be one of x, y"),
    ({"limit": 0}, "ex.limit=0: Input should be greater than or equal to 1"),
    ({"inner": {"threshold": 5}}, "ex.inner.threshold=5: Input should be less than or equal to 1"),
    ({"colour": 1}, "ex.colour: not a setting of ex (known: count, inner, limit, mode, names, rate)"),
])
def test_a_bad_value_is_one_line_naming_its_full_key(values, message):
    with pytest.raises(ConfigError) as e:
        build(OmegaConf.create(values), Example, "ex")
    assert str(e.value) == message


# ------------------------------------------------------------------ mappings, rules across fields, mandatory values
from typing import Dict  # noqa: E402

from data.knobs import MISSING, broken_rule, distribution, each_value, keys, knob_table  # noqa: E402


@dataclass
class Shares:
    probs: Dict[str, float] = knob(None, "P(kind)", keys(("a", "b")), each_value(probability), distribution,
                                   factory=lambda: {"a": 0.5, "b": 0.5})
    low: int = knob(1, "low", at_least(0))
    high: int = knob(2, "high", at_least(0))
    name: str = knob(MISSING, "mandatory")

    def __post_init__(self):
        check(self)
        if self.low >= self.high:
            raise broken_rule(self, ("low", "high"), "low should be below high")


@dataclass
class Outer:
    seed: int = knob(0, "seed", at_least(0))
    shares: Shares = knob(None, "nested", factory=lambda: Shares(name="x"))

    def __post_init__(self):
        check(self)


@dataclass(frozen=True)
class FrozenInner:
    threshold: float = knob(0.3, "a share", probability)

    def __post_init__(self):
        check(self)


@dataclass(frozen=True)
class Frozen:
    count: int = knob(3, "how many", at_least(1))
    inner: FrozenInner = knob(None, "nested", factory=FrozenInner)

    def __post_init__(self):
        check(self)


@pytest.mark.parametrize("values, message", [
    ({"shares": {"name": "x", "probs": {"a": 1.5, "b": 0.5}}}, "out.shares.probs.a=1.5: Input should be less than or "
                                                               "equal to 1"),
    ({"shares": {"name": "x", "probs": {"a": 0.2, "b": 0.5}}}, "out.shares.probs={a:0.2,b:0.5}: should sum to 1 "
                                                               "(sums to 0.7)"),
    ({"shares": {"name": "x", "probs": {"a": 1.0}}}, "out.shares.probs={a:1.0}: should name exactly a, b"),
    ({"shares": {"name": "x", "low": 3}}, "out.shares: low=3, high=2: low should be below high"),
    ({"seed": -1, "shares": {"name": "x", "low": 3}}, "out.seed=-1: Input should be greater than or equal to 0"),
])
def test_mappings_rules_and_nested_groups_in_field_order(values, message):
    with pytest.raises(ConfigError) as e:
        build(OmegaConf.create(values), Outer, "out")
    assert str(e.value) == message


def test_a_mandatory_value_is_named_when_built():
    with pytest.raises(ConfigError) as e:
        build(OmegaConf.create({"shares": {"name": MISSING}}), Outer, "out")
    assert str(e.value) == "out.shares.name: required"


def test_knob_table_lists_default_and_help():
    assert knob_table(Shares).splitlines()[2:] == ["| `probs` | `{a:0.5,b:0.5}` | P(kind) |", "| `low` | `1` | low |",
                                                   "| `high` | `2` | high |", "| `name` | required | mandatory |"]


def test_a_frozen_schema_takes_yaml_values_and_overrides_but_not_unknown_keys():
    """register() stores a writable node: a frozen dataclass's own node is read-only, nested ones too."""
    from hydra.core.config_store import ConfigStore
    from omegaconf.errors import ConfigKeyError, ValidationError

    from data.knobs import register

    register("knobs_test", Frozen)
    node = ConfigStore.instance().load("knobs_test/schema.yaml").node
    merged = OmegaConf.merge(node, {"count": 5})
    OmegaConf.update(merged, "inner.threshold", 0.5)
    assert build(merged, Frozen, "t") == Frozen(count=5, inner=FrozenInner(0.5))
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(node, {"colour": 1})
    with pytest.raises(ValidationError):
        OmegaConf.update(merged, "inner.threshold", "high")
