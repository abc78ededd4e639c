"""When the predicted calls arrive: quantiles of the time until each of the K next calls.

A call's *gap* g_j is the seconds between the end of call j-1 and the start of call j of the same
workflow: the tool, user or think time the trace records (``tool_time``, data/schema.py; or, where
every call has ``start_time`` and ``end_time`` and no gap is recorded, ``start_j - end_{j-1}``).
For a live workflow after its call t, the *time until step k* is the sum of the next k gaps,

.. math::
    T_k = \\sum_{j=1}^{k} g_{t+j}

counted from the end of call t. It leaves out what the serving side knows better than any trace:
the queueing and service time of the k-1 calls in between and the queueing of call t+k itself. The
serving side adds its own estimate of those (arrival of call t+k = end of call t + T_k + the
service and queue time of calls t+1..t+k-1 + the queue of call t+k). Like P^(k), T_k is
conditional on the workflow reaching step k: a step that is END has no time.

Predictors give quantiles of :math:`z = \\log(T_k + c)` (``TimeConfig.offset_s`` is c) at the
levels ``TimeConfig.quantiles``; :meth:`models.base.Predictor.predict_when` returns them in
seconds, :math:`T = e^z - c`. A dataset without any gap (every one 0 or unrecorded: the imported
Who&When and tau-bench traces) has time source ``none``: every family then predicts the per-agent
empirical quantiles (:func:`agent_table`; all zero there) and metrics.json says ``time_fallback``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn

TIME_SOURCES = ("tool_time", "timestamps", "none")


def workflow_gaps(tool_time: Sequence[float | None], start: Sequence[float | None],
                  end: Sequence[float | None], source: str) -> list[float]:
    """Each call's gap in seconds from the trace's columns of one workflow, by `source`: tool_time,
    timestamps (start of a call minus end of the one before; NaN where either is missing), or none
    (all 0). The first call's gap is 0: nothing of the workflow ran before it."""
    if source == "tool_time":
        return [float(g or 0.0) for g in tool_time]
    if source == "timestamps":
        return [0.0] + [np.nan if s is None or e is None else max(0.0, float(s) - float(e))
                        for s, e in zip(start[1:], end[:-1])]
    return [0.0] * len(tool_time)


def times_until(gaps: Sequence[float], horizon: int) -> np.ndarray:
    """[T, K] T_k after each call t of one workflow (NaN where call t+k does not exist)."""
    gaps = np.asarray(gaps, dtype=np.float64)
    n = len(gaps)
    out = np.full((n, horizon), np.nan)
    cumulative = np.concatenate([[0.0], np.cumsum(gaps)])  # cumulative[j] = sum of gaps[:j]
    for k in range(1, horizon + 1):
        t = np.arange(max(0, n - k))
        out[t, k - 1] = cumulative[t + k + 1] - cumulative[t + 1]
    return out


def quantiles_of(values: np.ndarray, levels: Sequence[float], weights: np.ndarray | None = None) -> np.ndarray:
    """Empirical quantiles (the inverse of the empirical CDF, weighted when `weights` are given)."""
    return np.quantile(values, list(levels), method="inverted_cdf", weights=weights)


def agent_table(sequences: Sequence[Sequence[int]], gaps: Sequence[Sequence[float]], n_classes: int, horizon: int,
                levels: Sequence[float], min_samples: int) -> Tensor:
    """[n_classes, K, Q] seconds: the empirical quantiles of T_k after a call to each agent (id), backed
    off to those after any call where an agent has fewer than `min_samples` of them (0 without any)."""
    current = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]) if sequences else np.zeros(0, int)
    times = np.concatenate([times_until(g, horizon) for g in gaps]) if gaps else np.zeros((0, horizon))
    table = np.zeros((n_classes, horizon, len(levels)))
    for k in range(horizon):
        alive = ~np.isnan(times[:, k])
        overall = quantiles_of(times[alive, k], levels) if alive.any() else np.zeros(len(levels))
        table[:, k] = overall
        for agent in np.unique(current[alive]):
            mine = alive & (current == agent)
            if mine.sum() >= min_samples:
                table[agent, k] = quantiles_of(times[mine, k], levels)
    return torch.from_numpy(table).float()


