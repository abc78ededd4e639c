"""The cache policies' knobs, one dataclass per config group: the one place each default, type,
range and help line is written. The simulator (evaluate.py's groups `pbkv`, `kvflow`, `tlru`)
and the SGLang plugin (`server/runtime.py` PluginConfig, which adds its server-only fields to
these) read the same classes (evaluate.py's `continuum` group too); the policy classes in policies.py take their defaults from them.

Importing this module registers the groups' schemas with Hydra's ConfigStore (`pbkv/schema`, ...):
conf/pbkv/default.yaml and its siblings start their defaults list with `- schema`, so an unknown
key or a value of the wrong type fails when Hydra composes the config (docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from data.errors import ConfigError
from data.knobs import above, at_least, at_most, below, check, each, knob, nonempty, one_of, probability, register, shown, \
    unique

TRUST_MODES = ("outcome", "accuracy", "always")
PREFETCH_MODES = ("none", "conservative", "aggressive")
POLICY_PREFETCH_MODES = ("kvflow", "last_call")  # a baseline's own prefetch order (cache/baselines.py)
NOISE_KINDS = ("uniform", "adversarial")


def trust_modes(value) -> str | None:
    """pbkv.trust: one mode, or a list of modes (evaluate.py runs a pbkv row under each)."""
    if isinstance(value, str):
        return one_of(TRUST_MODES)(value)
    if isinstance(value, (list, tuple)):
        return nonempty(value) or each(one_of(TRUST_MODES))(value) or unique(value)
    return f"should be one of {', '.join(TRUST_MODES)}, or a list of them"


@dataclass(frozen=True)
class TrustConfig:
    """When PBKV follows its score and when lifecycle-aware LRU (cache/trust.py). outcome: the order
    that would have had more GPU hits on two shadow caches (metadata only) that follow the server's calls,
    with a margin; accuracy: the score while the moving average of the probability the predictions
    gave the agent that came next stays above threshold - margin, again above threshold + margin."""

    trust: Any = knob("outcome", "outcome: follow whichever of the score and lifecycle-aware LRU wins on shadow "
                      "caches (measured online); accuracy: lifecycle-aware LRU while the predictions are poor; "
                      "always: the paper's policy; evaluate.py takes a list too (a pbkv row each)", trust_modes)
    trust_threshold: float = knob(0.5, "accuracy: trust while the average stays above threshold - margin",
                                  probability)
    trust_margin: float = knob(0.1, "accuracy's hysteresis: distrust below threshold - margin, trust again above "
                               "threshold + margin", probability)
    trust_window: int = knob(32, "accuracy: calls the moving average spans", at_least(1))
    outcome_sample: float = knob(1.0, "outcome: share R of the workflows the shadow caches follow (seeded hash "
                                 "of the workflow id); they hold R x the tokens the cache may hold. 1: full-size "
                                 "shadows, exact; below 1 the miniature shadows can misjudge a replay of a few "
                                 "hundred workflows (docs/serving.md)", above(0), at_most(1))
    outcome_window: int = knob(128, "outcome: sampled calls the compared hit rates span (moving average)",
                               at_least(1))
    outcome_min_calls: int = knob(16, "outcome: sampled calls seen before the first decision (until then the "
                                  "score is followed)", at_least(1))
    outcome_z: float = knob(1.0, "outcome: the hit-rate difference must pass the margin by this many of its "
                            "standard errors (over the window's sampled calls) before the order flips (1, "
                            "chosen on validation: 0 flips on noise, and each flip costs)", at_least(0))
    outcome_return_z: float = knob(0.5, "outcome: after a fallback, the score's lead must pass the margin by this "
                                   "many standard errors for the order to return to the score (outcome_z: to "
                                   "leave it; 0.5 with outcome_cumulative, chosen on validation: docs/serving.md "
                                   "section 10)", at_least(0))
    outcome_cumulative: bool = knob(True, "outcome: flip also once the hit-rate difference over every sampled call "
                                    "since the last flip (not only over the window) passes the same bar")
    outcome_margin: float = knob(0.005, "outcome's hysteresis: fall back once lifecycle-aware LRU's shadow hit "
                                 "rate beats the score's by more than this (and outcome_z standard errors), "
                                 "return once the score's beats it so", probability)
    outcome_slack: float = knob(0.02, "outcome: a full shadow evicts down to (1 - slack) x its capacity, so the "
                                "next inserts need no ranking (the same for both shadows)", at_least(0), below(1))
    outcome_real_weight: float = knob(0.0, "outcome: weight of the real cache's GPU hits in the followed order's "
                                      "measured hits (the rest: its shadow's; the other order has only its "
                                      "shadow). 0: the shadows alone (above 0 switched more and kept less of "
                                      "the score's gain on validation: docs/serving.md section 10)", probability)
    outcome_seed: int = knob(0, "outcome: seeds which workflows are sampled", at_least(0))
    outcome_unit: str = knob("key", "outcome: what a shadow evicts at once: key (one content key, as partial "
                             "eviction frees a victim's tail) or node (a leaf key with the ancestors that form one "
                             "node with it in the server's tree, as SGLang's whole-node eviction does)",
                             one_of(("key", "node")))

    def __post_init__(self):
        check(self)
        low, high = self.trust_threshold - self.trust_margin, self.trust_threshold + self.trust_margin
        if not 0 <= low <= high <= 1:
            raise ConfigError(f"trust_threshold={shown(self.trust_threshold)}, trust_margin={shown(self.trust_margin)}: "
                              "threshold +- margin must lie in [0, 1]")


@dataclass(frozen=True)
class PbkvConfig(TrustConfig):
    """conf/pbkv: Score(c) = sum_k gamma^(k-1) sum_w s_w^(k) <A_w(c), P_w^(k)> (docs/serving.md)."""

    horizon: int = knob(3, "K: calls of each workflow predicted ahead (a predictor checkpoint's own K must "
                        "agree with it)", at_least(1))
    gamma: float = knob(0.5, "discount of step k: gamma^(k-1)", above(0), at_most(1))
    time_tau_s: float = knob(10.0, "pbkv_time: a read expected T seconds from now counts exp(-T / tau) of one "
                             "now (very large: no discount, PBKV's score with the queued calls known)", above(0))

    @property
    def trust_modes(self) -> tuple[str, ...]:
        """pbkv.trust as a tuple: evaluate.py runs a pbkv row under each mode."""
        return (self.trust,) if isinstance(self.trust, str) else tuple(self.trust)

    def time_options(self, mode: str) -> dict:
        """The policies.PBKVTime keyword arguments under one trust mode."""
        return {"time_tau_s": self.time_tau_s, "gamma": self.gamma, **self.trust_options(mode)}

    def trust_options(self, mode: str) -> dict:
        """The policies.PBKV keyword arguments under one trust mode."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(TrustConfig)}, "trust": mode}


