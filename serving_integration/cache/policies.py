"""KV-cache eviction and prefetch policies: the one implementation used by the simulator and
by the SGLang plugin.

A policy is a small class with one ordering method, `priority(node)`: smaller is evicted first,
as in SGLang's `EvictionStrategy.get_priority`. The eviction machinery (a heap over evictable
nodes, in the simulator's tree or in SGLang's) is shared and knows no policy. A node is anything
with `id`, `last_access_time` and `hit_count` (T-LRU also reads depths); what a policy knows of
workflows comes from a `WorkflowLedger`, kept outside the nodes, keyed by node id.

Policies (docs/simulator.md; PBKV, arXiv 2605.06472):
    lru        last access time                                     (SGLang's default)
    lfu        (hit count, last access)                             (SGLang's)
    tlru       tail-optimised LRU: tokens past a conversation's TTFT budget first (SGLang's)
    kvflow_ideal  idealised KVFlow: larger steps-to-execution first, from the agent step graph;
               retired cache counts as never needed (KVFlow as its code runs it: `kvflow`,
               baselines.py, with SGLang's other strategies and Continuum)
    pbkv_lae   lifecycle-aware: retired cache first, then LRU
    pbkv       retired first; then active by ascending lookahead reuse score; LRU breaks ties.
               trust="outcome" (default) orders as pbkv_lae while that order wins on shadow
               caches (cache/trust.py); "accuracy" while the predictions prove poor;
               "always" is the paper's policy
    pbkv_time  PBKV's score with each read discounted by when it is expected (the predictor's
               times) and the calls waiting in the admission queue known (PBKVTime)
    oracle     clairvoyant: furthest next use first (simulator only; it needs the real future)

PBKV's score of node c with the live workflows W_act(c) that used it:

    Score(c) = sum_{k=1..K} gamma^(k-1) sum_{w in W_act(c)} s_w^(k) <A_w(c), P_w^(k)>,
    s_w^(k) = prod_{j<k} (1 - P_w^(j)[END]),

A_w(c) the indicator of w's agents that accessed c, P_w^(k) the predicted agent distribution k
calls ahead. The ledger folds each workflow's predictions into one value per agent,
v_w[a] = sum_k gamma^(k-1) s_w^(k) P_w^(k)[a], so a score costs O(sum_w |A_w(c)|).

Robustness (trust, cache/trust.py). Learning-augmented caching follows predictions only while they
earn it, and falls back to a robust order otherwise (Lykouris and Vassilvitskii, ICML 2018; Wei,
APPROX 2020; Rohatgi, SODA 2020); ARC (Megiddo and Modha, FAST 2003) and LeCaR (Vietri et al.,
HotStorage 2018) adapt the same way, online, from what the running workload shows. Under
trust="outcome" the evidence is the GPU hits each order would have had on shadow caches that
follow the server's calls; under "accuracy", the probability the workflow's last prediction gave
the agent that came next. Either switches, with hysteresis, between the prediction score and
lifecycle-aware LRU. A switch changes every node's priority at once, so the simulator's tree
re-heapifies its evictable nodes (O(n), only at a switch; between switches an eviction stays
O(log n)); SGLang builds its heap anew on every eviction pass, so the plugin needs nothing more.
"""

from __future__ import annotations

import math
import operator
from functools import reduce
from typing import Callable, ClassVar, Iterable, NamedTuple, Protocol, Sequence

import cython
import numpy as np
import torch

from data.knobs import build
from serving_integration.cache.config import POLICY_PREFETCH_MODES, PREFETCH_MODES, TRUST_MODES, KvflowConfig, \
    PbkvConfig, TlruConfig, TrustConfig
from serving_integration.cache.predictions import LedgerRow, fold, ledger_rows, step_weights
from serving_integration.cache.trust import TrustMeter  # noqa: F401  (re-exported)
from serving_integration.cache.trust import OutcomeTrust, TimeOutcomeTrust, agents_value, log_sum_exp, make_trust, \
    sum_parts

INF = math.inf


class CacheNode(Protocol):
    id: int
    last_access_time: float
    hit_count: int


class Changed(NamedTuple):
    """Nodes a new prediction changed: their score, or their steps-to-execution (KVFlow)."""

    scores: list[int]
    steps: list[int]


class _WorkflowRows:
    """One live workflow's share of the ledger: a row per node it used (in no particular order),
    holding the ledger columns of the agents that used the node (first use first, padded with -1
    to a common width, so the rows are one array when a prediction comes) and the node's part of
    the score, sum_{a in A_w(c)} v_w[a]. Plain lists: a call's accesses append to them cheaply."""

    __slots__ = ("row", "nodes", "agents", "part", "width", "shared", "value")

    def __init__(self) -> None:
        self.row: dict[int, int] = {}  # node id -> row
        self.nodes: list[int] = []  # row -> node id
        self.agents: list[list[int]] = []  # row -> agent columns, -1 padded to `width`
        self.part: list[float] = []  # row -> sum of v_w over the row's agents
        self.width = 1
        self.shared: dict[int, None] = {}  # its nodes that other live workflows used too
        self.value: list[float] | None = None  # v_w by ledger column and a 0 (the padding's), None before a prediction

    def add(self, node_id: int, agents: list[int] | None = None, part: float = 0.0) -> int:
        self.row[node_id] = r = len(self.nodes)
        self.nodes.append(node_id)
        self.agents.append(list(agents) if agents else [-1] * self.width)
        self.part.append(part)
        return r

    def set_agent(self, r: int, slot: int, column: int) -> None:
        if slot == self.width:
            self.width += 1
            for agents in self.agents:
                agents.append(-1)
        self.agents[r][slot] = column

    def drop(self, node_id: int) -> None:
        """Forget a node's row: the last row takes its place."""
        r = self.row.pop(node_id)
        self.shared.pop(node_id, None)
        moved, agents, part = self.nodes.pop(), self.agents.pop(), self.part.pop()
        if moved != node_id:
            self.nodes[r], self.agents[r], self.part[r] = moved, agents, part
            self.row[moved] = r