@dataclass
class TimeSpec:
    """What a predictor needs to give times: the levels, the log offset, where the training gaps came
    from, the per-agent empirical table (the fallback and the neural heads' starting point) and the
    knobs of the heads and of the Markov sampling. Stored in checkpoints (``init_args()["time"]``)."""

    quantiles: list[float]
    offset_s: float
    source: str
    table: Tensor  # [n_classes, K, Q] seconds (agent_table)
    hidden: int = 64
    min_samples: int = 5
    paths: int = 1000

    @property
    def fallback(self) -> bool:
        """No gap in the training traces: every family predicts the per-agent table."""
        return self.source == "none"

    def to_dict(self) -> dict:
        return {"quantiles": list(self.quantiles), "offset_s": self.offset_s, "source": self.source,
                "table": self.table, "hidden": self.hidden, "min_samples": self.min_samples, "paths": self.paths}

    @classmethod
    def from_dict(cls, spec: dict | None) -> "TimeSpec | None":
        if spec is None:
            return None
        spec = dict(spec)
        if spec["source"] not in TIME_SOURCES:
            raise ValueError(f"time source must be one of {', '.join(TIME_SOURCES)}, got {spec['source']!r}")
        spec["table"] = torch.as_tensor(spec["table"], dtype=torch.float32)
        spec["quantiles"] = [float(q) for q in spec["quantiles"]]
        return cls(**spec)

    @classmethod
    def from_corpus(cls, corpus) -> "TimeSpec":
        """From a models.datamodule.Corpus: its TimeConfig, its gap source and training gaps."""
        from models.config import TimeConfig

        config = corpus.time or TimeConfig()
        table = agent_table(corpus.train_sequences, corpus.train_gaps, len(corpus.agent_names) + 1, corpus.horizon,
                            config.quantiles, config.min_samples)
        return cls(list(config.quantiles), float(config.offset_s), corpus.time_source, table, config.hidden,
                   config.min_samples, config.paths)

    # ------------------------------------------------------------------ log time
    def log_time(self, seconds: Tensor) -> Tensor:
        return torch.log(seconds.clamp(min=0) + self.offset_s)

    def seconds(self, log_time: Tensor) -> Tensor:
        return (torch.exp(log_time) - self.offset_s).clamp(min=0)

    def agent_log_time(self, current: Tensor) -> Tensor:
        """[B, K, Q] log time from the per-agent table (ids outside it count as <unk>, id 0)."""
        table = self.table.to(current.device)
        current = current.masked_fill((current < 0) | (current >= len(table)), 0)
        return self.log_time(table[current])


# ------------------------------------------------------------------ Markov: per-transition gaps along the chain