@dataclass(frozen=True)
class KvflowConfig:
    """conf/kvflow: KVFlow (arXiv 2507.07400). `kvflow` runs it as its public code does
    (github.com/PanZaifeng/KVFlow, whose server_args.py defaults these are); `kvflow_ideal` and
    `kvflow_nolae` are the idealised steps-to-execution order (docs/baselines/kvflow.md)."""

    hold_step: int = knob(4, "kvflow: the fork's --evict-pri-level: eviction passes for hold priorities "
                          "hold_step - 1 ... 1, then everything", at_least(1))
    load_ahead_step: int = knob(2, "kvflow: the fork's --load-ahead-step: prefetch the last nodes of agents "
                                "due in steps 0 ... this", at_least(0))
    holding: bool = knob(True, "kvflow: the fork's --enable-holding (its default is off: eviction in DFS order "
                         "alone; its paper's runs hold)")
    agent_key: str = knob("role", "kvflow: what the fork's global agent id names: role (an agent's name, one id "
                          "across workflows, as for agents with fixed prompts) or workflow (one id per workflow's agent)",
                          one_of(("role", "workflow")))
    ideal_hold_step: int = knob(3, "kvflow_ideal, kvflow_nolae: steps-to-execution given to agents outside the "
                                "step graph", at_least(0))

    def __post_init__(self):
        check(self)

    def options(self, policy: str) -> dict:
        """The keyword arguments of one KVFlow variant's policy class."""
        if policy == "kvflow":
            return {"hold_step": self.hold_step, "load_ahead_step": self.load_ahead_step, "holding": self.holding,
                    "agent_key": self.agent_key}
        return {"hold_step": self.ideal_hold_step}


CONTINUUM_TTL = ("cdf", "mean")