class WorkflowLedger:
    """Which live workflows, and which of their agents, used each cache node; their predictions.

    Ordered dicts stand in for sets throughout, so iteration order (and with it every tie) is
    the same in every run. Each node's score is kept current as the ledger changes, so an
    eviction reads it without recomputing it: a workflow's new prediction computes the parts of
    all the nodes it used in one vectorised step over its rows (`_WorkflowRows`) and sets the
    scores of the nodes only it used from them; only nodes other live workflows used too are
    summed over their users. Sums run in the definition's order (users in first-use order, each
    one's agents in first-use order, left to right), so a score is the same float however it
    was reached."""

    def __init__(self, gamma: float = PbkvConfig.gamma):
        self.gamma = gamma
        self.users: dict[int, dict[str, dict[str, None]]] = {}  # node id -> workflow -> agents
        self.nodes_of: dict[str, dict[int, None]] = {}  # workflow -> node ids it used
        self.reuse_value: dict[str, dict[str, float]] = {}  # workflow -> agent -> v_w[agent]
        self.next_value: dict[str, dict[str, float]] = {}  # workflow -> agent -> s^(1) P^(1)[agent]
        self.steps_to: dict[str, dict[str, int]] = {}  # workflow -> agent -> first k it is the argmax
        self.unchecked: dict[str, None] = {}  # workflows whose latest prediction no call has tested yet
        self.columns: dict[str, int] = {}  # agent -> its column in the workflows' rows and values
        self._rows: dict[str, _WorkflowRows] = {}  # live workflow -> its rows
        self._score: dict[int, float] = {}  # node id -> Score(node), current (absent: 0)
        # shared node id -> workflow -> its part of the node's score, in the order of `users`
        self._parts: dict[int, dict[str, float]] = {}
        self._name_columns: tuple = (None, 0, None)  # (agent_names list, its length, their columns)
        # each is called with a workflow whenever its v_w changes or it retires (PBKV's outcome judge)
        self.listeners: list[Callable[[str], None]] = []

    # ---------------------------------------------------------------- lifecycle

    def start(self, workflow: str) -> None:
        self.nodes_of.setdefault(workflow, {})
        self._rows.setdefault(workflow, _WorkflowRows())

    def is_live(self, workflow: str) -> bool:
        return workflow in self.nodes_of

    def record_access(self, node_id: int, workflow: str, agent: str) -> None:
        self.record_path((node_id,), workflow, agent)

    @cython.locals(rows=_WorkflowRows)
    def record_path(self, node_ids: Iterable[int], workflow: str, agent: str) -> None:
        """A call of `agent` in `workflow` read (or wrote) these nodes."""
        nodes = self.nodes_of.get(workflow)
        if nodes is None:  # unknown or already ended: the nodes stay unowned
            return
        users, rows = self.users, self._rows[workflow]
        for node_id in node_ids:
            owners = users.get(node_id)
            if owners is None:
                owners = users[node_id] = {}
            agents = owners.get(workflow)
            if agents is None:
                agents = owners[workflow] = {}
                nodes[node_id] = None
                r = rows.add(node_id)
                if len(owners) > 1:
                    self._share(node_id, owners)
            elif agent in agents:
                continue
            else:
                r = rows.row[node_id]
            agents[agent] = None
            rows.set_agent(r, len(agents) - 1, self.columns.setdefault(agent, len(self.columns)))
            if rows.value is not None:
                rows.part[r] = part = self._part(rows, r)
                if node_id in rows.shared:
                    self._parts[node_id][workflow] = part
                    self._rescore(node_id)
                else:
                    self._score[node_id] = part

    @cython.locals(rows=_WorkflowRows)
    def _share(self, node_id: int, owners: dict) -> None:
        """The node has a second (or later) user: its parts are kept per user from now on."""
        parts = self._parts.get(node_id)
        if parts is None:
            parts = self._parts[node_id] = {}
            for w in owners:
                rows = self._rows[w]
                rows.shared[node_id] = None
                parts[w] = rows.part[rows.row[node_id]]
        else:
            w = next(reversed(owners))
            rows = self._rows[w]
            rows.shared[node_id] = None
            parts[w] = rows.part[rows.row[node_id]]

    def end(self, workflow: str) -> list[int]:
        """Retire a workflow; returns the nodes it used (their priorities changed)."""
        if workflow in self.nodes_of:
            for listener in self.listeners:
                listener(workflow)
        nodes = list(self.nodes_of.pop(workflow, {}))
        self._rows.pop(workflow, None)
        for node_id in nodes:
            owners = self.users.get(node_id)
            if owners is None or owners.pop(workflow, None) is None:
                continue
            if not owners:
                del self.users[node_id]
                self._score.pop(node_id, None)
                continue
            parts = self._parts[node_id]
            del parts[workflow]
            if len(owners) == 1:  # one user left: its row alone holds the score
                (last,) = owners
                del self._parts[node_id], self._rows[last].shared[node_id]
                self._score[node_id] = parts[last] if self._rows[last].value is not None else 0.0
            else:
                self._rescore(node_id)
        for table in (self.reuse_value, self.next_value, self.steps_to, self.unchecked):
            table.pop(workflow, None)
        return nodes

    @cython.locals(rows=_WorkflowRows)
    def split(self, prefix_id: int, suffix_id: int) -> None:
        """A node split: the new prefix node was used by everyone who used the old node."""
        owners = self.users.get(suffix_id)
        if not owners:
            return
        self.users[prefix_id] = {w: dict(agents) for w, agents in owners.items()}
        if suffix_id in self._parts:
            self._parts[prefix_id] = dict(self._parts[suffix_id])
        for w in owners:
            self.nodes_of[w][prefix_id] = None
            rows = self._rows[w]
            suffix_row = rows.row[suffix_id]
            rows.add(prefix_id, rows.agents[suffix_row], rows.part[suffix_row])
            if suffix_id in rows.shared:
                rows.shared[prefix_id] = None
        if suffix_id in self._score:
            self._score[prefix_id] = self._score[suffix_id]

    def forget(self, node_id: int) -> None:
        self._parts.pop(node_id, None)
        self._score.pop(node_id, None)
        for w in self.users.pop(node_id, {}):
            self.nodes_of[w].pop(node_id, None)
            self._rows[w].drop(node_id)

    # ---------------------------------------------------------------- scores

    @staticmethod
    def _part(rows: _WorkflowRows, r: int) -> float:
        """sum_{a in A_w(c)} v_w[a] for one row, agents in first-use order."""
        value = rows.value
        assert value is not None, "a row's part is read only once its workflow has a prediction"
        return sum(value[c] for c in rows.agents[r] if 0 <= c < len(value) - 1)

    def _rescore(self, node_id: int) -> None:
        """Score(c) = sum over the node's users, first user first, of their parts (left to right,
        as a loop adds them, `sum_parts`, as the outcome judge's keys; a workflow without
        predictions adds 0)."""
        self._score[node_id] = sum_parts(self._parts[node_id])

    @cython.locals(rows=_WorkflowRows)
    def _rescore_workflow(self, workflow: str, rows: _WorkflowRows, value: list[float]) -> list[int]:
        """A workflow's new v_w (by column, a 0 appended for the padding, which -1 reads): every
        row's part, the scores of nodes only it used set from them; returns the nodes whose score
        changed. A part adds the row's agents left to right, padding included (adding 0.0 leaves
        a float as it is), so it is the float `_part` gives."""
        rows.value = value
        if not rows.nodes:
            return []
        if rows.width == 1:
            part = [value[a] for a, in rows.agents]
        elif rows.width == 2:
            part = [value[a] + value[b] for a, b in rows.agents]
        else:
            part = [reduce(operator.add, [value[c] for c in agents]) for agents in rows.agents]
        rows.part = part
        score, shared = self._score, rows.shared
        changed = [n for n, p in zip(rows.nodes, part) if score.get(n) != p and n not in shared]
        score.update(zip(rows.nodes, part))  # right for the nodes only this workflow used
        for node_id in shared:
            before = self._parts[node_id][workflow]
            self._parts[node_id][workflow] = p = part[rows.row[node_id]]
            self._rescore(node_id)
            if p != before:
                changed.append(node_id)
        return changed

    def _columns_of(self, agent_names: Sequence[str]) -> list[int]:
        names, length, columns = self._name_columns
        if names is not agent_names or length != len(agent_names):  # a source's names may grow in place
            columns = [self.columns.setdefault(a, len(self.columns)) for a in agent_names]
            self._name_columns = (agent_names, len(agent_names), columns)
        return columns

    # ---------------------------------------------------------------- predictions

    def set_predictions(self, workflows: Sequence[str], agent_names: Sequence[str], probs,
                        steps: Sequence[dict[str, int]] | None = None) -> Changed:
        """probs: [B, K, A+1] for B workflows, END last (a predictor's output; a tensor or an
        array). `steps`: each workflow's steps-to-execution per agent, from an agent step graph
        (KVFlow); without it, the first k at which the agent is the likeliest and more likely
        than END. Returns the nodes whose score changed, and every node of a workflow whose
        steps-to-execution changed (a policy's `changed_by` says which of them it reorders)."""
        return self.set_rows(workflows, agent_names, ledger_rows(fold(probs, self.gamma), agent_names), steps)

    def set_rows(self, workflows: Sequence[str], agent_names: Sequence[str], rows: Sequence[LedgerRow],
                 steps: Sequence[dict[str, int]] | None = None) -> Changed:
        """`set_predictions` from predictions already folded (`fold`, with this ledger's gamma) into
        rows (`ledger_row`: a PrefixTable's, or `ledger_rows`); `steps` replaces the rows' own."""
        columns = self._columns_of(agent_names)
        width = len(self.columns) + 1  # the last column: the rows' padding, 0
        changed = Changed([], [])
        for i, w in enumerate(workflows):
            if w not in self.nodes_of:
                continue
            row = rows[i]
            self.reuse_value[w] = row.reuse
            for listener in self.listeners:
                listener(w)
            self.next_value[w] = row.next  # s^(1) = 1
            w_steps = row.steps if steps is None else dict(steps[i])
            if self.steps_to.get(w) != w_steps:
                changed.steps.extend(self.nodes_of[w])
            self.steps_to[w] = w_steps
            self.unchecked[w] = None
            by_column = [0.0] * width
            for c, v in zip(columns, row.value):
                by_column[c] = v
            changed.scores.extend(self._rescore_workflow(w, self._rows[w], by_column))
        return changed

    def check_prediction(self, workflow: str, agent: str) -> float | None:
        """A call of `agent` arrived in `workflow`: the probability the workflow's latest prediction
        gave it one step ahead, or None if no prediction was made since the last call."""
        if workflow not in self.unchecked:
            return None
        del self.unchecked[workflow]
        return self.next_value.get(workflow, {}).get(agent, 0.0)

    # ---------------------------------------------------------------- node views

    def is_retired(self, node_id: int) -> bool:
        return node_id not in self.users

    def _weighted(self, node_id: int, table: dict[str, dict[str, float]]) -> float:
        total = 0.0
        for w, agents in self.users.get(node_id, {}).items():
            values = table.get(w)
            if values:
                total += agents_value(values, agents)
        return total

    def score(self, node_id: int) -> float:
        return self._score.get(node_id, 0.0) if node_id in self.users else 0.0

    def next_step_score(self, node_id: int) -> float:
        return self._weighted(node_id, self.next_value)

    def steps_to_execution(self, node_id: int, hold_step: int) -> float:
        """KVFlow: min over users of min(hold_step + 1, steps until one of its agents runs)."""
        best = INF
        for w, agents in self.users.get(node_id, {}).items():
            steps = self.steps_to.get(w, {})
            for a in agents:
                best = min(best, steps.get(a, hold_step + 1), hold_step + 1)
        return best


