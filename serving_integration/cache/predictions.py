"""Where the simulator's predictions come from: a trained predictor (train.py checkpoint), the
true future (the perfect predictor, a bound), or KVFlow's agent step graph; optionally
mixed with noise. Every source returns what a `models.Predictor` returns: [B, K, A+1]
probabilities over `agent_names` plus END (last), for a batch of live workflows."""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from types import SimpleNamespace
from typing import Callable, Hashable, NamedTuple, Protocol, Sequence

import cython
import numpy as np
import torch

from models.base import WorkflowPrefix, vocabulary
from serving_integration.cache.config import NOISE_KINDS, NoiseConfig, OnlineBackoffConfig

END = "END"  # the end of a workflow in an agent graph's successor lists


class LiveWorkflow(Protocol):
    """What a prediction source may read of a live workflow in the simulator (read-only: the
    simulator's SimWorkflow derives `agents`, `hidden` and `future_agents` from its progress)."""

    @property
    def id(self) -> str: ...

    @property
    def agents(self) -> list[str]: ...  # agents called so far, in order

    @property
    def task(self) -> str: ...

    @property
    def hidden(self) -> list | None: ...

    @property
    def future_agents(self) -> list[str]: ...  # the real remaining calls (only the perfect predictor reads these)


class PredictionSource(Protocol):
    agent_names: list[str]
    horizon: int

    def predict(self, workflows: Sequence[LiveWorkflow]) -> torch.Tensor: ...

    # optional: `finished(workflow)`, told when a workflow ends (OnlineBackoff learns from it)


def predict_times(source, workflows: Sequence[LiveWorkflow]) -> np.ndarray | None:
    """[B, K] the median seconds until each of the K next calls of each workflow, from the end of
    its latest call, from the first source of the chain (a wrapper's `inner`) that gives times
    (`predict_times`); None where none does."""
    while source is not None:
        times = getattr(source, "predict_times", None)
        if times is not None:
            return times(workflows)
        source = getattr(source, "inner", None)
    return None


def tell_finished(source, workflow) -> None:
    """Tell a source (and the sources it wraps) that a workflow ended."""
    while source is not None:
        if hasattr(source, "finished"):
            source.finished(workflow)
        source = getattr(source, "inner", None)


class Folded(NamedTuple):
    """Predictions as the cache reads them, for B workflows over A agents (END dropped):

        value[b, a]     = sum_k gamma^(k-1) s^(k) P^(k)[a],  s^(k) = prod_{j<k} (1 - P^(j)[END])
                          (PBKV's per-agent reuse value: a node's score sums it over its users' agents)
        next[b, a]      = P^(1)[a]                            (the one-step score prefetch ranks by)
        likeliest[b, k] = argmax_a P^(k)[a],  beats_end[b, k] = max_a P^(k)[a] > P^(k)[END]
                          (the first k at which an agent is the likeliest: its steps-to-execution)"""

    value: np.ndarray
    next: np.ndarray
    likeliest: np.ndarray
    beats_end: np.ndarray

    def packed(self) -> np.ndarray:
        """The four as the columns of one float64 array (a row is then one list: `ledger_row`)."""
        return np.concatenate([self.value, self.next, self.likeliest, self.beats_end], axis=1, dtype=np.float64)


class LedgerRow(NamedTuple):
    """One workflow's folded prediction as the cache's ledger keeps it (policies.WorkflowLedger),
    in Python objects: `value`, v_w over the source's agents in their order (Folded.value's row);
    `reuse` and `next`, agent -> v_w and agent -> P^(1); `steps`, agent -> the first k at which it
    is the likeliest agent and more likely than END (its steps-to-execution)."""

    value: list
    reuse: dict
    next: dict
    steps: dict


@cython.locals(packed=list, a=cython.Py_ssize_t, k=cython.Py_ssize_t, j=cython.Py_ssize_t, reuse=dict,
               next_value=dict, steps=dict)