@dataclass(frozen=True)
class ContinuumConfig:
    """conf/continuum: Continuum's tool-call TTL pin (arXiv 2511.02230, docs/baselines/continuum.md)."""

    hold_cost: float = knob(1.0, "seconds of other programs' delay charged per second a program holds the whole "
                            "GPU (scaled by its share): the TTL's memory cost", above(0))
    max_ttl_s: float = knob(300.0, "longest pin", above(0))
    ttl_estimator: str = knob("cdf", "cdf: the paper's expected-benefit TTL over the empirical tool-time CDF; mean: "
                              "its public code's (the mean tool time seen)", one_of(CONTINUUM_TTL))

    def __post_init__(self):
        check(self)

    def continuum_options(self) -> dict:
        """The keyword arguments of baselines.Continuum (also from a class that adds fields to these)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ContinuumConfig)}


@dataclass(frozen=True)
class TlruConfig:
    """conf/tlru: SGLang's tail-optimised LRU; with threshold 0 it is LRU."""

    threshold: int = knob(0, "tokens of a branch's TTFT slack: nodes wholly past history + next prompt - "
                          "threshold are evicted first", at_least(0))
    next_prompt_estimate: int = knob(0, "tokens the next prompt of a branch is assumed to add", at_least(0))

    def __post_init__(self):
        check(self)


@dataclass(frozen=True)
class OnlineBackoffConfig:
    """predictions.OnlineBackoff around a trained predictor: served transitions folded into counts
    mixed with the model (evaluate's `predictor` group and the plugin)."""

    online_backoff: bool = knob(True, "fold the served transitions into counts mixed with the model")
    online_beta: float = knob(10.0, "weight of the model as the counts' prior", above(0))

    def __post_init__(self):
        check(self)


@dataclass(frozen=True)
class NoiseConfig:
    """predictions.NoisySource: prediction error of a controlled size, for robustness sweeps."""

    noise: float = knob(0.0, "share eps of each prediction replaced by noise", probability)
    noise_kind: str = knob("uniform", "uniform: (1-eps) P + eps R, R uniform on the simplex (benign); adversarial: "
                           "eps of the mass moved onto agents NOT called next", one_of(NOISE_KINDS))

    def __post_init__(self):
        check(self)


# ------------------------------------------------------------------ routing (cache/router.py)

@dataclass(frozen=True)
class CacheAwareConfig:
    """sglang-router's cache_aware policy; its defaults are sglang-router's (cache/router.py)."""

    cache_threshold: float = knob(0.3, "route by prefix match when matched / prompt > this", probability)
    balance_abs_threshold: int = knob(64, "imbalanced when max - min load > this ...", at_least(0))
    balance_rel_threshold: float = knob(1.5, "... and max > this x min load: then the least loaded worker",
                                        at_least(1))
    eviction_interval_s: float = knob(60.0, "the approximate trees are cut back this often (simulated seconds; "
                                      "0: never)", at_least(0))
    max_tree_size: int = knob(2**26, "... to this many characters per worker", at_least(1))
    chars_per_token: float = knob(4.0, "the router counts characters; the simulator counts tokens", above(0))

    def __post_init__(self):
        check(self)


@dataclass(frozen=True)
class PbkvRoutingConfig:
    """PBKV routing's load bound: a replica may take a call while
    load + 1 <= load_factor x (total load + 1) / replicas + load_slack."""

    load_factor: float = knob(1.25, "multiple of the mean load a replica may reach", at_least(1))
    load_slack: int = knob(1, "requests a replica may hold beyond load_factor x the mean", at_least(1))

    def __post_init__(self):
        check(self)


@dataclass(frozen=True)
class RouterConfig:
    """Each routing policy's options (the others have none)."""

    cache_aware: CacheAwareConfig = knob(None, "sglang-router's cache_aware policy", factory=CacheAwareConfig)
    pbkv: PbkvRoutingConfig = knob(None, "PBKV routing", factory=PbkvRoutingConfig)

    def __post_init__(self):
        check(self)

    def get(self, routing: str, default=None):
        """The keyword arguments of routing policy `routing` (cache/router.py make_router)."""
        options = getattr(self, routing, None)
        return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else default


def register_schemas() -> None:
    for group, cls in (("pbkv", PbkvConfig), ("kvflow", KvflowConfig), ("tlru", TlruConfig),
                       ("continuum", ContinuumConfig)):
        register(group, cls)


register_schemas()