# -------------------------------------------------------------------- eviction policies


def on_gpu(node) -> bool:
    """Whether a node's KV is on the GPU, in either tree: the simulator's nodes say so (`on_gpu`),
    SGLang's say whether it is not (`evicted`: not on the device)."""
    flag = getattr(node, "on_gpu", None)
    return flag if flag is not None else not node.evicted


class EvictionPolicy:
    name: ClassVar[str] = "base"
    served_by: ClassVar[str] = "sglang"
    uses_predictions: ClassVar[bool] = False
    reads_ledger: ClassVar[bool] = False  # True: its order reads the WorkflowLedger (who used a node, their predictions)
    reads_step_graph: ClassVar[bool] = False  # True: an agent step graph drives it (KVFlow's; the plugin's step_graph_traces)
    reads_queue: ClassVar[bool] = False  # True: told each call that enters the admission queue (on_queued)
    reads_times: ClassVar[bool] = False  # True: told each batch of predictions with its times (on_predictions)

    def priority(self, node: CacheNode) -> tuple:
        """The node's place in the eviction order, smaller first: a tuple of the same length for
        every node (the simulator's tree compares its items followed by an entry number,
        radix.RadixTree)."""
        raise NotImplementedError

    def on_evict(self, node: CacheNode) -> None:
        """Called when a node leaves the GPU (KVFlow's parents inherit from children)."""

    def changed_by(self, changed: Changed) -> list[int]:
        """The nodes whose priority a new prediction changed (WorkflowLedger.set_predictions)."""
        return []

    def observe_call(self, workflow: str, agent: str, keys: Sequence = (), sizes: Sequence = (),
                     cached: int | None = None, gpu_cached: int | None = None) -> bool:
        """Called when a call arrives, with its prompt's content keys in prefix order and their
        token counts (workload.prefix_keys; the plugin's are token blocks), and the tokens of it the
        cache held (`cached`: GPU and host; `gpu_cached`: GPU; None where unknown); True when every
        node's priority changed at once (the caller's heaps must be rebuilt)."""
        return False

    def observe_insert(self, workflow: str, agent: str, keys: Sequence, sizes: Sequence) -> None:
        """Called when a call finished and its prompt and output are in the cache (content keys
        in prefix order, as observe_call's)."""

    def set_capacity(self, gpu_tokens: int, host_tier: bool | None = None) -> None:
        """The tokens the cache may hold now: its GPU tokens less what running requests hold outside
        it, told before each admitted call and each insert, and whether the server has a host tier
        (PBKV's outcome shadows follow both)."""

    def trust_report(self) -> dict | None:
        """What a trust judge decided and measured (PBKV), else None."""
        return None

    # What the baselines of baselines.py record besides the ledger (no-ops for the others).

    def on_cached(self, node: CacheNode | None, workflow: str, agent: str, finished: bool) -> None:
        """A call's path ends at `node`: when the call is matched (finished=False) and when its KV
        is cached (finished=True)."""

    def on_split(self, prefix: CacheNode, suffix: CacheNode) -> None:
        """A node split: `prefix` is the new parent of `suffix` (which keeps its id)."""

    def forget(self, node: CacheNode) -> None:
        """A node left the tree."""

    def forget_all(self) -> None:
        """The tree was reset (SGLang's flush_cache): no node it knew of is valid any more."""

    def on_steps(self, workflows: Sequence[str], steps: Sequence[dict[str, int]] | None) -> list[int]:
        """A batch of predictions (steps: each workflow's steps-to-execution, from a step graph); the
        nodes whose priority is to be computed again now."""
        return []

    def attach(self, gpu_tokens: int, prefill_s: Callable[[int, int], float]) -> None:
        """The server's GPU capacity and prefill time (new tokens, cached tokens) -> seconds."""

    def on_call_finished(self, workflow: str, agent: str, node_ids: Sequence[int], context_tokens: int,
                         more_calls: bool) -> list[int]:
        """A call finished (a tool call follows when more_calls); the nodes whose priority changed."""
        return []

    def on_queued(self, workflow: str, agent: str, node_ids: Sequence[int], t: float,
                  keys: Sequence = ()) -> list[int]:
        """A call of `agent` entered the admission queue at time t; `node_ids`: the cached path of its
        prompt, read without touching the tree; `keys`: its prompt's content keys (as observe_call's).
        The nodes whose priority changed."""
        return []

    def on_predictions(self, workflows: Sequence[str], agent_names: Sequence[str], probs, seconds,
                       now: float) -> list[int]:
        """A batch of predictions made at time `now`: probs [B, K, A+1] (END last), seconds [B, K] the
        median time until each of the K calls from now (None: the source gives no times). The nodes
        whose priority changed."""
        return []

    def on_time(self, now: float) -> list[int]:
        """Time moved to `now` (before an eviction); the nodes whose priority changed."""
        return []

    def prefetch_order(self, by_id: dict, idle_workflows) -> list[tuple]:
        """Under a policy-driven prefetch mode (Prefetch.policy_driven): (node off the GPU, tag) to
        load, in order."""
        return []

    def on_prefetched(self, path: list, tag) -> None:
        """A prefetch candidate's path was loaded (path[0] the topmost node)."""

    def on_prefetch_failed(self) -> None:
        """A candidate did not fit (with Prefetch.stops_at_failure: the round ends)."""


