"""A discrete-event model of one SGLang server with HiCache, replaying agent workflows.

Per request (one agent call): match the prompt in the two-tier radix tree; GPU-hit tokens are
free, host-hit tokens are loaded over PCIe, missed tokens are prefilled; the matched path is
locked while the request runs; prompt + output are inserted when it finishes (SGLang inserts
both). Scheduling follows SGLang's defaults: FCFS admission while KV memory allows (the prompt's
missed tokens and the output are reserved up front), prefill iterations of at most
`max_prefill_tokens` (chunked prefill) take priority over decode iterations, decode runs the
whole running batch one token per iteration. Between events, identical decode iterations are
advanced together. Closed loop: `concurrency` workflows are live; each issues its next call when
the previous one finishes plus that call's tool time; a new workflow starts when one ends.

The end of a workflow reaches the cache as a real client sends it: after its last call, once the
client has decided to stop (`end_signal_delay_s` later; 0: with the last call). A share
`end_signal_loss` of the end signals (drawn per workflow with `seed`) never arrives; the cache
then retires a workflow after `inactivity_timeout_s` without calls, as the plugin does (a live
workflow silent that long is retired too, and starts afresh with its next call). Until it is
retired, a finished workflow is predicted, scored and prefetched for like any other.

The predictor is called after every finished call, batched over the workflows whose call
finished in the same iteration; its cost can be charged to the timeline. Conservative or
aggressive prefetch runs in decode-only iterations and idle time, with the PCIe bandwidth of
that time as its budget. Everything is deterministic for a given input and seed.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from serving_integration.simulator.cost_model import CostModel
from serving_integration.cache.metrics import replay_metrics
from serving_integration.cache.policies import INF, Prefetch, WorkflowLedger, make_policy
from serving_integration.cache.predictions import PredictionSource
from serving_integration.cache.workload import SimCall, SimWorkflow, chain
from serving_integration.simulator.radix import Node, RadixTree


@dataclass(frozen=True)
class SimConfig:
    gpu_tokens: int = 200_000
    hicache_ratio: float = 2.0  # host tokens = ratio x GPU tokens
    page_size: int = 1
    concurrency: int = 32
    max_prefill_tokens: int = 8192
    max_running_requests: int = 256
    predictor_cost_s: float = 0.0  # charged per batched predictor call
    charge_measured_predictor_time: bool = False  # charge the measured wall time instead (not reproducible)
    end_signal_delay_s: float = 0.0  # the end signal arrives this long after a workflow's last call
    end_signal_loss: float = 0.0  # share of end signals lost (seeded)
    inactivity_timeout_s: float = math.inf  # retire a workflow silent this long
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.end_signal_loss <= 1.0:
            raise ValueError(f"sim.end_signal_loss must be in [0, 1]; got {self.end_signal_loss}")
        if self.end_signal_delay_s < 0 or not self.inactivity_timeout_s > 0:
            raise ValueError("sim.end_signal_delay_s must be >= 0 and sim.inactivity_timeout_s > 0; got "
                             f"{self.end_signal_delay_s} and {self.inactivity_timeout_s}")


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
    prefetched_tokens: int = 0
    prefetch_used_tokens: int = 0
    predictor_calls: int = 0
    predictor_time_s: float = 0.0
    ended_by_signal: int = 0
    ended_by_timeout: int = 0  # finished workflows whose end signal was lost
    live_timeouts: int = 0  # live workflows retired by the timeout during a long tool call
    ttfts: list = field(default_factory=list)
    latencies: list = field(default_factory=list)


class Simulator:
    def __init__(self, workflows: list[SimWorkflow], config: SimConfig, cost: CostModel, policy: str = "lru",
                 policy_options: dict | None = None, prefetch: str = "none",
                 predictions: PredictionSource | None = None, gamma: float = 0.5):
        self.workflows, self.config, self.cost = workflows, config, cost
        self.ledger = WorkflowLedger(gamma)
        self.future = FutureIndex(workflows, config.concurrency) if policy == "oracle" else None
        self.policy = make_policy(policy, self.ledger, next_use=self.future.next_use if self.future else None,
                                  **(policy_options or {}))
        self.prefetch = Prefetch(prefetch, self.ledger)
        if (self.policy.uses_predictions or self.prefetch.enabled) and predictions is None:
            raise ValueError(f"policy '{policy}' with prefetch '{prefetch}' needs a prediction source")
        self.predictions = predictions
        self.tree = RadixTree(config.gpu_tokens, int(config.hicache_ratio * config.gpu_tokens),
                              priority=self.policy.priority, on_delete=self._on_delete,
                              on_split=self._on_split, on_evict=self._on_evict)
        self.now = 0.0
        self.pending = deque(workflows)
        self.live: dict[str, SimWorkflow] = {}
        self.running: dict[str, Request] = {}  # workflow id -> its request in flight
        self.arrivals: list = []
        self._seq = itertools.count()
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.to_predict: list[SimWorkflow] = []
        self.ever_cached: set[int] = set()
        self.prefetched: dict[int, int] = {}  # node id -> prefetched tokens not yet read
        self.counters = Counters()
        lost = np.random.default_rng([config.seed, 0xE5D]).random(len(workflows)) < config.end_signal_loss
        self.lost_signal = {w.id for w, x in zip(workflows, lost) if x}
        # SGLang's own orders without prefetch never read the ledger: when a workflow is retired
        # cannot change what they do, so they retire it with its last call (no extra events)
        self.immediate_end = self.policy.served_by == "sglang" and not self.prefetch.enabled
        self.finished: dict[str, SimWorkflow] = {}  # done, but not yet retired by the cache
        self.idle_since: dict[str, float] = {}  # workflow -> time its last call finished (no call since)
        self.retirements: list = []  # heap of (time, seq, workflow id, idle stamp or None for the end signal)

    # ------------------------------------------------------------------ tree callbacks

    def _on_delete(self, node: Node) -> None:
        self.ledger.forget(node.id)
        self.prefetched.pop(node.id, None)

    def _on_split(self, prefix: Node, suffix: Node) -> None:
        self.ledger.split(prefix.id, suffix.id)
        if suffix.id in self.prefetched:
            self.prefetched[prefix.id] = prefix.num_tokens
            self.prefetched[suffix.id] = suffix.num_tokens

    def _on_evict(self, node: Node) -> None:
        self.prefetched.pop(node.id, None)
        self.policy.on_evict(node)

    # ------------------------------------------------------------------ workflows

    def _start_workflows(self) -> None:
        while self.pending and len(self.live) < self.config.concurrency:
            wf = self.pending.popleft()
            wf.start_time = self.now
            self.live[wf.id] = wf
            self.ledger.start(wf.id)
            self._arrive_at(self.now, wf)
            if self.future:
                self.future.next_start = wf.order + 1
                self._refresh_future(wf)

    def _arrive_at(self, t: float, wf: SimWorkflow) -> None:
        heapq.heappush(self.arrivals, (t, next(self._seq), wf))

    def _refresh_future(self, wf: SimWorkflow) -> None:
        by_key = self.tree.by_key
        self.tree.refresh_many(by_key[k] for k in self.future.keys_touched(wf) if k in by_key)

    # ------------------------------------------------------------------ main loop

    def run(self) -> Counters:
        self._start_workflows()
        while self.arrivals or self.waiting or self.prefilling or self.decoding:
            self._retire_due()
            while self.arrivals and self.arrivals[0][0] <= self.now:
                _, _, wf = heapq.heappop(self.arrivals)
                self.idle_since.pop(wf.id, None)
                if not self.ledger.is_live(wf.id):  # retired by the inactivity timeout: starts afresh
                    self.ledger.start(wf.id)
                self.waiting.append(Request(wf, wf.calls[wf.next_call], self.now))
            self._admit()
            if self.prefilling:
                finished = self._prefill_iteration()
            elif self.decoding:
                finished = self._decode_iterations()
            elif self.waiting:
                need = self.waiting[0].call.prompt_tokens + self.waiting[0].call.output_tokens
                raise ValueError(f"a call of workflow {self.waiting[0].wf.id} needs {need} KV tokens, more than "
                                 f"sim.gpu_tokens={self.config.gpu_tokens} can hold; raise sim.gpu_tokens")
            else:
                t = min(self.arrivals[0][0], self._next_retirement())
                self._prefetch(t - self.now)
                self.now = t
                continue
            for request in finished:
                self._finish(request)
            self._predict()
        return self.counters

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.config.max_running_requests:
            if not self._try_admit(self.waiting[0]):
                return
            request = self.waiting.popleft()
            self.prefilling.append(request)
            self.running[request.wf.id] = request

    def _try_admit(self, r: Request) -> bool:
        call, tree = r.call, self.tree
        path = tree.match(call.units, call.lens)
        # hits are counted in the request's own token counts (a pruned request may need fewer
        # tokens of a unit than the cache holds); memory moves in the cache's counts
        matched = sum(len(n.units) for n in path)
        on_gpu = sum(len(n.units) for n in path if n.on_gpu)  # GPU nodes come first on a path
        gpu_hit, host_hit = sum(call.lens[:on_gpu]), sum(call.lens[on_gpu:matched])
        miss = call.prompt_tokens - gpu_hit - host_hit
        need = sum(n.num_tokens for n in path if not n.on_gpu) + miss + call.output_tokens
        if path:
            tree.lock(path[-1])  # before evicting, so the request's own prefix stays
        if tree.gpu_free() < need:
            tree.evict_gpu(need - tree.gpu_free())
        if tree.gpu_free() < need:
            if path:
                tree.unlock(path[-1])
            return False
        tree.load_back(path)
        r.private = miss + call.output_tokens
        tree.private_gpu += r.private
        for node in path:
            self.ledger.record_access(node.id, r.wf.id, call.agent)
            if node.id in self.prefetched:  # prefetched, and read before it was evicted
                self.counters.prefetch_used_tokens += self.prefetched.pop(node.id)
        r.last_node = path[-1] if path else None
        page = self.config.page_size
        r.gpu_hit = gpu_hit // page * page  # only whole pages are reused
        r.host_hit = (gpu_hit + host_hit) // page * page - r.gpu_hit
        r.miss = call.prompt_tokens - r.gpu_hit - r.host_hit
        r.host_load = r.host_hit
        r.prefill_left = max(r.miss, 1)  # the last prompt token is always recomputed
        r.context = call.prompt_tokens - r.prefill_left
        self._count_admission(r, matched)
        return True

    def _count_admission(self, r: Request, matched_units: int) -> None:
        c = self.counters
        c.prompt_tokens += r.call.prompt_tokens
        c.gpu_hit_tokens += r.gpu_hit
        c.host_hit_tokens += r.host_hit
        c.miss_tokens += r.miss
        c.recomputed_tokens += sum(n for key, n in zip(r.call.keys[matched_units:], r.call.lens[matched_units:])
                                   if key in self.ever_cached)

    # ------------------------------------------------------------------ iterations

    def _prefill_iteration(self) -> list[Request]:
        budget, seconds, loads = self.config.max_prefill_tokens, self.cost.step_overhead_s, 0
        for r in self.prefilling:
            if budget <= 0:
                break
            take = min(r.prefill_left, budget)
            seconds += self.cost.prefill_s(take, r.context)
            loads += r.host_load
            r.host_load = 0
            r.prefill_left -= take
            r.context += take
            budget -= take
        self.now += seconds + self.cost.pcie_s(loads)
        finished, still = [], []
        for r in self.prefilling:
            if r.prefill_left > 0:
                still.append(r)
                continue
            r.ttft = self.now - r.arrival
            r.decode_left = r.call.output_tokens - 1
            (self.decoding if r.decode_left > 0 else finished).append(r)
        self.prefilling = still
        return finished

    def _decode_iterations(self) -> list[Request]:
        batch = len(self.decoding)
        kv = sum(r.context for r in self.decoding)
        steps = min(r.decode_left for r in self.decoding)
        next_event = min(self.arrivals[0][0] if self.arrivals else INF, self._next_retirement())
        if next_event < INF:
            gap = next_event - self.now
            steps = max(1, min(steps, math.ceil(gap / self.cost.decode_step_s(batch, kv))))
        seconds = steps * self.cost.decode_step_s(batch, kv + batch * (steps - 1) / 2)
        self._prefetch(seconds)
        self.now += seconds
        finished, still = [], []
        for r in self.decoding:
            r.decode_left -= steps
            r.context += steps
            (finished if r.decode_left == 0 else still).append(r)
        self.decoding = still
        return finished

    # ------------------------------------------------------------------ finishing

    def _finish(self, r: Request) -> None:
        wf, call, tree = r.wf, r.call, self.tree
        units, lens, keys = call.units, call.lens, call.keys
        if call.output_tokens > 0:
            units, lens = units + (call.output_unit,), lens + (call.output_tokens,)
            keys = keys + (chain(keys[-1], call.output_unit),)
        _, path = tree.insert(units, lens)
        tree.private_gpu -= r.private
        if r.last_node is not None:
            tree.unlock(r.last_node)
        for node in path:
            self.ledger.record_access(node.id, wf.id, call.agent)
        tree.refresh_many(path)
        self.ever_cached.update(keys)
        self.counters.ttfts.append(r.ttft)
        self.counters.kv_tokens_read += call.prompt_tokens * call.output_tokens
        del self.running[wf.id]
        wf.next_call += 1
        if wf.next_call < len(wf.calls):
            self._arrive_at(self.now + wf.calls[wf.next_call].tool_time, wf)
            self.to_predict.append(wf)
            self._wait_for_call(wf)
        else:
            self.counters.latencies.append(self.now - wf.start_time)
            del self.live[wf.id]
            self._end_of_workflow(wf)
            self._start_workflows()
        if self.future:
            self.future.first_live = min((w.order for w in self.live.values()), default=self.future.next_start)
            self._refresh_future(wf)

    # ------------------------------------------------------------------ end of workflows

    def _wait_for_call(self, wf: SimWorkflow) -> None:
        """wf's call finished: the inactivity timeout runs from now until its next call."""
        self.idle_since[wf.id] = self.now
        if self.config.inactivity_timeout_s < INF and not self.immediate_end:
            heapq.heappush(self.retirements, (self.now + self.config.inactivity_timeout_s, next(self._seq),
                                              wf.id, self.now))

    def _end_of_workflow(self, wf: SimWorkflow) -> None:
        if self.immediate_end or (wf.id not in self.lost_signal and self.config.end_signal_delay_s == 0):
            self.counters.ended_by_signal += 1
            self.tree.refresh_ids(self.ledger.end(wf.id))
            return
        self.finished[wf.id] = wf
        self.to_predict.append(wf)  # the cache does not know yet that this was the last call
        self._wait_for_call(wf)
        if wf.id not in self.lost_signal:
            heapq.heappush(self.retirements, (self.now + self.config.end_signal_delay_s, next(self._seq), wf.id, None))

    def _valid(self, event) -> bool:
        _, _, wf_id, stamp = event
        if not self.ledger.is_live(wf_id):
            return False
        return stamp is None or self.idle_since.get(wf_id) == stamp

    def _next_retirement(self) -> float:
        while self.retirements and not self._valid(self.retirements[0]):
            heapq.heappop(self.retirements)
        return self.retirements[0][0] if self.retirements else INF

    def _retire_due(self) -> None:
        while self._next_retirement() <= self.now:
            _, _, wf_id, stamp = heapq.heappop(self.retirements)
            finished = self.finished.pop(wf_id, None) is not None
            if stamp is None:
                self.counters.ended_by_signal += 1
            elif finished:
                self.counters.ended_by_timeout += 1
            else:
                self.counters.live_timeouts += 1
            self.idle_since.pop(wf_id, None)
            self.tree.refresh_ids(self.ledger.end(wf_id))

    def _predict(self) -> None:
        batch = [w for w in self.to_predict if self.ledger.is_live(w.id)]
        self.to_predict = []
        if not batch or self.predictions is None:
            return
        started = time.perf_counter()
        probs = self.predictions.predict(batch)
        graph_steps = getattr(self.predictions, "steps_to_execution", None)  # an agent step graph (KVFlow)
        steps = graph_steps(batch) if graph_steps else None
        measured = time.perf_counter() - started
        self.ledger.set_predictions([w.id for w in batch], self.predictions.agent_names, probs, steps)
        for w in batch:
            self.tree.refresh_ids(self.ledger.nodes_of.get(w.id, ()))
        self.counters.predictor_calls += 1
        self.counters.predictor_time_s += measured
        self.now += measured if self.config.charge_measured_predictor_time else self.config.predictor_cost_s

    # ------------------------------------------------------------------ prefetch

    def _prefetch(self, seconds: float) -> None:
        """Load host-only cache that idle workflows are predicted to read next (decode-only
        iterations and idle time only, within the PCIe bandwidth of that time)."""
        if not self.prefetch.enabled or seconds <= 0:
            return
        budget = self.cost.pcie_tokens(seconds)
        tree = self.tree
        candidates = {}
        for wf_id in itertools.chain(self.live, self.finished):
            if wf_id in self.running:
                continue
            for node_id in self.ledger.nodes_of.get(wf_id, ()):
                node = tree.by_id.get(node_id)
                if node is not None and not node.on_gpu:
                    candidates[node_id] = node
        for node in self.prefetch.rank(list(candidates.values())):
            if budget <= 0:
                break
            if node.on_gpu or node.parent is None:
                continue
            path = [node]
            while not path[-1].parent.on_gpu:
                path.append(path[-1].parent)
            path.reverse()
            need = sum(n.num_tokens for n in path)
            if need > budget:
                continue
            anchor = path[0].parent
            tree.lock(anchor)  # keep the path's GPU ancestor while making room
            if tree.gpu_free() < need:
                tree.evict_gpu(need - tree.gpu_free(), allow=self.prefetch.may_evict)
            tree.unlock(anchor)
            if tree.gpu_free() < need:
                continue
            tree.load_back(path)
            budget -= need
            self.counters.prefetched_tokens += need
            for n in path:
                self.prefetched[n.id] = n.num_tokens