def ledger_row(packed: list, n_agents: int, agent_names: Sequence[str]) -> LedgerRow:
    """A LedgerRow from one packed row (`Folded.packed`, as a list: likeliest and beats_end as
    floats, 3.0 is agent 3, 1.0 is True); `agent_names` the source's (at least n_agents of them)."""
    a = n_agents
    k = (len(packed) - 2 * a) // 2
    reuse, next_value, steps = {}, {}, {}
    for j in range(a):  # a loop, not dict(zip()): compiled, it is the C loop (the same dicts)
        name = agent_names[j]
        reuse[name] = packed[j]
        next_value[name] = packed[a + j]
    for j in range(k):  # the first step at which each agent is the likeliest and beats END
        if packed[2 * a + k + j]:
            steps.setdefault(agent_names[int(packed[2 * a + j])], j + 1)
    return LedgerRow(packed[:a], reuse, next_value, steps)


def ledger_rows(folded: Folded, agent_names: Sequence[str]) -> list[LedgerRow]:
    """Every row of `folded` as a LedgerRow (through its packed rows: the same floats)."""
    n_agents = folded.value.shape[1]
    return [ledger_row(row, n_agents, agent_names) for row in folded.packed().tolist()]


_DISCOUNTS: dict[tuple[float, int], np.ndarray] = {}