class LRU(EvictionPolicy):
    name = "lru"

    def priority(self, node):
        return (node.last_access_time,)


class LFU(EvictionPolicy):
    name = "lfu"

    def priority(self, node):
        return (node.hit_count, node.last_access_time)


class TLRU(EvictionPolicy):
    """SGLang's Tail-Optimised LRU (its TLRUStrategy, Zhang et al. arXiv:2510.15152): a branch of
    history length L (its deepest extent) whose next prompt adds Q tokens needs only its first
    L + Q - threshold tokens cached to meet the TTFT budget; nodes wholly past that are evicted
    first, then plain LRU. With threshold 0 it is LRU."""

    name = "tlru"

    def __init__(self, threshold: int = TlruConfig.threshold,
                 next_prompt_estimate: int = TlruConfig.next_prompt_estimate):
        self.threshold, self.next_prompt_estimate = threshold, next_prompt_estimate

    def priority(self, node):
        budget = max(node.max_depth_tokens + self.next_prompt_estimate - self.threshold, 0)
        tel_safe = node.depth_tokens - node.num_tokens >= budget
        return (-1 if tel_safe else 0, node.last_access_time)


class _LedgerPolicy(EvictionPolicy):
    served_by = "plugin"
    reads_ledger = True

    def __init__(self, ledger: WorkflowLedger):
        self.ledger = ledger


