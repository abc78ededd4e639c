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
    kvflow     larger steps-to-execution first, from the agent step graph (KVFlow)
    pbkv_lae   lifecycle-aware: retired cache first, then LRU
    pbkv       retired first; then active by ascending lookahead reuse score; LRU breaks ties.
               trust="outcome" (default) orders as pbkv_lae while that order wins on shadow
               caches (cache/trust.py); "accuracy" while the predictions prove poor;
               "always" is the paper's policy
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
trust="outcome" the evidence is the GPU hits each order would have had on shadow caches over a
sample of the workflows; under "accuracy", the probability the workflow's last prediction gave
the agent that came next. Either switches, with hysteresis, between the prediction score and
lifecycle-aware LRU. A switch changes every node's priority at once, so the simulator's tree
re-heapifies its evictable nodes (O(n), only at a switch; between switches an eviction stays
O(log n)); SGLang builds its heap anew on every eviction pass, so the plugin needs nothing more.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from data.knobs import build
from models.base import survival
from serving_integration.cache.config import PREFETCH_MODES, TRUST_MODES, KvflowConfig, PbkvConfig, TlruConfig, \
    TrustConfig
from serving_integration.cache.trust import TrustMeter, make_trust  # noqa: F401  (TrustMeter: re-exported)

INF = math.inf


class CacheNode(Protocol):
    id: int
    last_access_time: float
    hit_count: int


class WorkflowLedger:
    """Which live workflows, and which of their agents, used each cache node; their predictions.

    Ordered dicts stand in for sets throughout, so iteration order (and with it every tie) is
    the same in every run."""

    def __init__(self, gamma: float = PbkvConfig.gamma):
        self.gamma = gamma
        self.users: dict[int, dict[str, dict[str, None]]] = {}  # node id -> workflow -> agents
        self.nodes_of: dict[str, dict[int, None]] = {}  # workflow -> node ids it used
        self.reuse_value: dict[str, dict[str, float]] = {}  # workflow -> agent -> v_w[agent]
        self.next_value: dict[str, dict[str, float]] = {}  # workflow -> agent -> s^(1) P^(1)[agent]
        self.steps_to: dict[str, dict[str, int]] = {}  # workflow -> agent -> first k it is the argmax
        self.unchecked: dict[str, None] = {}  # workflows whose latest prediction no call has tested yet

    # ---------------------------------------------------------------- lifecycle

    def start(self, workflow: str) -> None:
        self.nodes_of.setdefault(workflow, {})

    def is_live(self, workflow: str) -> bool:
        return workflow in self.nodes_of

    def record_access(self, node_id: int, workflow: str, agent: str) -> None:
        if workflow not in self.nodes_of:  # unknown or already ended: the node stays unowned
            return
        self.users.setdefault(node_id, {}).setdefault(workflow, {})[agent] = None
        self.nodes_of[workflow][node_id] = None

    def end(self, workflow: str) -> list[int]:
        """Retire a workflow; returns the nodes it used (their priorities changed)."""
        nodes = list(self.nodes_of.pop(workflow, {}))
        for node_id in nodes:
            owners = self.users.get(node_id)
            if owners is not None:
                owners.pop(workflow, None)
                if not owners:
                    del self.users[node_id]
        for table in (self.reuse_value, self.next_value, self.steps_to, self.unchecked):
            table.pop(workflow, None)
        return nodes

    def split(self, prefix_id: int, suffix_id: int) -> None:
        """A node split: the new prefix node was used by everyone who used the old node."""
        owners = self.users.get(suffix_id)
        if not owners:
            return
        self.users[prefix_id] = {w: dict(agents) for w, agents in owners.items()}
        for w in owners:
            self.nodes_of[w][prefix_id] = None

    def forget(self, node_id: int) -> None:
        for w in self.users.pop(node_id, {}):
            self.nodes_of[w].pop(node_id, None)

    # ---------------------------------------------------------------- predictions

    def set_predictions(self, workflows: Sequence[str], agent_names: Sequence[str], probs: torch.Tensor,
                        steps: Sequence[dict[str, int]] | None = None) -> None:
        """probs: [B, K, A+1] for B workflows, END last (a predictor's output). `steps`: each
        workflow's steps-to-execution per agent, from an agent step graph (KVFlow); without it,
        the first k at which the agent is the likeliest and more likely than END."""
        probs = probs.detach().to(torch.float64).cpu()
        alive = survival(probs).numpy()  # [B, K]
        probs = probs.numpy()
        discount = self.gamma ** np.arange(probs.shape[1])
        agents = probs[..., :-1]
        value = (discount[None, :, None] * alive[..., None] * agents).sum(axis=1)  # [B, A]
        likeliest = agents.argmax(axis=-1)  # [B, K]
        beats_end = agents.max(axis=-1) > probs[..., -1]
        for i, w in enumerate(workflows):
            if w not in self.nodes_of:
                continue
            self.reuse_value[w] = dict(zip(agent_names, value[i].tolist()))
            self.next_value[w] = dict(zip(agent_names, agents[i, 0].tolist()))  # s^(1) = 1
            first: dict[str, int] = {}
            for k, (a, alive_k) in enumerate(zip(likeliest[i].tolist(), beats_end[i].tolist()), start=1):
                if alive_k:
                    first.setdefault(agent_names[a], k)
            self.steps_to[w] = first
            self.unchecked[w] = None
        if steps is not None:
            for w, given in zip(workflows, steps):
                if w in self.nodes_of:
                    self.steps_to[w] = dict(given)

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
                total += sum(values.get(a, 0.0) for a in agents)
        return total

    def score(self, node_id: int) -> float:
        return self._weighted(node_id, self.reuse_value)

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