class GapPools:
    """The empirical gaps of each (previous agent -> next agent) transition, backed off to the
    previous agent's (any next agent) and then to all gaps where one has fewer than `min_samples`."""

    def __init__(self, previous: np.ndarray, following: np.ndarray, seconds: np.ndarray, n_agents: int,
                 min_samples: int):
        self.n_agents = n_agents
        known = ~np.isnan(seconds)  # timestamps missing on a call: its gap is unknown
        previous, following, seconds = previous[known], following[known], seconds[known]
        pools = [seconds if len(seconds) else np.zeros(1)]  # pool 0: every gap
        by_agent = np.zeros(n_agents + 1, dtype=np.int64)  # row n_agents: no previous agent known
        for a in range(n_agents):
            mine = seconds[previous == a]
            if len(mine) >= min_samples:
                by_agent[a] = len(pools)
                pools.append(mine)
        self.pool_id = np.repeat(by_agent[:, None], n_agents, axis=1)  # [previous (+none), next]
        for a, b in set(zip(previous.tolist(), following.tolist())):
            mine = seconds[(previous == a) & (following == b)]
            if len(mine) >= min_samples:
                self.pool_id[a, b] = len(pools)
                pools.append(mine)
        self.pools = pools
        self.lengths = np.array([len(p) for p in pools])
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self.flat = np.concatenate(pools)

    def mixture_quantiles(self, previous: int, weights: np.ndarray, levels) -> np.ndarray | None:
        """Quantiles of the next gap when the next agent is b with probability weights[b] (None: all 0)."""
        per_pool = np.bincount(self.pool_id[previous], weights=weights, minlength=len(self.pools))
        used = np.flatnonzero(per_pool > 0)
        if not len(used):
            return None
        values = np.concatenate([self.pools[p] for p in used])
        sample_weights = np.concatenate([np.full(self.lengths[p], per_pool[p] / self.lengths[p]) for p in used])
        return quantiles_of(values, levels, sample_weights)

    def draw(self, previous: np.ndarray, following: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        pool = self.pool_id[previous, following]
        pick = np.floor(rng.random(len(pool)) * self.lengths[pool]).astype(np.int64)
        return self.flat[self.offsets[pool] + pick]


def markov_time_table(emit: np.ndarray, next_state: np.ndarray, previous_agent: np.ndarray, pools: GapPools,
                      horizon: int, levels, paths: int, seed: int = 0) -> Tensor:
    """[S, K, Q] seconds: quantiles of T_k from each chain state, conditional on reaching step k.

    `emit` [S, A+1] are the chain's next-symbol probabilities (END last), `next_state` [S, A] the
    state after each agent, `previous_agent` [S] the state's latest agent (A: unknown). Step 1 is
    exact: the mixture over the next agent of its transition's empirical gaps. Steps k >= 2 sum
    gaps along `paths` paths per state drawn from the chain (seeded: the same table from the same
    counts), keeping those still alive at step k.
    """
    n_states, n_agents = next_state.shape
    table = np.zeros((n_states, horizon, len(levels)))
    overall = quantiles_of(pools.pools[0], levels)
    for s in range(n_states):
        exact = pools.mixture_quantiles(previous_agent[s], emit[s, :n_agents], levels)
        table[s, 0] = overall if exact is None else exact
    if horizon == 1:
        return torch.from_numpy(table).float()
    rng = np.random.default_rng(seed)
    start = np.repeat(np.arange(n_states), paths)
    state, previous = start.copy(), previous_agent[start].copy()
    alive, total = np.ones(len(start), dtype=bool), np.zeros(len(start))
    probs = emit / emit.sum(axis=1, keepdims=True)
    for k in range(horizon):
        following = np.full(len(start), n_agents)
        for s in np.unique(state[alive]):
            rows = np.flatnonzero(alive & (state == s))
            following[rows] = rng.choice(n_agents + 1, size=len(rows), p=probs[s])
        alive &= following < n_agents
        rows = np.flatnonzero(alive)
        total[rows] += pools.draw(previous[rows], following[rows], rng)
        state[rows], previous[rows] = next_state[state[rows], following[rows]], following[rows]
        if k == 0:
            continue
        for s in range(n_states):
            mine = alive[s * paths:(s + 1) * paths]
            table[s, k] = quantiles_of(total[s * paths:(s + 1) * paths][mine], levels) if mine.any() else table[s, k - 1]
    return torch.from_numpy(table).float()


def pinball_loss(predicted: Tensor, target: Tensor, levels: Tensor) -> Tensor:
    """Mean quantile (pinball) loss of predicted [N, Q] against target [N]: for level q and residual
    r = y - y_q, max(q r, (q - 1) r); 0 for N = 0."""
    if predicted.shape[0] == 0:
        return predicted.sum() * 0.0
    residual = target[:, None] - predicted
    return torch.maximum(levels * residual, (levels - 1) * residual).mean()


def ordered(log_time: Tensor) -> Tensor:
    """Quantiles sorted along the last axis (a head's raw outputs may cross; sorting them never
    increases the pinball loss: Chernozhukov, Fernandez-Val and Galichon 2010)."""
    return torch.sort(log_time, dim=-1).values


def time_head(width: int, spec: TimeSpec | None, horizon: int) -> nn.Module | None:
    """The time head of a neural family (None without gaps to learn from): width -> hidden -> K x Q,
    no dropout (it would draw from the random stream), last layer zero (it starts at its base)."""
    if spec is None or spec.fallback:
        return None
    head = nn.Sequential(nn.Linear(width, spec.hidden), nn.ReLU(), nn.Linear(spec.hidden, horizon * len(spec.quantiles)))
    nn.init.zeros_(head[-1].weight)
    nn.init.zeros_(head[-1].bias)
    return head


def timed(head: nn.Module, features: Tensor, base: Tensor) -> Tensor:
    """Log-time quantiles [B, K, Q]: base + head(features), the features detached (the time loss
    reaches the head's weights only), sorted."""
    return ordered(base + head(features.detach()).view(base.shape))


def fresh_rng_head(build):
    """Build a module without moving the global random stream: the next-agent layers, their dropout
    and the identity dropout draw exactly the numbers they drew before the time head existed."""
    with torch.random.fork_rng(devices=[]):
        return build()