class LifecycleLRU(_LedgerPolicy):
    name = "pbkv_lae"

    def priority(self, node):
        return (0 if self.ledger.is_retired(node.id) else 1, node.last_access_time)


class _JudgedPolicy(_LedgerPolicy):
    """A prediction-driven order that a trust judge (cache/trust.py) may set aside for lifecycle-aware
    LRU: while it is not trusted, `priority` gives every live node the same value, so LRU decides."""

    TRUST = TRUST_MODES
    outcome_judge: ClassVar[type[OutcomeTrust]] = OutcomeTrust

    def __init__(self, ledger: WorkflowLedger, trust: dict):
        """`trust`: TrustConfig's fields (cache/config.py, their defaults and ranges), one mode."""
        super().__init__(ledger)
        options = build(trust, TrustConfig, "pbkv")
        if options.trust not in self.TRUST:
            raise ValueError(f"pbkv.trust must be one of {', '.join(self.TRUST)}; got '{options.trust}'")
        self.trust = options.trust
        self.judge = make_trust(options, ledger, self._values, self.outcome_judge)
        if hasattr(self.judge, "revise"):
            ledger.listeners.append(self.judge.revise)

    def _values(self, workflow: str):
        """A workflow's reader table as the outcome judge's shadows read it, None once it is retired."""
        raise NotImplementedError

    @property
    def trusted(self) -> bool:
        return self.judge is None or self.judge.trusted

    def observe_call(self, workflow, agent, keys=(), sizes=(), cached=None, gpu_cached=None):
        return self.judge is not None and self.judge.observe_call(workflow, agent, keys, sizes, cached, gpu_cached)

    def observe_insert(self, workflow, agent, keys, sizes):
        if self.judge is not None:
            self.judge.observe_insert(workflow, keys, sizes, agent)

    def set_capacity(self, gpu_tokens, host_tier=None):
        if hasattr(self.judge, "set_capacity"):
            self.judge.set_capacity(gpu_tokens, host_tier)

    def trust_report(self) -> dict | None:
        return self.judge.report() if self.judge is not None else None