class EvictionPolicy:
    name = "base"
    served_by = "sglang"
    uses_predictions = False

    def priority(self, node: CacheNode) -> tuple:
        raise NotImplementedError

    def on_evict(self, node: CacheNode) -> None:
        """Called when a node leaves the GPU (KVFlow's parents inherit from children)."""

    def observe_call(self, workflow: str, agent: str, keys: Sequence = (), sizes: Sequence = ()) -> bool:
        """Called when a call arrives, with its prompt's content keys in prefix order and their
        token counts (workload.prefix_keys; the plugin's are token blocks); True when every node's
        priority changed at once (the caller's heaps must be rebuilt)."""
        return False

    def observe_insert(self, workflow: str, agent: str, keys: Sequence, sizes: Sequence) -> None:
        """Called when a call finished and its prompt and output are in the cache (content keys
        in prefix order, as observe_call's)."""

    def set_capacity(self, gpu_tokens: int) -> None:
        """The GPU tokens of the cache the policy orders (PBKV's outcome shadows scale it)."""

    def trust_report(self) -> dict | None:
        """What a trust judge decided and measured (PBKV), else None."""
        return None


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

    def __init__(self, ledger: WorkflowLedger):
        self.ledger = ledger


class LifecycleLRU(_LedgerPolicy):
    name = "pbkv_lae"

    def priority(self, node):
        return (0 if self.ledger.is_retired(node.id) else 1, node.last_access_time)


class PBKV(_LedgerPolicy):
    name = "pbkv"
    uses_predictions = True
    TRUST = TRUST_MODES

    def __init__(self, ledger: WorkflowLedger, **trust):
        """`trust`: TrustConfig's fields (cache/config.py, their defaults and ranges), one mode;
        the mode's judge (cache/trust.py) decides when the score order is followed."""
        super().__init__(ledger)
        options = build(trust, TrustConfig, "pbkv")
        if options.trust not in self.TRUST:
            raise ValueError(f"pbkv.trust must be one of {', '.join(self.TRUST)}; got '{options.trust}'")
        self.trust = options.trust
        self.judge = make_trust(options, ledger, self._values)

    def _values(self, workflow: str) -> dict | None:
        """v_w (agent -> value), the workflow's folded predictions that Score sums, or None once it
        is retired (the outcome shadows' order)."""
        return self.ledger.reuse_value.get(workflow, {}) if self.ledger.is_live(workflow) else None

    @property
    def trusted(self) -> bool:
        return self.judge is None or self.judge.trusted

    def observe_call(self, workflow, agent, keys=(), sizes=()):
        return self.judge is not None and self.judge.observe_call(workflow, agent, keys, sizes)

    def observe_insert(self, workflow, agent, keys, sizes):
        if self.judge is not None:
            self.judge.observe_insert(workflow, keys, sizes, agent)

    def set_capacity(self, gpu_tokens):
        if hasattr(self.judge, "set_capacity"):
            self.judge.set_capacity(gpu_tokens)

    def trust_report(self) -> dict | None:
        return self.judge.report() if self.judge is not None else None

    def priority(self, node):
        if self.ledger.is_retired(node.id):
            return (0, 0.0, node.last_access_time)
        # untrusted: the same tuple with every score equal, i.e. lifecycle-aware LRU
        return (1, self.ledger.score(node.id) if self.trusted else 0.0, node.last_access_time)


class KVFlow(_LedgerPolicy):
    """Larger steps-to-execution first (retired cache counts as never needed); a parent inherits
    the largest value of its evicted children; LRU breaks ties."""

    name = "kvflow"
    uses_predictions = True

    def __init__(self, ledger: WorkflowLedger, hold_step: int = KvflowConfig.hold_step):
        super().__init__(ledger)
        self.hold_step = hold_step
        self._inherited: dict[int, float] = {}

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

    def priority(self, node):
        return (-self.next_use(node), self.ledger.score(node.id), node.last_access_time)


# One registry: every other list of policy names (the simulator's, evaluate's, the plugin's and the
# launcher's) derives from it. `served_by`: who runs the policy in a real server: "sglang" ships it,
# "plugin" is this project's SGLang plugin, "simulator" needs the real future (clairvoyant).
POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRU, LFU, TLRU, KVFlow, LifecycleLRU, PBKV, Oracle)}
PLUGIN_POLICIES = tuple(name for name, cls in POLICIES.items() if cls.served_by == "plugin")
SGLANG_POLICIES = tuple(name for name, cls in POLICIES.items() if cls.served_by == "sglang")


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
    """

    MODES = PREFETCH_MODES

    def __init__(self, mode: str, ledger: WorkflowLedger):
        if mode not in self.MODES:
            raise ValueError(f"prefetch must be one of {', '.join(self.MODES)}; got '{mode}'")
        self.mode, self.ledger = mode, ledger

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def may_evict(self, node: CacheNode) -> bool:
        return self.mode == "aggressive" or self.ledger.is_retired(node.id)

    def rank(self, candidates: list) -> list:
        """Candidates (nodes) with a positive one-step score, best first; ties by node id."""
        scored = [(self.ledger.next_step_score(n.id), n) for n in candidates]
        scored = [(s, n) for s, n in scored if s > 0]
        scored.sort(key=lambda item: (-item[0], item[1].id))
        return [n for _, n in scored]