def step_weights(probs, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """probs: [B, K, A+1] (a tensor or an array; END last) -> (gamma^(k-1) s^(k), [B, K]: the weight of
    each step's P^(k) in Folded.value; probs in float64)."""
    if isinstance(probs, torch.Tensor):
        probs = probs.numpy(force=True)  # detached, on the CPU: one call, not three
    probs = np.asarray(probs, dtype=np.float64)
    end_hazard = probs[..., -1]
    alive = np.empty_like(end_hazard)  # s^(k), models.base.survival
    alive[:, 0] = 1.0
    np.cumprod(1.0 - end_hazard[:, :-1], axis=-1, out=alive[:, 1:])
    key = (gamma, probs.shape[1])
    if key not in _DISCOUNTS:
        _DISCOUNTS[key] = gamma ** np.arange(probs.shape[1])
    return _DISCOUNTS[key][None, :] * alive, probs


def fold(probs, gamma: float) -> Folded:
    """probs: [B, K, A+1] (a tensor or an array; END last) -> Folded, in float64. Row by row the same
    floats whatever else shares the batch (elementwise work and a sum over the K axis in order)."""
    weights, probs = step_weights(probs, gamma)
    agents, end_hazard = probs[..., :-1], probs[..., -1]
    value = (weights[..., None] * agents).sum(axis=1)
    return Folded(value, agents[:, 0], agents.argmax(axis=-1), agents.max(axis=-1) > end_hazard)


class PrefixTable:
    """A source's predictions of every prefix of every workflow of a replay, computed before the
    replay in a few large batches.

    A prediction reads only the workflow's own history (its agents so far, task text, hidden
    vector; the perfect predictor, its future), never the cache, so the prediction after a
    workflow's n-th call is known before the replay starts. `lookup` then answers a batch of live
    workflows with one gather, and None when a workflow is not in the table (the caller predicts
    it directly). Only sources whose rows do not depend on which other rows share their batch
    may be tabled (`batch_invariant`): then the table's rows are the very floats a per-step batch
    would have had."""

    def __init__(self, predict: Callable, workflows: Sequence, batch_size: int = 8192,
                 times: Callable | None = None):
        """`times`: the source's [B, K] times for a batch of prefixes (None: it gives none); they
        are tabled on the first `lookup_times`, in the same batches."""
        self.rows: dict[str, tuple[list, int]] = {}  # workflow id -> (its calls, row of its first prefix)
        total = 0
        for w in workflows:
            self.rows[w.id] = (w.calls, total)
            total += len(w.calls)
        self._workflows, self._batch_size = list(workflows), batch_size
        chunks = [predict(batch).numpy() for batch in self._prefix_batches()]
        self.probs = np.concatenate(chunks) if chunks else None
        self._times, self.seconds = times, None
        if times is None:
            self._workflows = []
        # gamma -> (packed Folded rows, agents, blocks of those rows as lists: packed_row)
        self._folded: dict[float, tuple[np.ndarray, int, dict[int, list]]] = {}
        self._derived: dict[Hashable, tuple[np.ndarray, ...]] = {}  # key -> lookup_derived's arrays

    def _prefix_batches(self):
        """Every prefix of every workflow, in table order, a batch of about `batch_size` at a time
        (made as they are read: only one batch is held)."""
        pending = []
        for w in self._workflows:
            pending += [_Prefix(w, n) for n in range(1, len(w.calls) + 1)]
            if len(pending) >= self._batch_size:
                yield pending
                pending = []
        if pending:
            yield pending

    def covers(self, workflows: Sequence) -> bool:
        return all(self.rows.get(w.id, (None,))[0] is w.calls for w in workflows)

    def index(self, workflows) -> list[int] | None:
        """The table rows of these workflows as they stand now, or None if one is not in it."""
        index = []
        for w in workflows:
            calls, first = self.rows.get(w.id, (None, 0))
            if calls is not getattr(w, "calls", None) or not 1 <= getattr(w, "next_call", 0) <= len(calls):
                return None
            index.append(first + w.next_call - 1)
        return index

    def lookup(self, workflows) -> torch.Tensor | None:
        index = self.index(workflows)
        return None if index is None else torch.from_numpy(self.probs[index])

    def lookup_times(self, workflows) -> np.ndarray | None:
        """The tabled times of these workflows (computed for the whole table on the first call),
        or None if the source gives none or a workflow is not in the table."""
        index = self.index(workflows)
        seconds = None if index is None else self._all_times()
        return None if seconds is None else seconds[index]

    def _all_times(self) -> np.ndarray | None:
        """The whole table's times, computed on the first call; None if the source gives none."""
        if self.seconds is None and self._times is not None:
            chunks = [self._times(batch) for batch in self._prefix_batches()]
            self._workflows = []
            if any(c is None for c in chunks):  # a source without times (a checkpoint saved before them)
                self._times = None
                return None
            self.seconds = np.concatenate([np.asarray(c) for c in chunks])
        return self.seconds

    def lookup_derived(self, workflows, key: Hashable, derive: Callable) -> list[np.ndarray] | None:
        """The rows of these workflows of `derive(probs, seconds)` (arrays with a row per prefix;
        seconds None where the source gives no times), computed once for the whole table under
        `key`: only for a derivation whose rows do not depend on which other rows share the batch,
        as `fold`'s. None if a workflow is not in the table."""
        index = self.index(workflows)
        if index is None:
            return None
        if key not in self._derived:
            self._derived[key] = tuple(derive(self.probs, self._all_times()))
        return [table_rows(a, index) for a in self._derived[key]]

    def lookup_rows(self, workflows, gamma: float, agent_names: Sequence[str]) -> list[LedgerRow] | None:
        """The folded rows (`fold`, computed once for the whole table) of these workflows, as the
        ledger keeps them (`ledger_row`; `agent_names`: the source's)."""
        index = self.index(workflows)
        if index is None:
            return None
        if gamma not in self._folded:
            self._folded[gamma] = (fold(self.probs, gamma).packed(), self.probs.shape[-1] - 1, {})
        packed, n_agents, blocks = self._folded[gamma]
        return [ledger_row(packed_row(packed, blocks, i), n_agents, agent_names) for i in index]


ROW_BLOCK = 256  # packed rows made Python lists at once (one tolist for a block, not four per lookup)
ROW_BLOCKS_KEPT = 32  # blocks kept (the oldest made goes first): the live workflows' rows, not the table's


def packed_row(packed: np.ndarray, blocks: dict[int, list], i: int) -> list:
    """Row `i` of a packed table as a list of floats, from the block of ROW_BLOCK rows that holds it,
    made once (a table's rows are read in about the order the workflows arrive; a block made again
    after it was dropped gives the same floats)."""
    b = i // ROW_BLOCK
    block = blocks.get(b)
    if block is None:
        if len(blocks) >= ROW_BLOCKS_KEPT:
            del blocks[next(iter(blocks))]
        block = blocks[b] = packed[b * ROW_BLOCK:(b + 1) * ROW_BLOCK].tolist()
    return block[i - b * ROW_BLOCK]


def table_rows(array: np.ndarray, index: list[int]) -> np.ndarray:
    """These rows of a table's array: one row as a view (most scheduler steps finish one call; a
    list index copies, after converting the list), more as a copy."""
    return array[index[0]:index[0] + 1] if len(index) == 1 else array[index]


class _Prefix:
    """A workflow as it stands after its n-th call (SimWorkflow's view of `agents`, `hidden` and
    `future_agents` at next_call = n)."""

    __slots__ = ("id", "task", "agents", "hidden", "future_agents", "future_gaps")

    def __init__(self, w, n: int):
        calls = w.calls
        self.id, self.task = w.id, w.task
        self.agents = [c.agent for c in calls[:n]]
        self.future_agents = [c.agent for c in calls[n:]]
        self.future_gaps = [c.tool_time for c in calls[n:]]
        self.hidden = calls[n - 1].hidden


def tabulate(source, workflows: Sequence) -> None:
    """Before a replay: give every batch-invariant source in the chain (a wrapper's `inner`) the
    table of its predictions for these workflows. Wrappers that learn or draw noise online keep
    running per step, on the tabled predictions of what they wrap."""
    while source is not None:
        if getattr(source, "batch_invariant", False) and not (source.table and source.table.covers(workflows)):
            source.table = PrefixTable(source.predict_uncached, workflows,
                                       times=getattr(source, "times_uncached", None))
        source = getattr(source, "inner", None)


class _Tabled:
    """A source whose `predict` answers from its PrefixTable when it has one."""

    batch_invariant = True
    table: PrefixTable | None = None

    def predict(self, workflows):
        if self.table is not None:
            probs = self.table.lookup(workflows)
            if probs is not None:
                return probs
        return self.predict_uncached(workflows)

    def predict_rows(self, workflows, gamma: float) -> list[LedgerRow] | None:
        """The predictions already folded for the cache's ledger (`fold`, `ledger_row`), from the
        table; None without one."""
        return self.table.lookup_rows(workflows, gamma, self.agent_names) if self.table is not None else None

    def predict_derived(self, workflows, key: Hashable, derive: Callable) -> list[np.ndarray] | None:
        """`derive(probs, seconds)` of the predictions, from the table (PrefixTable.lookup_derived);
        None without one."""
        return self.table.lookup_derived(workflows, key, derive) if self.table is not None else None

    def times_uncached(self, workflows) -> np.ndarray | None:
        return None  # a source that gives times says so

    def predict_times(self, workflows) -> np.ndarray | None:
        """[B, K] median seconds until each next call (`predict_times`), from the table when it has them."""
        if self.table is not None:
            seconds = self.table.lookup_times(workflows)
            if seconds is not None:
                return seconds
        return self.times_uncached(workflows)


class ModelSource(_Tabled):
    """A trained predictor (train.py checkpoint). Tabled before a replay when its rows do not
    depend on the batch (`Predictor.batch_invariant`), or when `tabulate=True` asks for it: a
    network's tabled rows then differ from per-step batches in float32 rounding (a few 1e-7),
    so the replay is the same model's but not bit for bit the per-step replay."""

    def __init__(self, predictor, tabulate: bool = False):
        self.predictor, self.tabulate = predictor, tabulate
        self.agent_names, self.horizon = predictor.agent_names, predictor.horizon

    @property
    def batch_invariant(self) -> bool:
        return self.tabulate or getattr(self.predictor, "batch_invariant", False)

    def predict_uncached(self, workflows):
        return self.predictor.predict([WorkflowPrefix(w.agents, w.task, w.hidden) for w in workflows])

    def times_uncached(self, workflows) -> np.ndarray | None:
        """The predictor's median time until each next call (the quantile level nearest 0.5); None
        for a checkpoint saved before predictors gave times."""
        if getattr(self.predictor, "time_spec", None) is None:
            return None
        levels = np.asarray(self.predictor.time_quantiles)
        _, seconds = self.predictor.predict_when([WorkflowPrefix(w.agents, w.task, w.hidden) for w in workflows])
        return seconds[..., int(np.abs(levels - 0.5).argmin())].numpy().astype(np.float64)


def _one_hot_paths(paths: Sequence[Sequence[str]], agent_names: list[str], horizon: int) -> torch.Tensor:
    """[B, K, A+1]: step k is the path's k-th agent, or END once the path runs out."""
    index = {a: i for i, a in enumerate(agent_names)}
    end = len(agent_names)
    hot = [[index.get(path[k], 0) if k < len(path) else end for k in range(horizon)] for path in paths]
    out = np.zeros((len(paths), horizon, end + 1), dtype=np.float32)  # filled in numpy: no per-element tensor writes
    if hot:
        np.put_along_axis(out, np.array(hot, dtype=np.int64)[..., None], 1.0, axis=-1)
    return torch.from_numpy(out)


def normalised(log_weights: list[float]) -> list[float]:
    """exp(log_weights - their max) over its sum, as floats: the arrays' arithmetic in its order,
    with numpy's exp, not math's (a SIMD build of numpy may round it otherwise than the C library,
    and OnlineBackoff's weights must be the same bits wherever they are computed; tests/simulator
    checks them against the arrays' formula)."""
    top = max(log_weights)
    e = np.exp([x - top for x in log_weights]).tolist()
    total = 0.0
    for x in e:  # in order, as numpy adds a few floats (not sum(): Python 3.12's compensates)
        total += x
    return [x / total for x in e]


def by_agent(names: Sequence[str], p: list[float]) -> dict:
    """A row [A+1] (END last) as agent -> probability, END as None."""
    row = dict(zip(names, p))
    row[None] = p[len(names)]
    return row


class OnlineBackoff:
    """A trained predictor that keeps learning while serving.

    It folds the transitions of the live workflows into counts as their calls finish (and END
    as they end): for each step offset k = 1..K, how often agent a at position t was followed by
    b (or END) at position t + k, i.e. k-step hazard counts like the predictor's own P^(k). Two
    experts predict:

        model:   the trained predictor's P^(k);
        backoff: the Dirichlet posterior with the model as its prior,
                 (n_k(a, .) + beta P^(k)) / (n_k(a) + beta), a the workflow's current agent,

    and are mixed with weights learnt online from the probability each gave the agent that
    actually came next (exponentiated log loss, with fixed share so that the mixture can move
    back when the workload changes: Herbster and Warmuth, Machine Learning 1998). Agents the
    trained predictor never saw get their own columns as they appear (the model gives them no
    mass, the counts do), so `agent_names` grows while serving (in place)."""

    def __init__(self, inner: PredictionSource, beta: float = OnlineBackoffConfig.online_beta,
                 share: float = 0.01):
        if beta <= 0 or not 0.0 <= share < 0.5:
            raise ValueError(f"online backoff needs beta > 0 and share in [0, 0.5); got {beta}, {share}")
        self.inner, self.beta, self.share = inner, beta, share
        self.horizon = inner.horizon
        self.agent_names = list(inner.agent_names)
        self.index = {a: i for i, a in enumerate(self.agent_names)}
        self.counts: dict[tuple[str, int], Counter] = defaultdict(Counter)  # (agent, k) -> next agent / None
        self.folded: dict[str, int] = {}  # workflow id -> agents folded so far
        self.last: dict[str, tuple[dict, dict]] = {}  # workflow id -> (model, backoff) P^(1) by agent name
        self.ended: deque = deque()  # (workflow id, its agents) of workflows that ended
        self.log_weight = np.zeros(2)  # model, backoff
        self._weights: list[float] | None = None  # `_mixture()`, until log_weight changes
        self.observed = 0

    @property
    def weights(self) -> np.ndarray:
        """The experts' mixture weights (model, backoff): softmax of log_weight."""
        return np.array(self._mixture())

    def _mixture(self) -> list[float]:
        if self._weights is None:
            self._weights = normalised(self.log_weight.tolist())
        return self._weights

    def _fold(self, w, ended: bool = False) -> None:
        agents, start = w.agents, self.folded.get(w.id, 0)
        for j in range(start, len(agents) + ended):
            nxt = agents[j] if j < len(agents) else None  # None: END
            if nxt is not None and nxt not in self.index:
                self.index[nxt] = len(self.agent_names)
                self.agent_names.append(nxt)
            if j == start and w.id in self.last:  # the call the latest prediction was about
                self._score(*self.last.pop(w.id), nxt)
            for k in range(1, self.horizon + 1):
                if j - k >= 0:
                    self.counts[(agents[j - k], k)][nxt] += 1
        self.folded[w.id] = len(agents)

    def _score(self, model: dict, backoff: dict, nxt) -> None:
        """Each expert's weight times the probability it gave `nxt` (at least 1e-6), normalised, then
        the fixed share (in the arrays' arithmetic, as `normalised` says)."""
        p = np.log([max(model.get(nxt, 0.0), 1e-6), max(backoff.get(nxt, 0.0), 1e-6)]).tolist()
        w = normalised([a + b for a, b in zip(self.log_weight.tolist(), p)])
        keep, spread = 1 - self.share, self.share / 2  # fixed share
        self.log_weight, self._weights = np.log([keep * x + spread for x in w]), None
        self.observed += 1

    def finished(self, workflow) -> None:
        """Queued and folded at the next `predict` (which may run on another thread, the plugin's)."""
        self.ended.append((workflow.id, list(workflow.agents)))

    def predict(self, workflows):
        while self.ended:
            wf_id, agents = self.ended.popleft()
            self._fold(SimpleNamespace(id=wf_id, agents=agents), ended=True)
            self.folded.pop(wf_id, None)
            self.last.pop(wf_id, None)
        for w in workflows:
            self._fold(w)
        model = self.inner.predict(workflows).numpy().astype(np.float64)
        if not np.isfinite(model).all():
            # a bad round (corrupted weights, a numerical blow-up) reaches no running state: the
            # pending predictions are dropped unscored and the weights stay as they were, so the
            # next healthy round is mixed as before; the caller's guard rejects this one
            for w in workflows:
                self.last.pop(w.id, None)
            return torch.from_numpy(model)
        names, beta, index = self.agent_names, self.beta, self.index
        n_model, n = model.shape[-1] - 1, len(names)
        pad = [0.0] * (n - n_model)  # the columns of agents the model never saw: it gives them nothing
        w_model, w_backoff = self._mixture()
        # row by row in Python floats, not a numpy call per row (a step predicts for one or two
        # workflows): the same IEEE operations in the same order as the arrays' elementwise ones,
        # and the counts are integers, so their sum is exact either way
        mixed = []
        for w, rows in zip(workflows, model.tolist()):
            current, steps = w.agents[-1], []
            for k, row in enumerate(rows):
                expert = row[:n_model] + pad + row[-1:]  # the model's P^(k), END last
                seen = self.counts.get((current, k + 1))
                if seen:
                    counts = [0] * (n + 1)
                    for nxt, c in seen.items():
                        counts[n if nxt is None else index[nxt]] = c
                    total = sum(counts) + beta
                    posterior = [(c + beta * p) / total for c, p in zip(counts, expert)]
                else:
                    posterior = expert
                if k == 0:  # the experts' P^(1), scored when the workflow's next call comes
                    self.last[w.id] = by_agent(names, expert), by_agent(names, posterior)
                steps.append([w_model * a + w_backoff * b for a, b in zip(expert, posterior)])
            mixed.append(steps)
        return torch.from_numpy(np.array(mixed, dtype=np.float64).reshape(len(workflows), model.shape[1], n + 1))


class PerfectSource(_Tabled):
    """The true next K agents of each workflow: pbkv with a perfect predictor (an upper bound)."""

    def __init__(self, agent_names: list[str], horizon: int):
        self.agent_names, self.horizon = agent_names, horizon

    def predict_uncached(self, workflows):
        return _one_hot_paths([w.future_agents[: self.horizon] for w in workflows], self.agent_names, self.horizon)

    def times_uncached(self, workflows) -> np.ndarray:
        """The true tool times until each next call (summed; the queueing is the server's to know)."""
        out = np.zeros((len(workflows), self.horizon))
        for b, w in enumerate(workflows):
            gaps = np.cumsum(w.future_gaps[: self.horizon])
            out[b, : len(gaps)] = gaps
        return out


class AgentStepGraph(_Tabled):
    """KVFlow's view (Pan et al., arXiv 2507.07400): the Agent Step Graph of the workflow's
    definition, and each agent's steps-to-execution from where a workflow stands in it.

    Two kinds of graph (a generated dataset declares its own in meta.json, data/generators.py):

        {"kind": "pipeline", "steps": [a1, a2, ...]}    a static pipeline: after n calls the
            workflow is at step n, and agent a executes in (first j >= n with steps[j] = a) - n + 1 steps;
        {"kind": "transitions", "start": [...], "next": {a: [b, ..., "END"]}}    a dynamic workflow's
            possible transitions: a executes at the earliest in the length of the shortest path
            from the last agent to a (KVFlow takes the nearest of the branches).

    Imported traces declare none: `from_traces` takes every transition seen in the train split.
    `predict` gives the distributions KVFlow's prefetch reads (the pipeline's next steps; a
    uniform choice among a dynamic graph's successors); `steps_to_execution` gives its eviction order."""

    def __init__(self, graph: dict, horizon: int, agent_names: list[str] | None = None, origin: str = "declared"):
        kind = graph.get("kind")
        if kind == "pipeline":
            self.steps = list(graph["steps"])
            agents = set(self.steps)
        elif kind == "transitions":
            self.next = {a: list(dict.fromkeys(bs)) for a, bs in graph["next"].items()}
            agents = set(self.next) | {b for bs in self.next.values() for b in bs} | set(graph.get("start", ()))
            agents.discard(END)
        else:
            raise ValueError(f"agent graph kind must be 'pipeline' or 'transitions'; got {kind!r}")
        self.graph, self.kind, self.horizon, self.origin = graph, kind, horizon, origin
        self.agent_names = agent_names or vocabulary(agents)
        self._distances: dict[str, dict[str, int]] = {}

    @classmethod
    def from_traces(cls, train_workflows: Sequence[Sequence[str]], horizon: int,
                    agent_names: list[str] | None = None) -> "AgentStepGraph":
        """Every transition seen in the (train) traces, END included."""
        successors: dict[str, dict[str, None]] = defaultdict(dict)
        for agents in train_workflows:
            for a, b in zip(agents, list(agents[1:]) + [END]):
                successors[a][b] = None
        graph = {"kind": "transitions", "start": sorted({a[0] for a in train_workflows if a}),
                 "next": {a: sorted(bs) for a, bs in sorted(successors.items())}}
        return cls(graph, horizon, agent_names, origin="train transitions")

    @classmethod
    def for_dataset(cls, meta: dict, train_workflows: Sequence[Sequence[str]], horizon: int,
                    agent_names: list[str] | None = None) -> "AgentStepGraph":
        """The dataset's declared graph (meta.json `agent_graph`), else the train split's transitions."""
        if meta.get("agent_graph"):
            return cls(meta["agent_graph"], horizon, agent_names)
        return cls.from_traces(train_workflows, horizon, agent_names)

    def distances_from(self, agent: str) -> dict[str, int]:
        """Shortest path lengths (>= 1) from `agent` to every agent reachable (breadth-first)."""
        if agent not in self._distances:
            out, frontier, depth = {}, [agent], 0
            while frontier:
                depth += 1
                nxt = []
                for a in frontier:
                    for b in self.next.get(a, ()):
                        if b != END and b not in out:
                            out[b] = depth
                            nxt.append(b)
                frontier = nxt
            self._distances[agent] = out
        return self._distances[agent]

    def steps_of(self, workflow: LiveWorkflow) -> dict[str, int]:
        if self.kind == "pipeline":
            at, out = len(workflow.agents), {}
            for j, a in enumerate(self.steps[at:], start=1):
                out.setdefault(a, j)
            return out
        return dict(self.distances_from(workflow.agents[-1]))

    def steps_to_execution(self, workflows: Sequence[LiveWorkflow]) -> list[dict[str, int]]:
        return [self.steps_of(w) for w in workflows]

    def predict_uncached(self, workflows):
        if self.kind == "pipeline":
            return _one_hot_paths([self.steps[len(w.agents):len(w.agents) + self.horizon] for w in workflows],
                                  self.agent_names, self.horizon)
        index = {a: i for i, a in enumerate(self.agent_names)}
        end = len(self.agent_names)
        out = torch.zeros(len(workflows), self.horizon, end + 1)
        for b, w in enumerate(workflows):
            state = {w.agents[-1]: 1.0}  # where the workflow is, given it is still running
            for k in range(self.horizon):
                step: dict[str, float] = defaultdict(float)
                for a, p in state.items():
                    successors = self.next.get(a) or [END]
                    for s in successors:
                        step[s] += p / len(successors)
                for s, p in step.items():
                    out[b, k, index.get(s, 0) if s != END else end] += p
                alive = 1.0 - step.get(END, 0.0)
                if alive <= 0:
                    out[b, k + 1:, end] = 1.0
                    break
                state = {a: p / alive for a, p in step.items() if a != END}
        return out


class NoisySource:
    """Prediction error of a controlled size eps, for robustness sweeps (seeded).

    uniform:     P' = (1 - eps) P + eps R, R drawn uniformly from the simplex: random error,
                 which is benign on average.
    adversarial: P' = (1 - eps) P + eps Q, Q spread evenly over the agents that are NOT the true
                 k-th next call (END counts as a call), preferring agents the workflow already
                 ran (their cache is what the misplaced mass then protects): error aimed at the
                 policy. It reads the true future, as `PerfectSource` does (simulator only)."""

    KINDS = NOISE_KINDS

    def __init__(self, inner: PredictionSource, eps: float, seed: int, kind: str = NoiseConfig.noise_kind):
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"predictor.noise must be in [0, 1]; got {eps}")
        if kind not in self.KINDS:
            raise ValueError(f"predictor.noise_kind must be one of {', '.join(self.KINDS)}; got '{kind}'")
        self.inner, self.eps, self.kind = inner, eps, kind
        self.agent_names, self.horizon = inner.agent_names, inner.horizon
        self.generator = torch.Generator().manual_seed(seed)

    def predict(self, workflows):
        probs = self.inner.predict(workflows)
        if self.eps == 0:
            return probs
        if self.kind == "adversarial":
            noise = self.wrong_mass(workflows, probs.shape)
        else:  # normalised Exp(1) draws are uniform on the simplex
            noise = torch.empty(probs.shape, dtype=torch.float64).exponential_(generator=self.generator)
            noise = noise / noise.sum(dim=-1, keepdim=True)
        return (1 - self.eps) * probs + self.eps * noise.to(probs.dtype)

    def wrong_mass(self, workflows, shape) -> torch.Tensor:
        """[B, K, A+1]: at each step, mass spread over the agents that will not be called then."""
        end = shape[-1] - 1
        index = {a: i for i, a in enumerate(self.agent_names[:end])}  # the inner source's names may grow
        out = torch.zeros(shape, dtype=torch.float64)
        for b, w in enumerate(workflows):
            ran = sorted({index[a] for a in w.agents if a in index})
            for k in range(shape[1]):
                truth = index.get(w.future_agents[k], -1) if k < len(w.future_agents) else end
                wrong = [i for i in ran if i != truth] or [i for i in range(end) if i != truth]
                out[b, k, wrong] = 1.0 / len(wrong)
        return out