class PBKV(_JudgedPolicy):
    name = "pbkv"
    uses_predictions = True

    def __init__(self, ledger: WorkflowLedger, **trust):
        """`trust`: TrustConfig's fields, one mode; the mode's judge decides when the score order is followed."""
        super().__init__(ledger, trust)

    def _values(self, workflow: str) -> dict | None:
        """v_w (agent -> value), the workflow's folded predictions that Score sums, or None once it
        is retired (the outcome shadows' order)."""
        return self.ledger.reuse_value.get(workflow, {}) if self.ledger.is_live(workflow) else None

    def changed_by(self, changed):
        return changed.scores if self.trusted else []  # untrusted: the order ignores the scores

    def priority(self, node):
        if self.ledger.is_retired(node.id):
            return (0, 0.0, node.last_access_time)
        # untrusted: the same tuple with every score equal, i.e. lifecycle-aware LRU
        return (1, self.ledger.score(node.id) if self.trusted else 0.0, node.last_access_time)


class PBKVTime(_JudgedPolicy):
    r"""pbkv_time: PBKV's lookahead score, each read discounted by when it is expected; a call
    already waiting in the server's admission queue counts as a certain read of its prompt's path.

    .. math::
        V(c) = \sum_{w \in W_{act}(c)} \Big( [c \in \pi_w] e^{-t_w^{q} / \tau}
               + \sum_{k=k_w}^{K} \gamma^{k-1} s_w^{(k)} \langle A_w(c), P_w^{(k)} \rangle
                 e^{-(t_w + T_w^{(k)}) / \tau} \Big)

    Nodes go lowest value first: retired cache first (as in PBKV), then live cache by ascending
    log V (LRU breaks ties, and orders the live nodes no term reaches). t_w is when w's latest
    prediction was made (the end of its latest call), T_w^(k) the predictor's median time until
    its k-th next call (0 from a source without times, and in traces without gaps); pi_w the
    cached path of w's queued call, t_w^q the time it entered the queue. Once w's next call has come
    (queued, running, or finished before the next prediction), the prediction's step 1 is that
    call, known: the sum starts at k_w = 2; otherwise at 1.

    Why: the eviction bound's headroom over LRU and PBKV lies mostly in reads of workflows queued
    for admission (docs/results/headroom.md), and with tool calls short against the queue (the
    real traces' calls follow each other at once) the workflows cycle through the FCFS queue:
    LRU then evicts first the context of the call admitted next, the cyclic pathology, and keeps a
    slice of every workflow. Belady keeps the front of the queue and gives up its back; so does
    this order, whose earlier reads weigh more (e^{-t/tau} is larger for smaller t): the context
    of the call that just finished and queued again at the back goes first, and a stable set of
    workflows stays whole. tau trades the time of a read against its probability: a very large tau
    is PBKV's score with the queued calls known; a small one orders by expected time alone. The
    exponential keeps the order fixed as time passes (every value scales by the same
    e^{\Delta/\tau}), so a node's priority changes only when its workflows' state does; it is
    kept as a logarithm (sums by log-sum-exp), which neither overflows nor underflows.

    Trust as PBKV's (cache/trust.py): under trust="outcome" (the default) two shadow caches, one in
    this order (TimeOutcomeTrust: the same values, the queued calls told to it too), one in
    lifecycle-aware LRU's, follow the calls, and the order falls back to lifecycle-aware LRU while
    that one's shadow has more GPU hits.

    Args:
        ledger: who used each node (the WorkflowLedger).
        time_tau_s: tau, seconds (PbkvConfig.time_tau_s).
        gamma: the step discount (PbkvConfig.gamma).
        trust: TrustConfig's fields, one mode (PbkvConfig.trust_options).
    """

    name = "pbkv_time"
    uses_predictions = True
    reads_queue = True
    reads_times = True
    outcome_judge = TimeOutcomeTrust

    def __init__(self, ledger: WorkflowLedger, time_tau_s: float = PbkvConfig.time_tau_s,
                 gamma: float = PbkvConfig.gamma, **trust):
        if not time_tau_s > 0:
            raise ValueError(f"pbkv.time_tau_s must be above 0; got {time_tau_s}")
        self.tau, self.gamma = time_tau_s, gamma
        self.values_key = ("pbkv_time.step_values", gamma, time_tau_s)  # names a table of `step_values`
        # workflow -> (log of the discount of its prediction's time, agent -> value from step 1 on,
        # agent -> value from step 2 on), the values relative to that discount
        self.predicted: dict[str, tuple[float, dict[str, float], dict[str, float]]] = {}
        self.busy: dict[str, None] = {}  # workflows whose predicted step 1 came: queued, running or done
        self.queued_on: dict[int, dict[str, float]] = {}  # node id -> queued workflow -> -t^q / tau
        self.queued_path: dict[str, list[int]] = {}  # queued (or running) workflow -> its path's node ids
        super().__init__(ledger, trust)
        self.outcome = self.judge if isinstance(self.judge, TimeOutcomeTrust) else None  # told each change

    def _log_discount(self, t: float) -> float:
        return -t / self.tau

    def step_values(self, probs, seconds) -> tuple[np.ndarray, np.ndarray]:
        """probs [B, K, A+1] (END last), seconds [B, K] or None -> each agent's value summed from step
        1 on and from step 2 on ([B, A] each): gamma^(k-1) s^(k) e^(-t_k / tau) P^(k)[a] summed over
        k. Row by row the same floats whatever else shares the batch (elementwise work and a sum over
        the K axis in order, as `fold`), so the simulator tables them before a replay
        (`values_key`, PrefixTable.lookup_derived) as it tables PBKV's folded predictions."""
        weight, probs = step_weights(probs, self.gamma)  # gamma^(k-1) s^(k), as PBKV's fold weighs each step
        if seconds is not None:
            weight = weight * np.exp(-np.clip(np.asarray(seconds, dtype=np.float64), 0.0, None) / self.tau)
        agents = probs[:, :, :-1] * weight[:, :, None]
        after_first = agents[:, 1:].sum(axis=1)
        return agents[:, 0] + after_first, after_first

    def on_predictions(self, workflows, agent_names, probs, seconds, now):
        return self.on_step_values(workflows, agent_names, *self.step_values(probs, seconds), now)

    def on_step_values(self, workflows, agent_names, total, later, now):
        """`on_predictions` from its `step_values`."""
        later, total = later.tolist(), total.tolist()
        offset, changed = self._log_discount(now), []
        for i, w in enumerate(workflows):
            if not self.ledger.is_live(w):
                continue
            self.predicted[w] = (offset, dict(zip(agent_names, total[i])), dict(zip(agent_names, later[i])))
            if w not in self.queued_path:  # made after its latest call finished, before the next one came
                self.busy.pop(w, None)
            changed.extend(self.ledger.nodes_of[w])
            if self.outcome is not None:
                self.outcome.revise(w)
        return changed

    def on_queued(self, workflow, agent, node_ids, t, keys=()):
        self._leave_queue(workflow)
        log_t = self._log_discount(t)
        for node_id in node_ids:
            self.queued_on.setdefault(node_id, {})[workflow] = log_t
        self.queued_path[workflow] = list(node_ids)
        self.busy[workflow] = None
        if self.outcome is not None:
            self.outcome.observe_queued(workflow, keys, log_t)
            self.outcome.revise(workflow)
        return [*self.ledger.nodes_of.get(workflow, ()), *node_ids]

    def _values(self, workflow: str) -> tuple | None:
        """The shadows' reader table: (log discount of the prediction's time, agent -> value from the
        step the sum starts at); None once the workflow is retired."""
        if not self.ledger.is_live(workflow):
            return None
        known = self.predicted.get(workflow)
        if known is None:
            return (0.0, {})
        offset, total, later = known
        return (offset, later if workflow in self.busy else total)

    def on_call_finished(self, workflow, agent, node_ids, context_tokens, more_calls):
        """The call leaves the queue's reads; its workflow stays busy (the latest prediction's step 1
        is the call that ran) until the next prediction."""
        self._leave_queue(workflow)
        if not more_calls:
            self.predicted.pop(workflow, None)
            self.busy.pop(workflow, None)
            if self.outcome is not None:
                self.outcome.revise(workflow)
        return list(self.ledger.nodes_of.get(workflow, ()))

    def _leave_queue(self, workflow: str) -> None:
        for node_id in self.queued_path.pop(workflow, ()):
            readers = self.queued_on.get(node_id)
            if readers is not None:
                readers.pop(workflow, None)
                if not readers:
                    del self.queued_on[node_id]

    def on_split(self, prefix, suffix):
        readers = self.queued_on.get(suffix.id)
        if readers:
            self.queued_on[prefix.id] = dict(readers)
            for w in readers:
                self.queued_path[w].append(prefix.id)

    def forget(self, node):
        self.queued_on.pop(node.id, None)

    def log_value(self, node_id: int) -> float:
        """log V(c) (-inf where no term reaches the node)."""
        users = self.ledger.users.get(node_id)
        terms = []  # the users' terms, after the queued calls' (log_sum_exp reads both in that order)
        predicted, busy = self.predicted, self.busy
        for w, agents in (users or {}).items():
            known = predicted.get(w)
            if known is None:
                continue
            offset, total, later = known
            table = later if w in busy else total
            part = agents_value(table, agents)
            if part > 0:
                terms.append(offset + math.log(part))
        return log_sum_exp(self.queued_on.get(node_id, {}).values(), terms)

    def priority(self, node):
        if self.ledger.is_retired(node.id):
            return (0, 0.0, node.last_access_time)
        # untrusted: every live node the same value, i.e. lifecycle-aware LRU
        return (1, self.log_value(node.id) if self.trusted else 0.0, node.last_access_time)


