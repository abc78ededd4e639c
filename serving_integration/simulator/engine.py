"""A discrete-event model of an SGLang server with HiCache (or replicas behind a router), replaying
agent workflows.

Per request (one agent call): match the prompt in the two-tier radix tree; GPU-hit tokens are
free, host-hit tokens are loaded over PCIe, missed tokens are prefilled; the matched path is
locked while the request runs; prompt + output are inserted when it finishes (SGLang inserts
both). Scheduling follows SGLang's defaults: FCFS admission while KV memory allows (the prompt's
missed tokens and the output are reserved up front; a call that would not fit even once every
unlocked node is evicted evicts nothing and waits), prefill iterations of at most
`max_prefill_tokens` (chunked prefill) take priority over decode iterations, decode runs the
whole running batch one token per iteration (`sim.scheduling=program_fcfs`: admission by the
workflow's start instead, Continuum's program-level FCFS; `lpm`, `hrrn` and `spf`: SGLang's
cache-aware orders). Between events, identical decode iterations are
advanced together. Closed loop: `concurrency` workflows are live; each issues its next call when
the previous one finishes plus that call's tool time; a new workflow starts when one ends.

Two classes split the work. `Simulator` is the one driver: the closed-loop client (which
workflows are live, when each issues its next call, when the cache retires it), the router and
the event loop, which always handles the earliest event: a retirement, a call arriving at the
server the router picks, or one step of the busy server whose clock is earliest. `Server` is one
replica (radix tree, policy, scheduler queues, clock, counters) and passive: it is handed a call,
or a step to run with the time of the next event anywhere (where a run of decode iterations
stops) and the ids of the workflows idle everywhere (what prefetch may load for), and returns the
calls that completed; the Simulator then has it insert each one and apply the step's batch of
predictions. A server never calls back into the Simulator.

The predictor is called after every finished call, batched over the workflows whose call
finished in the same iteration; its cost can be charged to the timeline. Conservative or
aggressive prefetch runs in decode-only iterations and idle time, with the PCIe bandwidth of
that time as its budget. Everything is deterministic for a given input and seed.

The end of a workflow reaches the cache as a real client sends it: after its last call, once the
client has decided to stop (`end_signal_delay_s` later; 0: with the last call). A share
`end_signal_loss` of the end signals (drawn per workflow with `seed`) never arrives; the cache
then retires a workflow after `inactivity_timeout_s` without calls, as the plugin does (a live
workflow silent that long is retired too, and starts afresh with its next call). Until it is
retired, a finished workflow is predicted, scored and prefetched for like any other.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import cython
import numpy as np

from serving_integration.simulator.cost_model import CostModel
from serving_integration.cache.metrics import eviction_overshoot, per_workflow_results, replay_metrics
from serving_integration.cache.config import PbkvConfig
from serving_integration.cache.policies import INF, Prefetch, WorkflowLedger, make_policy
from serving_integration.cache.predictions import PredictionSource, predict_times, tabulate, tell_finished
from serving_integration.cache.trust import trust_summary
from serving_integration.cache.workload import SimCall, SimWorkflow, chain, prefix_tokens_in
from serving_integration.simulator.headroom import headroom_fields
from serving_integration.simulator.bound import prefetch_budgets, row_bounds, sequence_from_trace, upper_bounds
from serving_integration.simulator.config import SimConfig
from serving_integration.simulator.radix import Node, RadixTree
from serving_integration.cache.router import make_router

# SGLang's cache-aware schedule policies' constants (lpm, hrrn, spf; managers/schedule_policy.py, 0.5.23)
LPM_QUEUE_MAX = 128  # WAITING_QUEUE_PREFIX_MATCH_MAX: above it lpm and hrrn neither match nor sort (spf does)
LPM_IN_BATCH_TOKENS = 32  # IN_BATCH_PREFIX_CACHING_{CHECK,DEPRIORITIZE}_THRESHOLD
CACHE_AWARE = ("lpm", "hrrn", "spf")  # the sim.scheduling orders that match the waiting calls

log = logging.getLogger(__name__)

# A replay allocates millions of small objects and frees nearly all of them by reference counting
# (a 10,000-workflow pbkv replay leaves a few hundred objects in cycles), yet CPython's cyclic
# collector, run every 700 net allocations, scans them, and now and then every object of the
# process (about a second each at 100,000 workflows, where the loaded workload alone is millions of
# objects). A replay runs with the first generation's threshold raised to this (collections still
# run, about 140 times fewer), and with every object that existed before it frozen (gc.freeze: the
# collector leaves them out until the replay ends, so a full collection scans only what the replay
# made). The same objects are kept and freed, so the results are the same (docs/simulator.md: what
# each saved).
REPLAY_GC_THRESHOLD = 100_000
_collecting_less = 0  # fewer_collections blocks entered and not left: only the outermost acts


@contextmanager
def fewer_collections():
    """While the block runs: the cyclic collector's first-generation threshold raised to
    REPLAY_GC_THRESHOLD (never lowered) and the objects that existed before frozen; both undone
    after. Blocks nest (simulate() holds one around the construction, the replay and its bounds;
    Simulator.run another): only the outermost changes anything."""
    global _collecting_less
    if _collecting_less:
        _collecting_less += 1
        try:
            yield
        finally:
            _collecting_less -= 1
        return
    before = gc.get_threshold()
    gc.set_threshold(max(REPLAY_GC_THRESHOLD, before[0]), *before[1:])
    gc.freeze()
    _collecting_less = 1
    try:
        yield
    finally:
        _collecting_less = 0
        gc.unfreeze()
        gc.set_threshold(*before)


@cython.locals(n=Node, on_gpu=cython.Py_ssize_t, matched=cython.Py_ssize_t)
def matched_units_of(path: list[Node]) -> tuple[int, int]:
    """Prompt units a matched path covers on the GPU and in all (GPU nodes come first on a path)."""
    on_gpu = matched = 0
    for n in path:
        matched += len(n.units)
        if n.on_gpu:
            on_gpu += len(n.units)
    return on_gpu, matched


@cython.locals(i=cython.Py_ssize_t, total=cython.Py_ssize_t)
def tokens_between(lens: Sequence[int], start: int, stop: int) -> int:
    """sum(lens[start:stop]) without the slice: the tokens of a prompt's units start..stop-1."""
    total = 0
    for i in range(start, min(stop, len(lens))):
        total += lens[i]
    return total