def summarize(counters: Counters, makespan: float, n_calls: int) -> dict:
    c = counters
    return {
        **replay_metrics(gpu_hit_tokens=c.gpu_hit_tokens, host_hit_tokens=c.host_hit_tokens,
                         prompt_tokens=c.prompt_tokens, workflow_latencies=c.latencies, ttfts=c.ttfts,
                         calls=n_calls, makespan_s=makespan),
        "recomputed_tokens": c.recomputed_tokens,
        "prefetch_precision": c.prefetch_used_tokens / c.prefetched_tokens if c.prefetched_tokens else None,
        "prefetched_tokens": c.prefetched_tokens,
        "kv_tokens_read": c.kv_tokens_read,
        "predictor_calls": c.predictor_calls,
        "ended_by_signal": c.ended_by_signal,
        "ended_by_timeout": c.ended_by_timeout,
        "live_timeouts": c.live_timeouts,
    }


def simulate(workflows: list[SimWorkflow], config: SimConfig, cost: CostModel, **policy) -> dict:
    fresh = [SimWorkflow(w.id, w.order, w.task, w.calls) for w in workflows]  # runs mutate progress
    sim = Simulator(fresh, config, cost, **policy)
    counters = sim.run()
    return summarize(counters, sim.now, sum(len(w.calls) for w in workflows))