class KVFlow(_LedgerPolicy):
    """Idealised KVFlow (`kvflow_ideal`): larger steps-to-execution first (retired cache counts as
    never needed); a parent inherits the largest value of its evicted children; LRU breaks ties.
    Stronger than its public code in some ways and different in others (docs/baselines/kvflow.md;
    that code is `kvflow`, baselines.KVFlowFork)."""

    name = "kvflow_ideal"
    uses_predictions = True
    reads_step_graph = True

    def __init__(self, ledger: WorkflowLedger, hold_step: int = KvflowConfig.ideal_hold_step):
        super().__init__(ledger)
        self.hold_step = hold_step
        self._inherited: dict[int, float] = {}

    def changed_by(self, changed):
        return changed.steps

    def steps(self, node) -> float:
        return max(self.ledger.steps_to_execution(node.id, self.hold_step), self._inherited.get(node.id, 0))

    def priority(self, node):
        return (-self.steps(node), node.last_access_time)

    def on_evict(self, node):
        parent = getattr(node, "parent", None)
        if parent is not None:
            self._inherited[parent.id] = max(self._inherited.get(parent.id, 0), self.steps(node))
        self._inherited.pop(node.id, None)


class Oracle(_LedgerPolicy):
    """Clairvoyant (Belady): evict what is next used furthest in the future first. `next_use`
    gives the distance, in calls, to the next call that reads the node (inf: never); among nodes
    equally far, the PBKV score of the true future agents (the ledger is fed the perfect
    predictor) keeps the more widely needed, then LRU."""

    name = "oracle"
    served_by = "simulator"
    uses_predictions = True

    def __init__(self, ledger: WorkflowLedger, next_use: Callable[[CacheNode], float]):
        super().__init__(ledger)
        self.next_use = next_use

    def changed_by(self, changed):
        return changed.scores

    def priority(self, node):
        return (-self.next_use(node), self.ledger.score(node.id), node.last_access_time)