@dataclass(eq=False)
class Request:
    wf: SimWorkflow
    call: SimCall
    arrival: float
    last_node: Node | None = None
    gpu_hit: int = 0
    host_hit: int = 0
    miss: int = 0
    private: int = 0  # KV tokens the request holds outside the tree (missed prompt + output)
    host_load: int = 0  # host tokens still to be charged to PCIe time
    prefill_left: int = 0
    context: int = 0
    decode_left: int = 0
    ttft: float = math.nan
    scheduled: float = 0.0  # when the call was issued (previous call's finish + tool time)
    admitted: float = math.nan
    finished: float = math.nan
    gpu_units: int = 0  # prompt units matched on the GPU at admission (hits before page rounding)
    clocks: tuple = ()  # the simulator's time-split clocks at admission
    queued_at_prefilled: int = 0  # the server's prefilled tokens when the call joined its queue (hrrn)
    server: "Server | None" = None


class FutureIndex:
    """The real future, for the clairvoyant policy: distance in calls to the next call that
    reads a node. A live workflow's k-th next call is k away; a workflow still queued at
    position q is taken to start after (q // concurrency + 1) average workflows (an
    approximation: the real start time depends on the policy being evaluated)."""

    def __init__(self, workflows: list[SimWorkflow], concurrency: int):
        self.workflows, self.concurrency = workflows, concurrency
        self.mean_calls = float(np.mean([len(w.calls) for w in workflows]))
        entries: dict[int, list] = {}
        for w in workflows:
            for j, call in enumerate(w.calls):
                for key in dict.fromkeys(call.keys):
                    entries.setdefault(key, []).append((w.order, j))
        self.entries = entries
        self.first_live = 0
        self.next_start = 0

    def next_use(self, node: Node) -> float:
        entries = self.entries.get(node.key_id)
        if not entries:
            return INF
        best = INF
        for order, j in entries[bisect_left(entries, (self.first_live, -1)):]:
            if order >= self.next_start:
                queued = (order - self.next_start) // self.concurrency + 1
                return min(best, queued * self.mean_calls + j + 1)
            w = self.workflows[order]
            if j >= w.next_call:
                best = min(best, j - w.next_call + 1)
        return best

    def keys_touched(self, w: SimWorkflow) -> dict:
        """Keys whose distance changed when w's last call finished: its calls from that one on."""
        return dict.fromkeys(k for call in w.calls[max(w.next_call - 1, 0):] for k in call.keys)


@dataclass
class Counters:
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    miss_tokens: int = 0
    recomputed_tokens: int = 0  # missed tokens whose prefix had been cached before
    kv_tokens_read: int = 0  # KV rows read by decode steps: prompt tokens x output tokens, per call
    # GPU tokens admissions asked evictions to free, and the tokens the evicted nodes held:
    # whole-node eviction frees a victim whole, so it can free far more than was asked
    eviction_requested_tokens: int = 0
    evicted_gpu_tokens: int = 0
    prefetched_tokens: int = 0
    prefetch_used_tokens: int = 0
    predictor_calls: int = 0
    predictor_time_s: float = 0.0
    ttfts: list = field(default_factory=list)
    latencies: list = field(default_factory=list)
    latency_workflows: list = field(default_factory=list)  # the workflow id of each of `latencies`
    # summed over calls: tool time, admission wait, and the time spent in prefill compute, decode,
    # PCIe loads and charged predictor time while the call ran (each call's latency is the sum)
    time_tool_s: float = 0.0
    time_queue_s: float = 0.0
    time_prefill_s: float = 0.0
    time_decode_s: float = 0.0
    time_pcie_s: float = 0.0
    time_predictor_s: float = 0.0
    ended_by_signal: int = 0
    ended_by_timeout: int = 0  # finished workflows whose end signal was lost
    live_timeouts: int = 0  # live workflows retired by the timeout during a long tool call