# One registry: every other list of policy names (the simulator's, evaluate's, the plugin's and the
# launcher's) derives from it. `served_by`: who runs the policy in a real server: "sglang" ships it,
# "plugin" is this project's SGLang plugin (eviction order and, for kvflow and lru_prefetch, their
# own prefetch: server/prefetch.py), "simulator": only the simulator (the oracle needs the real future).
POLICIES: dict[str, type[EvictionPolicy]] = {}
PLUGIN_POLICIES: tuple[str, ...] = ()
SGLANG_POLICIES: tuple[str, ...] = ()
STEP_GRAPH_POLICIES: tuple[str, ...] = ()  # the plugin's KVFlows (a step graph drives them: reads_step_graph)


def register(*classes: type[EvictionPolicy]) -> None:
    """Add policies to the one registry and derive the lists of who serves them. The baselines of
    baselines.py register themselves; importing the package (cache/__init__.py) imports them, so
    every `from serving_integration.cache.policies import ...` sees the whole registry."""
    global PLUGIN_POLICIES, SGLANG_POLICIES, STEP_GRAPH_POLICIES
    POLICIES.update((cls.name, cls) for cls in classes)
    PLUGIN_POLICIES = tuple(name for name, cls in POLICIES.items() if cls.served_by == "plugin")
    SGLANG_POLICIES = tuple(name for name, cls in POLICIES.items() if cls.served_by == "sglang")
    STEP_GRAPH_POLICIES = tuple(name for name in PLUGIN_POLICIES if POLICIES[name].reads_step_graph)


register(LRU, LFU, TLRU, KVFlow, LifecycleLRU, PBKV, PBKVTime, Oracle)


def make_policy(name: str, ledger: WorkflowLedger, next_use: Callable | None = None, **options) -> EvictionPolicy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy '{name}'; choose from {', '.join(POLICIES)}")
    if cls is Oracle:
        if next_use is None:
            raise ValueError("the oracle policy needs the real future (simulator only)")
        return Oracle(ledger, next_use)
    if issubclass(cls, _LedgerPolicy):
        return cls(ledger, **options)
    return cls(**options)


# -------------------------------------------------------------------- prefetch


class Prefetch:
    """Host-to-GPU prefetch of cache predicted to be read on the next call.

    none:         no prefetch.
    conservative: PBKV's. Loads only into free GPU space plus retired cache (never evicts cache
                  a live workflow used), only in decode-only iterations or idle time, within
                  min(that space, PCIe bandwidth x the iteration's time); candidates ranked by
                  the one-step (k = 1) score.
    aggressive:   the ablation (and KVFlow's way): may evict any unlocked cache, in eviction
                  order, to make room; same bandwidth budget and ranking.

    The policy's own order (POLICY_PREFETCH_MODES; baselines.py, evaluate.py runs each with its own): the
    candidates and their order come from `policy.prefetch_order`, in the same time and budget.
    kvflow:       KVFlow's: may evict, and stops at the first candidate that does not fit.
    last_call:    lru_prefetch's: the conservative mode's room (free space and retired cache).
    """

    MODES = PREFETCH_MODES + POLICY_PREFETCH_MODES

    def __init__(self, mode: str, ledger: WorkflowLedger):
        if mode not in self.MODES:
            raise ValueError(f"prefetch must be one of {', '.join(self.MODES)}; got '{mode}'")
        self.mode, self.ledger = mode, ledger

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def uses_predictions(self) -> bool:
        """Ranked by the predictions (kvflow's order reads its step graph through the policy)."""
        return self.mode in ("conservative", "aggressive")

    @property
    def policy_driven(self) -> bool:
        return self.mode in POLICY_PREFETCH_MODES

    @property
    def stops_at_failure(self) -> bool:
        return self.mode == "kvflow"

    @property
    def evicts_live(self) -> bool:
        """It may evict cache that live workflows use (aggressive, KVFlow's), not only retired cache."""
        return self.mode in ("aggressive", "kvflow")

    def may_evict(self, node: CacheNode) -> bool:
        return self.evicts_live or self.ledger.is_retired(node.id)

    def rank(self, candidates: list) -> list:
        """Candidates (nodes) with a positive one-step score, best first; ties by node id."""
        scored = [(self.ledger.next_step_score(n.id), n) for n in candidates]
        scored = [(s, n) for s, n in scored if s > 0]
        scored.sort(key=lambda item: (-item[0], item[1].id))
        return [n for _, n in scored]