class Server:
    """One simulated SGLang server (a replica): its two-tier radix tree, eviction policy, workflow
    ledger, scheduler queues, clock and counters.

    Passive: the Simulator hands it events and reads its state; it never calls back (it holds
    no reference to the Simulator). `receive` queues a call, `step` runs one scheduler step and
    returns the requests it completed, `finish` inserts one of them into the cache, `predict`
    applies a batch of predictions, `idle_until` moves an idle server's clock, `start_workflow`
    and `retire_workflow` tell the cache a workflow's life began or ended. What it needs from
    outside comes as arguments: the time of the next event anywhere (where a run of decode
    iterations must stop) and the workflows idle everywhere (what prefetch may load for)."""

    def __init__(self, config: SimConfig, cost: CostModel, gpu_tokens: int, policy: str, policy_options: dict | None,
                 prefetch: str, gamma: float, next_use=None, record_decisions: bool = False):
        """`next_use`: the clairvoyant policy's view of the real future (FutureIndex.next_use)."""
        self.config, self.cost = config, cost
        self.ledger = WorkflowLedger(gamma)
        self.policy = make_policy(policy, self.ledger, next_use=next_use, **(policy_options or {}))
        self.policy.attach(gpu_tokens, cost.prefill_s)
        self.policy.set_capacity(gpu_tokens, host_tier=self.config.hicache_ratio > 0)
        self.prefetch = Prefetch(prefetch, self.ledger)
        self.tree = RadixTree(gpu_tokens, int(self.config.hicache_ratio * gpu_tokens),
                              priority=self.policy.priority, on_delete=self._on_delete,
                              on_split=self._on_split, on_evict=self._on_evict,
                              partial_eviction=self.config.partial_eviction)
        self.now = 0.0
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        # the running decode batch, in the order its requests entered it; beside it, kept as each
        # iteration advances them all one token: the batch's summed context, and a heap of the
        # decode step at which each request ends (so a step reads no request it does not finish)
        self.decoding: dict[Request, None] = {}
        self._decode_context = 0
        self._decoded = 0  # decode iterations run so far
        self._decode_ends: list = []  # heap of (value of _decoded at which it ends, entry seq, request)
        self._decode_seq = itertools.count()
        self.running: dict[str, Request] = {}  # workflow id -> its admitted request (prefilling or decoding)
        self.ever_cached: set[int] = set()
        self.prefetched: dict[int, int] = {}  # node id -> prefetched tokens not yet read
        # who used each node is recorded only where something reads it: a ledger policy, prefetch,
        # or a router that scores replicas by it (the Simulator sets this for such a router)
        self.tracks_workflows = self.policy.reads_ledger or self.prefetch.enabled
        self.counters = Counters()
        self.calls = 0  # calls routed here
        self.prefilled_tokens = 0  # prompt tokens prefilled so far (SGLang's processed_tokens_counter, hrrn)
        # the realized request sequence, for the offline bound (simulator/bound.py): each admitted
        # request is appended when admitted and again when it finishes
        self.trace: list[Request] = []
        # cumulative seconds of prefill compute, decode, PCIe loads and charged predictor time
        self.clocks = [0.0, 0.0, 0.0, 0.0]
        # with record_decisions: (time, kind, node key, tokens) of every eviction and prefetch load
        self.decisions: list | None = [] if record_decisions else None

    @property
    def load(self) -> int:
        """Requests in flight here (queued or running): what sglang-router counts as a worker's load."""
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    # ------------------------------------------------------------------ tree callbacks

    def _on_delete(self, node: Node) -> None:
        self.ledger.forget(node.id)
        self.policy.forget(node)
        self.prefetched.pop(node.id, None)

    def _on_split(self, prefix: Node, suffix: Node) -> None:
        self.ledger.split(prefix.id, suffix.id)
        self.policy.on_split(prefix, suffix)
        if suffix.id in self.prefetched:
            self.prefetched[prefix.id] = prefix.num_tokens
            self.prefetched[suffix.id] = suffix.num_tokens

    def _on_evict(self, node: Node) -> None:
        if self.decisions is not None:
            self.decisions.append((self.now, "evict", node.key_id, node.num_tokens))
        self.prefetched.pop(node.id, None)
        self.policy.on_evict(node)

    # ------------------------------------------------------------------ workflows

    def start_workflow(self, wf_id: str) -> None:
        """The cache hears of a workflow: its first call, or its first since the cache retired it."""
        self.ledger.start(wf_id)

    def retire_workflow(self, wf_id: str) -> None:
        """The cache retires a workflow (end signal or inactivity timeout): its nodes' priorities change."""
        self.tree.refresh_ids(self.ledger.end(wf_id))

    def refresh_keys(self, keys) -> None:
        """The real future of these prompt keys changed (the clairvoyant policy's distances)."""
        by_key = self.tree.by_key
        self.tree.refresh_many(by_key[k] for k in keys if k in by_key)

    # ------------------------------------------------------------------ one scheduler step

    def idle_until(self, t: float, idle_workflows: Iterable[str]) -> None:
        """Nothing runs here before t: the clock moves to t, prefetching through the idle time."""
        if t > self.now:
            self._prefetch(t - self.now, idle_workflows)
            self.now = t

    @cython.locals(wf=SimWorkflow, request=Request)
    def receive(self, t: float, wf: SimWorkflow, idle_workflows: Iterable[str], issued: float | None = None) -> None:
        """wf's next call, issued at `issued` (default: t), arrives at t; an idle server prefetches
        through the idle time first. Its queue time runs from its issue."""
        self.idle_until(t, idle_workflows)
        request = Request(wf, wf.calls[wf.next_call], self.now, scheduled=t if issued is None else issued, server=self,
                          queued_at_prefilled=self.prefilled_tokens)
        if self.config.scheduling == "program_fcfs":  # Continuum's: the earliest-started program first
            at = len(self.waiting)
            while at > 0 and self.waiting[at - 1].wf.start_time > wf.start_time:
                at -= 1
            self.waiting.insert(at, request)
        else:
            self.waiting.append(request)
        self.calls += 1
        if self.policy.reads_queue:  # pbkv_time: the queued call's cached path, read without touching it
            path, _, _ = self.tree.peek_path(request.call.units)
            self.tree.refresh_ids(self.policy.on_queued(wf.id, request.call.agent, [n.id for n in path], t,
                                                        request.call.keys))

    def step(self, next_event: float, idle_workflows: Iterable[str]) -> list[Request]:
        """Admit what fits, then run one prefill iteration, or a run of identical decode iterations
        that stops at the first iteration ending at or after `next_event` (the next arrival or
        retirement anywhere; INF: none). Returns the requests that completed, in order; the caller
        hands each to `finish`. `idle_workflows`: the workflows prefetch may load for (`_prefetch`)."""
        self._admit()
        if self.prefilling:
            return self._prefill_iteration()
        if self.decoding:
            return self._decode_iterations(next_event, idle_workflows)
        need = self.waiting[0].call.prompt_tokens + self.waiting[0].call.output_tokens
        raise ValueError(f"a call of workflow {self.waiting[0].wf.id} needs {need} KV tokens, more than "
                         f"one server's share of sim.gpu_tokens={self.config.gpu_tokens} "
                         f"(replicas={self.config.replicas}) can hold; raise sim.gpu_tokens")

    # ------------------------------------------------------------------ admission

    @cython.locals(request=Request)
    def _admit(self) -> None:
        if self.config.scheduling in CACHE_AWARE and self.waiting and \
                len(self.prefilling) + len(self.decoding) < self.config.max_running_requests:
            self._cache_aware_order()
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.config.max_running_requests:
            if not self.try_admit(self.waiting[0]):
                return
            request = self.waiting.popleft()
            request.admitted, request.clocks = self.now, tuple(self.clocks)
            self.trace.append(request)
            self.prefilling.append(request)
            self.running[request.wf.id] = request

    def _cache_aware_order(self) -> None:
        """SGLang's cache-aware schedule policies (0.5.23, managers/schedule_policy.py), run where
        SGLang runs them, before each admission pass: every waiting call is matched in the tree
        (which marks its path accessed, as SGLang's match does) and the queue is sorted, stably.
        lpm: by the cached prefix (GPU + host tokens), longest first. hrrn (highest response ratio
        next, aged in tokens): by the prompt tokens the server prefilled while the call waited per
        token it must prefill itself, highest first (SGLang breaks ties by request id, a random
        uuid; here by queue order). In-batch prefix caching, in both: a call with at most
        LPM_IN_BATCH_TOKENS of its prompt on GPU that shares at least that many tokens with a
        waiting call before it (in the queue's current order) goes last, so that one of them
        prefills the shared prefix for the others. Above LPM_QUEUE_MAX waiting calls SGLang skips
        the matching and the queue keeps its order. spf (shortest prefill first, SGLang's
        `shortest-prefill-first`): by the tokens the call must prefill (its prompt less the cached
        prefix), fewest first, then by arrival; it always matches and sorts (and caps a chunked
        prefill for shorter ones: `_spf_chunk_limit`)."""
        waiting, tree, order = self.waiting, self.tree, self.config.scheduling
        if len(waiting) > LPM_QUEUE_MAX and order != "spf":
            return
        in_batch: set[int] = set()  # prefix keys of the waiting prompts SGLang's in-batch tree holds
        ranks = []
        for r in waiting:
            call = r.call
            on_gpu_units, matched_units = matched_units_of(tree.match(call.units, call.lens))
            # SGLang's cap: the last prompt token is always prefilled
            matched = min(tokens_between(call.lens, 0, matched_units), call.prompt_tokens - 1)
            deprioritized = False
            if tokens_between(call.lens, 0, on_gpu_units) <= LPM_IN_BATCH_TOKENS:
                deprioritized = prefix_tokens_in(call.keys, call.lens, in_batch) >= LPM_IN_BATCH_TOKENS
                if not deprioritized:
                    in_batch.update(call.keys)
            if order == "spf":
                ranks.append((deprioritized, call.prompt_tokens - matched, r.arrival))
            elif deprioritized:
                ranks.append(INF)
            elif order == "hrrn":
                ranks.append(-(self.prefilled_tokens - r.queued_at_prefilled) / (call.prompt_tokens - matched))
            else:
                ranks.append(-matched)
        order = sorted(range(len(waiting)), key=ranks.__getitem__)
        self.waiting = deque(waiting[i] for i in order)

    @cython.locals(r=Request, call=SimCall, node=Node, prompt_tokens=cython.Py_ssize_t)
    def try_admit(self, r: Request) -> bool:
        call, tree = r.call, self.tree
        tree.refresh_ids(self.policy.on_time(self.now))  # continuum: expired pins
        path = tree.match(call.units, call.lens)
        self.policy.on_cached(path[-1] if path else None, r.wf.id, call.agent, False)
        # hits are counted in the request's own token counts (a pruned request may need fewer
        # tokens of a unit than the cache holds); memory moves in the cache's counts
        on_gpu, matched = matched_units_of(path)
        gpu_hit, host_hit = tokens_between(call.lens, 0, on_gpu), tokens_between(call.lens, on_gpu, matched)
        prompt_tokens = call.prompt_tokens
        miss = prompt_tokens - gpu_hit - host_hit
        need = miss + call.output_tokens
        for node in path:
            if not node.on_gpu:
                need += node.num_tokens
        if path:
            tree.lock(path[-1])  # before evicting, so the request's own prefix stays
        if tree.gpu_free() + tree.gpu_evictable_tokens() < need:
            # SGLang's PrefillAdder checks free + evictable tokens first and evicts only for a
            # request it admits: one that cannot fit leaves the cache as it was
            if path:
                tree.unlock(path[-1])
            return False
        if tree.gpu_free() < need:
            self._evict(need - tree.gpu_free())
        tree.load_back(path)
        r.private = miss + call.output_tokens
        tree.private_gpu += r.private
        self.policy.set_capacity(tree.gpu_capacity - tree.private_gpu)  # what the cache may hold while this runs
        if self.policy.observe_call(r.wf.id, call.agent, call.keys, call.lens, gpu_hit + host_hit, gpu_hit):  # flipped
            tree.reprioritize()
        if self.tracks_workflows:
            self.ledger.record_path([node.id for node in path], r.wf.id, call.agent)
        prefetched = self.prefetched
        if prefetched:
            for node in path:
                if node.id in prefetched:  # prefetched, and read before it was evicted
                    self.counters.prefetch_used_tokens += prefetched.pop(node.id)
        r.last_node = path[-1] if path else None
        page = self.config.page_size
        r.gpu_hit = gpu_hit // page * page  # only whole pages are reused
        r.gpu_units = on_gpu
        r.host_hit = (gpu_hit + host_hit) // page * page - r.gpu_hit
        r.miss = prompt_tokens - r.gpu_hit - r.host_hit
        r.host_load = r.host_hit
        r.prefill_left = max(r.miss, 1)  # the last prompt token is always recomputed
        r.context = prompt_tokens - r.prefill_left
        self._count_admission(r, matched, prompt_tokens)
        return True

    @cython.locals(node=Node)
    def _evict(self, tokens: int) -> None:
        """An admission's eviction of at least `tokens` GPU tokens in policy order
        (RadixTree.evict_gpu), counted (a prefetch's are not: a vetoed one may free less than it
        asks, and then loads nothing)."""
        evicted_tokens = 0
        for node in self.tree.evict_gpu(tokens):
            evicted_tokens += node.num_tokens
        self.counters.eviction_requested_tokens += tokens
        self.counters.evicted_gpu_tokens += evicted_tokens

    @cython.locals(r=Request, call=SimCall, c=Counters, i=cython.Py_ssize_t, recomputed=cython.Py_ssize_t)
    def _count_admission(self, r: Request, matched_units: int, prompt_tokens: int) -> None:
        c, call, ever_cached = self.counters, r.call, self.ever_cached
        c.prompt_tokens += prompt_tokens
        c.gpu_hit_tokens += r.gpu_hit
        c.host_hit_tokens += r.host_hit
        c.miss_tokens += r.miss
        keys, lens, recomputed = call.keys, call.lens, 0
        for i in range(matched_units, min(len(keys), len(lens))):
            if keys[i] in ever_cached:
                recomputed += lens[i]
        c.recomputed_tokens += recomputed

    # ------------------------------------------------------------------ iterations

    def _spf_chunk_limit(self, budget: int) -> int | None:
        """spf's cap on the chunked prefill (SGLang's `shortest_prefill_chunk_limit`): when the call
        at the head is part-way through its prefill, the admitted calls behind it that have not
        started (SGLang's waiting queue: here they hold memory, not yet prefill) are sorted by
        their prefill, and each one shorter than what the head has left reserves its tokens (page
        rounded) while they fit in the budget less a page; the head takes the rest. None: no cap."""
        page, prefilling = self.config.page_size, self.prefilling
        head = prefilling[0]
        if budget < 2 * page or head.prefill_left >= max(head.miss, 1):  # not chunked yet
            return None
        rest = sorted(prefilling[1:], key=lambda r: r.prefill_left)  # stable: admission order among equals
        prefilling[1:] = rest
        reserved = 0
        for r in rest:
            charge = -(-r.prefill_left // page) * page
            if r.prefill_left >= head.prefill_left or reserved + charge > budget - page:
                break
            reserved += charge
        return (budget - reserved) // page * page if reserved else None

    @cython.locals(r=Request)
    def _prefill_iteration(self) -> list[Request]:
        budget, seconds, loads = self.config.max_prefill_tokens, self.cost.step_overhead_s, 0
        limit = self._spf_chunk_limit(budget) if self.config.scheduling == "spf" else None
        for r in self.prefilling:
            if budget <= 0:
                break
            take = min(r.prefill_left, budget if limit is None else limit)
            limit = None  # only the head's chunk is capped
            self.prefilled_tokens += take
            seconds += self.cost.prefill_s(take, r.context)
            loads += r.host_load
            r.host_load = 0
            r.prefill_left -= take
            r.context += take
            budget -= take
        pcie = self.cost.pcie_s(loads)
        self.now += seconds + pcie
        self.clocks[0] += seconds
        self.clocks[2] += pcie
        finished, still = [], []
        for r in self.prefilling:
            if r.prefill_left > 0:
                still.append(r)
                continue
            r.ttft = self.now - r.arrival + self.cost.request_overhead_s  # the client waited for it too
            r.decode_left = r.call.output_tokens - 1
            if r.decode_left > 0:
                self.decoding[r] = None
                heapq.heappush(self._decode_ends, (self._decoded + r.decode_left, next(self._decode_seq), r))
                self._decode_context += r.context
            else:
                finished.append(r)
        self.prefilling = still
        return finished

    @cython.locals(r=Request)
    def _decode_iterations(self, next_event: float, idle_workflows: Iterable[str]) -> list[Request]:
        batch, kv, ends = len(self.decoding), self._decode_context, self._decode_ends
        steps = ends[0][0] - self._decoded  # the fewest tokens a request of the batch has left
        if next_event < INF:  # the next event anywhere ends the run of identical iterations
            gap = next_event - self.now
            steps = max(1, min(steps, math.ceil(gap / self.cost.decode_step_s(batch, kv))))
        seconds = steps * self.cost.decode_step_s(batch, kv + batch * (steps - 1) / 2)
        self._prefetch(seconds, idle_workflows)
        self.now += seconds
        self.clocks[1] += seconds
        self._decoded += steps
        self._decode_context += batch * steps
        finished = []
        while ends and ends[0][0] == self._decoded:  # in the order they entered the batch
            _, _, r = heapq.heappop(ends)
            del self.decoding[r]
            r.context += r.decode_left
            r.decode_left = 0
            self._decode_context -= r.context
            finished.append(r)
        return finished

    # ------------------------------------------------------------------ finishing

    @cython.locals(r=Request, wf=SimWorkflow, call=SimCall, node=Node, c=Counters)
    def finish(self, r: Request) -> None:
        """The cache side of a completed call: prompt + output inserted, the path unlocked."""
        wf, call, tree = r.wf, r.call, self.tree
        del self.running[wf.id]
        units, lens, keys = call.units, call.lens, call.keys
        if call.output_tokens > 0:
            units, lens = units + (call.output_unit,), lens + (call.output_tokens,)
            keys = keys + (chain(keys[-1], call.output_unit),)
        _, path = tree.insert(units, lens, refresh=False)  # refreshed below, once the ledger has the call
        tree.private_gpu -= r.private
        if r.last_node is not None:
            tree.unlock(r.last_node)
        node_ids = []
        for node in path:
            node_ids.append(node.id)
        if self.tracks_workflows:
            self.ledger.record_path(node_ids, wf.id, call.agent)
        if path:
            self.policy.on_cached(path[-1], wf.id, call.agent, True)
        tree.refresh_ids(self.policy.on_time(self.now))
        tree.refresh_ids(self.policy.on_call_finished(wf.id, call.agent, node_ids, sum(lens),
                                                      wf.next_call + 1 < len(wf.calls)))
        tree.refresh_many(path)
        self.policy.set_capacity(tree.gpu_capacity - tree.private_gpu)
        self.policy.observe_insert(wf.id, call.agent, keys, lens)
        self.ever_cached.update(keys)
        r.finished = self.now
        self.trace.append(r)
        c = self.counters
        c.time_tool_s += call.tool_time
        c.time_queue_s += r.admitted - r.scheduled
        clocks, before = self.clocks, r.clocks
        c.time_prefill_s += clocks[0] - before[0]
        c.time_decode_s += clocks[1] - before[1]
        c.time_pcie_s += clocks[2] - before[2]
        c.time_predictor_s += clocks[3] - before[3]
        self.counters.ttfts.append(r.ttft)
        self.counters.kv_tokens_read += call.prompt_tokens * call.output_tokens

    def predict(self, workflows: list[SimWorkflow], predictions: PredictionSource | None) -> None:
        """One batched predictor call for the workflows whose call finished in this step (those the
        cache has not retired); their nodes' priorities follow the new predictions."""
        batch = [w for w in workflows if self.ledger.is_live(w.id)]
        if not batch or predictions is None:
            return
        started = time.perf_counter()
        ids, names = [w.id for w in batch], predictions.agent_names
        graph_steps = getattr(predictions, "steps_to_execution", None)  # an agent step graph (KVFlow)
        tabled = getattr(predictions, "predict_rows", None)
        rows = tabled(batch, self.ledger.gamma) if tabled is not None and graph_steps is None else None
        values = None
        if rows is not None and self.policy.reads_times:  # pbkv_time: each step's P^(k) and time, tabled too
            values = predictions.predict_derived(batch, self.policy.values_key, self.policy.step_values)
            rows = rows if values is not None else None
        steps = None
        if rows is not None:  # computed before the replay, already folded for the ledger
            measured = time.perf_counter() - started
            changed = self.ledger.set_rows(ids, names, rows)
            if values is not None:
                self.tree.refresh_ids(self.policy.on_step_values(ids, names, *values, self.now))
        else:
            probs = predictions.predict(batch)
            steps = graph_steps(batch) if graph_steps else None
            seconds = predict_times(predictions, batch) if self.policy.reads_times else None
            measured = time.perf_counter() - started
            changed = self.ledger.set_predictions(ids, names, probs, steps)
            if self.policy.reads_times:
                self.tree.refresh_ids(self.policy.on_predictions(ids, names, probs, seconds, self.now))
        self.tree.reprioritize_ids(self.policy.on_steps(ids, steps))  # kvflow: the nodes a step update re-ranks
        self.tree.refresh_ids(self.policy.changed_by(changed))
        self.counters.predictor_calls += 1
        self.counters.predictor_time_s += measured
        charged = measured if self.config.charge_measured_predictor_time else self.config.predictor_cost_s
        self.now += charged
        self.clocks[3] += charged

    # ------------------------------------------------------------------ prefetch

    def _prefetch(self, seconds: float, idle_workflows: Iterable[str]) -> None:
        """Load host-only cache that idle workflows are predicted to read next (decode-only
        iterations and idle time only, within the PCIe bandwidth of that time). `idle_workflows`:
        the workflows the Simulator knows of (live, or finished and not yet retired) with no call
        admitted anywhere when it handed over the event; those admitted here since are skipped."""
        if not self.prefetch.enabled or seconds <= 0:
            return
        budget = self.cost.pcie_tokens(seconds)
        tree = self.tree
        running = self.running
        if self.prefetch.policy_driven:  # a baseline's own order (kvflow, lru_prefetch)
            ranked = self.policy.prefetch_order(tree.by_id, (w for w in idle_workflows if w not in running))
        else:
            candidates = {}
            for wf_id in idle_workflows:
                if wf_id in running:
                    continue
                for node_id in self.ledger.nodes_of.get(wf_id, ()):
                    node = tree.by_id.get(node_id)
                    if node is not None and not node.on_gpu:
                        candidates[node_id] = node
            ranked = [(node, None) for node in self.prefetch.rank(list(candidates.values()))]
        for node, tag in ranked:
            if budget <= 0:
                break
            if node.on_gpu or node.parent is None:
                continue
            path = [node]
            while not path[-1].parent.on_gpu:
                path.append(path[-1].parent)
            path.reverse()
            need = sum(n.num_tokens for n in path)
            if need > budget:  # waits for a longer window
                continue
            anchor = path[0].parent
            tree.lock(anchor)  # keep the path's GPU ancestor while making room
            if tree.gpu_free() < need:
                tree.evict_gpu(need - tree.gpu_free(), allow=self.prefetch.may_evict)
            tree.unlock(anchor)
            if tree.gpu_free() < need:
                if self.prefetch.stops_at_failure:  # kvflow: a load that fails ends the round
                    self.policy.on_prefetch_failed()
                    break
                continue
            tree.load_back(path)
            if self.prefetch.policy_driven:  # kvflow holds what it loaded: path[0]'s priority changed
                self.policy.on_prefetched(path, tag)
                tree.refresh(path[0])
            if self.decisions is not None:
                self.decisions.extend((self.now, "prefetch", n.key_id, n.num_tokens) for n in path)
            budget -= need
            self.counters.prefetched_tokens += need
            for n in path:
                self.prefetched[n.id] = n.num_tokens


class Simulator:
    """The closed-loop client, the router and `config.replicas` servers on one event clock: the
    one driver of the replay.

    It alone owns the workflows' progress (the queue of workflows to start, the live set, the
    finished ones the cache has not retired), the heaps of call arrivals and of retirements (end
    signals and inactivity timeouts), and the order of events. Each server keeps its own clock
    (the end of its last iteration); the loop always handles the earliest event: a retirement, a
    call arriving (routed, then queued at its server), or the step of the busy server whose clock
    is earliest (on a tie, in that order). A step's completed calls are finished one by one (the
    server inserts the call into its cache, then the Simulator schedules the workflow's next
    call or ends it), then the server applies one batch of predictions. With one server this is
    exactly the single-server loop. `config.gpu_tokens` is the cluster's total: each replica gets
    gpu_tokens // replicas."""

    def __init__(self, workflows: list[SimWorkflow], config: SimConfig, cost: CostModel, policy: str = "lru",
                 policy_options: dict | None = None, prefetch: str = "none",
                 predictions: PredictionSource | None = None, gamma: float = PbkvConfig.gamma,
                 record_decisions: bool = False):
        if config.replicas < 1:
            raise ValueError(f"sim.replicas must be at least 1; got {config.replicas}")
        self.workflows, self.config, self.cost = workflows, config, cost
        self.future = FutureIndex(workflows, config.concurrency) if policy == "oracle" else None
        self.predictions = predictions
        tabulate(predictions, workflows)  # every prefix's prediction, before the replay
        self.servers = [Server(config, cost, config.gpu_tokens // config.replicas, policy, policy_options, prefetch,
                               gamma, next_use=self.future.next_use if self.future else None,
                               record_decisions=record_decisions) for _ in range(config.replicas)]
        first = self.servers[0]
        if (first.policy.uses_predictions or first.prefetch.uses_predictions) and predictions is None:
            raise ValueError(f"policy '{policy}' with prefetch '{prefetch}' needs a prediction source")
        routers: Any = config.router or {}  # each routing policy's options (a mapping once Hydra built it)
        self.router = make_router(config.routing, config.replicas, **dict(routers.get(config.routing) or {}))
        if self.router.uses_predictions and predictions is None:
            raise ValueError(f"routing '{config.routing}' needs a prediction source")
        if self.router.uses_predictions:  # it scores replicas by the ledger's record of the workflow
            for server in self.servers:
                server.tracks_workflows = True
        self.pending = deque(workflows)
        self.live: dict[str, SimWorkflow] = {}
        # heap of (arrival time, seq, workflow, issue time) of issued calls not yet arrived: a call
        # reaches a server request_overhead_s after its workflow issued it
        self.arrivals: list = []
        self._seq = itertools.count()
        lost = np.random.default_rng([config.seed, 0xE5D]).random(len(workflows)) < config.end_signal_loss
        self.lost_signal = {w.id for w, x in zip(workflows, lost) if x}
        # SGLang's own orders without prefetch never read the ledger: when a workflow is retired
        # cannot change what they do, so they retire it with its last call (no extra events)
        self.immediate_end = first.policy.served_by == "sglang" and not first.prefetch.enabled
        self.prefetching = first.prefetch.enabled
        self.finished: dict[str, SimWorkflow] = {}  # done, but not yet retired by the cache
        self.idle_since: dict[str, float] = {}  # workflow -> time its last call finished (no call since)
        self.retirements: list = []  # heap of (time, seq, workflow id, idle stamp or None for the end signal)
        self.to_predict: list[SimWorkflow] = []  # workflows whose call finished in the current step

    # the single server's state, for callers that drive one server
    @property
    def tree(self) -> RadixTree:
        return self.servers[0].tree

    @property
    def ledger(self) -> WorkflowLedger:
        return self.servers[0].ledger

    @property
    def now(self) -> float:
        return max(s.now for s in self.servers)

    @property
    def trace(self) -> list[Request]:
        """Every replica's realized request sequence, one after another (bound.py reads one replica's)."""
        return self.servers[0].trace if len(self.servers) == 1 else [r for s in self.servers for r in s.trace]

    @property
    def decisions(self) -> list | None:
        if self.servers[0].decisions is None or len(self.servers) == 1:
            return self.servers[0].decisions
        return sorted((d for s in self.servers for d in s.decisions or ()), key=lambda d: d[0])

    # ------------------------------------------------------------------ workflows

    def _start_workflows(self, now: float) -> None:
        while self.pending and len(self.live) < self.config.concurrency:
            wf = self.pending.popleft()
            wf.start_time = now
            self.live[wf.id] = wf
            for server in self.servers:
                server.start_workflow(wf.id)
            self._arrive_at(now, wf)
            if self.future:
                self.future.next_start = wf.order + 1
                self._refresh_future(wf)

    def _arrive_at(self, t: float, wf: SimWorkflow) -> None:
        """wf issues its next call at t."""
        heapq.heappush(self.arrivals, (t + self.cost.request_overhead_s, next(self._seq), wf, t))

    def _refresh_future(self, wf: SimWorkflow) -> None:
        assert self.future is not None, "only the oracle reads the real future"
        keys = self.future.keys_touched(wf)
        for server in self.servers:
            server.refresh_keys(keys)

    def _idle_workflows(self) -> Iterable[str]:
        """What prefetch may load for: live and finished (not yet retired) workflows with no call
        admitted on any server (a queued call's cache is not locked yet); none without prefetch.
        A server skips the calls admitted on it itself, so with one server these are all the
        workflows known (an iterator, read once, in the same event: most steps do not prefetch)."""
        if not self.prefetching:
            return ()
        known = itertools.chain(self.live, self.finished)
        if len(self.servers) == 1:
            return known
        running = {w for s in self.servers for w in s.running}
        return [w for w in known if w not in running]

    # ------------------------------------------------------------------ main loop

    def run(self) -> Counters:
        with fewer_collections():
            self._replay()
        return self.counters()

    def _replay(self) -> None:
        self._start_workflows(0.0)
        servers, arrivals = self.servers, self.arrivals
        while True:
            server = None  # the busy server whose clock is earliest
            for s in servers:
                if s.busy and (server is None or s.now < server.now):
                    server = s
            next_arrival = arrivals[0][0] if arrivals else INF
            retire_at = self._next_retirement()
            if retire_at < INF and (arrivals or server) and retire_at <= min(next_arrival,
                                                                              server.now if server else INF):
                self._retire_next()
            elif arrivals and (server is None or next_arrival <= server.now):
                self._arrive()
            elif server is None:
                break
            else:
                self._step(server, min(next_arrival, retire_at))

    @cython.locals(wf=SimWorkflow)
    def _arrive(self) -> None:
        """The earliest issued call arrives: routed to a server, queued there."""
        t, _, wf, issued = heapq.heappop(self.arrivals)
        self.idle_since.pop(wf.id, None)
        servers = self.servers
        for s in servers:
            if not s.ledger.is_live(wf.id):  # retired by the inactivity timeout: starts afresh
                s.start_workflow(wf.id)
        servers[self.router.route(wf, wf.calls[wf.next_call], servers, t)].receive(t, wf, self._idle_workflows(),
                                                                                 issued)

    def _step(self, server: Server, next_event: float) -> None:
        """One scheduler step of `server`; then each completed call finished, then its predictions."""
        for request in server.step(next_event, self._idle_workflows()):
            self._finish(request)
        to_predict, self.to_predict = self.to_predict, []
        server.predict(to_predict, self.predictions)

    def counters(self) -> Counters:
        """The cluster's counters: the one server's, or the sum over servers."""
        if len(self.servers) == 1:
            return self.servers[0].counters
        total = Counters()
        for s in self.servers:
            for f in fields(Counters):
                setattr(total, f.name, getattr(total, f.name) + getattr(s.counters, f.name))
        return total

    @cython.locals(r=Request, wf=SimWorkflow)
    def _finish(self, r: Request) -> None:
        """A call completed on r.server: its cache side there, then the workflow's next call or its end."""
        server, wf = r.server, r.wf
        assert server is not None, "a finished call was admitted on a server"
        server.finish(r)
        wf.next_call += 1
        if wf.next_call < len(wf.calls):
            self._arrive_at(server.now + wf.calls[wf.next_call].tool_time, wf)
            self.to_predict.append(wf)
            self._wait_for_call(wf, server.now)
        else:
            server.counters.latencies.append(server.now - wf.start_time)
            server.counters.latency_workflows.append(wf.id)
            del self.live[wf.id]
            self._end_of_workflow(wf, server)
            tell_finished(self.predictions, wf)
            self.router.forget(wf.id)
            self._start_workflows(server.now)
        if self.future:
            self.future.first_live = min((w.order for w in self.live.values()), default=self.future.next_start)
            self._refresh_future(wf)

    # ------------------------------------------------------------------ end of workflows

    def _wait_for_call(self, wf: SimWorkflow, now: float) -> None:
        """wf's call finished: the inactivity timeout runs from now until its next call."""
        self.idle_since[wf.id] = now
        timeout = self.config.inactivity_timeout_s
        assert timeout is not None, "SimConfig resolves a None timeout to inf"
        if timeout < INF and not self.immediate_end:
            heapq.heappush(self.retirements, (now + timeout, next(self._seq), wf.id, now))

    def _retire(self, wf_id: str) -> None:
        for s in self.servers:
            s.retire_workflow(wf_id)

    def _end_of_workflow(self, wf: SimWorkflow, server: Server) -> None:
        if self.immediate_end or (wf.id not in self.lost_signal and self.config.end_signal_delay_s == 0):
            self.servers[0].counters.ended_by_signal += 1
            self._retire(wf.id)
            return
        self.finished[wf.id] = wf
        self.to_predict.append(wf)  # the cache does not know yet that this was the last call
        self._wait_for_call(wf, server.now)
        delay = self.config.end_signal_delay_s
        assert delay is not None, "SimConfig resolves a None delay to 0"
        if wf.id not in self.lost_signal:
            heapq.heappush(self.retirements, (server.now + delay, next(self._seq), wf.id, None))

    def _valid(self, event) -> bool:
        _, _, wf_id, stamp = event
        if not self.servers[0].ledger.is_live(wf_id):
            return False
        return stamp is None or self.idle_since.get(wf_id) == stamp

    def _next_retirement(self) -> float:
        while self.retirements and not self._valid(self.retirements[0]):
            heapq.heappop(self.retirements)
        return self.retirements[0][0] if self.retirements else INF

    def _retire_next(self) -> None:
        t, _, wf_id, stamp = heapq.heappop(self.retirements)
        finished = self.finished.pop(wf_id, None) is not None
        c = self.servers[0].counters
        if stamp is None:
            c.ended_by_signal += 1
        elif finished:
            c.ended_by_timeout += 1
        else:
            c.live_timeouts += 1
        self.idle_since.pop(wf_id, None)
        idle = self._idle_workflows()
        for s in self.servers:  # an idle server's clock moves to the retirement
            if not s.busy:
                s.idle_until(t, idle)
        self._retire(wf_id)


def summarize(counters: Counters, makespan: float, n_calls: int, trace: Sequence[Request] = ()) -> dict:
    """The run's row metrics; `trace` (every request once or twice) gives each workflow's recomputed tokens."""
    c = counters
    requests = {id(r): r for r in trace}.values()
    per_workflow = per_workflow_results(dict(zip(c.latency_workflows, c.latencies)),
                                        ((r.wf.id, r.gpu_hit + r.host_hit + r.miss, r.miss) for r in requests))
    row = {
        **replay_metrics(gpu_hit_tokens=c.gpu_hit_tokens, host_hit_tokens=c.host_hit_tokens,
                         prompt_tokens=c.prompt_tokens, workflow_latencies=c.latencies, ttfts=c.ttfts,
                         calls=n_calls, makespan_s=makespan, per_workflow=per_workflow,
                         time_totals={"tool": c.time_tool_s, "queue": c.time_queue_s, "prefill": c.time_prefill_s,
                                      "decode": c.time_decode_s, "pcie": c.time_pcie_s,
                                      "predictor": c.time_predictor_s}),
        "recomputed_tokens": c.recomputed_tokens,
        "prefetch_precision": c.prefetch_used_tokens / c.prefetched_tokens if c.prefetched_tokens else None,
        "prefetched_tokens": c.prefetched_tokens,
        "kv_tokens_read": c.kv_tokens_read,
        "eviction_requested_tokens": c.eviction_requested_tokens,
        "evicted_gpu_tokens": c.evicted_gpu_tokens,
        "predictor_calls": c.predictor_calls,
        "ended_by_signal": c.ended_by_signal,
        "ended_by_timeout": c.ended_by_timeout,
        "live_timeouts": c.live_timeouts,
    }
    row["eviction_overshoot"] = eviction_overshoot(row)
    return row


def bound_metrics(sim: Simulator, reuse: bool = True) -> dict:
    """The offline bounds for the run's own request sequence (bound.py: GPU hits without and with
    prefetch, GPU + host hits); in a cluster, summed over replicas, each one's on the calls routed to it.
    `reuse`: as upper_bounds' (False: solve even a sequence solved before, to time it)."""
    return row_bounds([upper_bounds(sequence_from_trace(s.trace), s.tree.gpu_capacity, s.tree.host_capacity,
                                    prefetch_budgets(s.trace, sim.cost.pcie_tokens_per_s), reuse=reuse)
                       for s in sim.servers],
                      sim.counters().prompt_tokens)


def simulate(workflows: list[SimWorkflow], config: SimConfig, cost: CostModel, bound: bool = True,
             headroom: bool = False, headroom_integer: bool = False, **policy) -> dict:
    """Replay the workflows under one policy; the summary metrics, with the run's bounds
    (`bound_hit_rate`, `bound_prefetch_hit_rate`, `bound_recompute_rate`: bound.py) unless bound=False,
    and where the eviction bound's extra hits lie (headroom.py) if `headroom` and the run has no prefetch
    (with `headroom_integer`, also how far the bound's LP lies from its integer optimum)."""
    with fewer_collections():  # the replay's tables, the replay and its bounds
        return _simulate(workflows, config, cost, bound, headroom, headroom_integer, policy)


def _simulate(workflows: list[SimWorkflow], config: SimConfig, cost: CostModel, bound: bool, headroom: bool,
              headroom_integer: bool, policy: dict) -> dict:
    fresh = [SimWorkflow(w.id, w.order, w.task, w.calls) for w in workflows]  # runs mutate progress
    sim = Simulator(fresh, config, cost, **policy)
    counters = sim.run()
    result = summarize(counters, sim.now, sum(len(w.calls) for w in workflows), sim.trace)
    calls = [s.calls for s in sim.servers]
    result.update(replica_calls=calls, load_imbalance=max(calls) / (sum(calls) / len(calls)) if sum(calls) else 1.0,
                  migrations=sim.router.migrations)
    # pbkv's trust (one judge per replica): what it measured and followed
    result.update(trust_summary([r for r in (s.policy.trust_report() for s in sim.servers) if r is not None]))
    if headroom and policy.get("prefetch", "none") == "none":
        result.update(headroom_fields(sim.servers, integer=headroom_integer))
    return {**result, **bound_metrics(sim)} if bound else result
