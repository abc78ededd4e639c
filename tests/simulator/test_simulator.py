"""The simulator: tree invariants under random operations (hypothesis), end-to-end invariants
and determinism of whole replays."""

import math

import numpy as np
import torch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.generators import Hover, SweBench
from serving_integration.simulator.cost_model import CostModel
from serving_integration.cache.policies import POLICIES
from serving_integration.cache.predictions import AgentStepGraph, ModelSource, NoisySource, PerfectSource, vocabulary
from serving_integration.simulator.radix import RadixTree, audit
from serving_integration.cache.workload import SimCall, SimWorkflow, prefix_keys, workflows_from_rows
from serving_integration.simulator.engine import INF, LPM_QUEUE_MAX, Server, SimConfig, Simulator, bound_metrics, simulate

H100 = CostModel("test-h100", params=14.8e9, layers=40, q_heads=40, kv_heads=8, head_dim=128, dtype_bytes=2,
                 peak_flops=989e12, mem_bandwidth=3.35e12, pcie_bandwidth=64e9)

ops = st.lists(st.tuples(st.sampled_from(["insert", "match", "unlock", "evict", "evict_host"]),
                         st.lists(st.integers(0, 3), min_size=1, max_size=6),
                         st.integers(1, 30)), max_size=60)


@settings(max_examples=150, deadline=None, derandomize=True)  # the same examples in every run (CI)
@given(ops=ops, gpu=st.integers(20, 60), host=st.integers(0, 80), partial=st.booleans())
def test_tree_invariants_under_random_operations(ops, gpu, host, partial):
    tree = RadixTree(gpu, host, partial_eviction=partial)
    locked = []
    for op, units, n in ops:
        lens = [1 + u for u in units]  # units carry different token counts
        if op == "insert":
            need = sum(lens)
            if tree.gpu_free() < need:
                tree.evict_gpu(need - tree.gpu_free())
            if tree.gpu_free() >= need:  # the caller holds the tokens privately first
                tree.private_gpu += need
                tree.insert(units, lens)
                tree.private_gpu -= need
        elif op == "match":
            path = tree.match(units, lens)
            host_only = sum(x.num_tokens for x in path if not x.on_gpu)
            if path and host_only <= tree.gpu_free():
                tree.lock(path[-1])
                tree.load_back(path)
                locked.append(path[-1])
        elif op == "unlock" and locked:
            tree.unlock(locked.pop(n % len(locked)))
        elif op == "evict":
            before = {x.id for x in tree.nodes() if x.lock_ref}
            evicted = tree.evict_gpu(n)
            assert not any(x.id in before for x in evicted), "a locked node was evicted"
        elif op == "evict_host":
            tree.evict_host(n)
        audit(tree)
        assert all(x.on_gpu and x.lock_ref > 0 for x in locked)


class AuditedSimulator(Simulator):
    """Checks the invariants after every scheduler step (admissions included) and every finished call."""

    def _step(self, server, next_event):
        super()._step(server, next_event)
        audit(server.tree)
        for r in [*server.prefilling, *server.decoding]:
            assert r.gpu_hit + r.host_hit + r.miss == r.call.prompt_tokens
            assert 0 <= r.gpu_hit and 0 <= r.host_hit and 0 <= r.miss

    def _finish(self, r):
        super()._finish(r)
        audit(self.tree)


def small_workload(kind, n, seed):
    traces = (Hover if kind == "hover" else SweBench)().generate(n, seed)
    return workflows_from_rows(traces.calls)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["hover", "swebench"]), seed=st.integers(0, 1000),
       gpu=st.integers(70_000, 200_000), concurrency=st.integers(1, 12),
       policy=st.sampled_from(["lru", "lfu", "tlru", "pbkv_lae", "pbkv", "kvflow", "kvflow_ideal", "kvflow_nolae",
                               "continuum", "lru_prefetch", "fifo", "slru", "oracle", "pbkv_time"]),
       prefetch=st.sampled_from(["none", "conservative", "aggressive", "kvflow", "last_call"]),
       page=st.sampled_from([1, 16]), scheduling=st.sampled_from(["fcfs", "program_fcfs", "lpm", "hrrn", "spf"]),
       end=st.sampled_from([(0.0, 0.0, None), (2.0, 0.0, None), (1.0, 0.5, 30.0), (0.0, 1.0, 3.0)]),  # None: never
       partial=st.booleans())
def test_replay_invariants(kind, seed, gpu, concurrency, policy, prefetch, page, scheduling, end, partial):
    workflows = small_workload(kind, 12, seed)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    gpu = max(gpu, max(c.prompt_tokens + c.output_tokens for w in workflows for c in w.calls))  # every call fits
    if policy.startswith("kvflow"):
        source = AgentStepGraph((Hover if kind == "hover" else SweBench)().agent_graph(), 3, names)
    else:
        source = PerfectSource(names, 3)
    uses = policy in ("pbkv", "kvflow", "kvflow_ideal", "kvflow_nolae", "oracle", "pbkv_time") or prefetch != "none"
    delay, loss, timeout = end
    config = SimConfig(gpu_tokens=gpu, concurrency=concurrency, page_size=page, end_signal_delay_s=delay,
                       end_signal_loss=loss, inactivity_timeout_s=timeout, seed=seed, scheduling=scheduling,
                       partial_eviction=partial)
    sim = AuditedSimulator(workflows, config, H100, policy=policy, prefetch=prefetch, predictions=source if uses else None)
    counters = sim.run()
    assert counters.ended_by_signal + counters.ended_by_timeout + len(sim.finished) == len(workflows)
    assert counters.gpu_hit_tokens + counters.host_hit_tokens + counters.miss_tokens == counters.prompt_tokens
    assert counters.prompt_tokens == sum(c.prompt_tokens for w in workflows for c in w.calls)
    assert len(counters.latencies) == len(workflows) and all(x > 0 for x in counters.latencies)
    assert counters.prefetch_used_tokens <= counters.prefetched_tokens
    # an admission is made only where eviction can free what it asks
    assert counters.evicted_gpu_tokens >= counters.eviction_requested_tokens
    assert sim.tree.private_gpu == 0 and not any(x.lock_ref for x in sim.tree.nodes())
    bounds = bound_metrics(sim)  # the run's own bounds: GPU hits (with prefetch, the prefetch-aware one), recompute
    gpu_rate = counters.gpu_hit_tokens / counters.prompt_tokens
    miss_rate = counters.miss_tokens / counters.prompt_tokens
    assert gpu_rate <= bounds["bound_hit_rate" if prefetch == "none" else "bound_prefetch_hit_rate"]
    assert miss_rate >= bounds["bound_recompute_rate"] - 1e-12
    # a workflow's latency is its tool time, admission wait, and the prefill, decode and PCIe time it ran through
    split = (counters.time_tool_s + counters.time_queue_s + counters.time_prefill_s + counters.time_decode_s
             + counters.time_pcie_s + counters.time_predictor_s)
    assert split == pytest.approx(sum(counters.latencies), rel=1e-9)


def test_partial_eviction_frees_a_victims_tail_and_keeps_the_rest_in_its_place():
    """sim.partial_eviction: a victim node gives up the fewest whole units of its tail that free
    the tokens asked for; its prefix stays matchable and keeps the victim's access time (it is
    not made recent by the split). Without it the whole node goes, as in SGLang."""
    def tree_with(partial):
        tree = RadixTree(100, partial_eviction=partial)
        for units in (["a", "b", "c"], ["x"]):  # a-b-c older than x
            tree.private_gpu += 10 * len(units)
            tree.insert(units, [10] * len(units))
            tree.private_gpu -= 10 * len(units)
        return tree

    whole, partial = tree_with(False), tree_with(True)
    assert [n.num_tokens for n in whole.evict_gpu(5)] == [30]
    assert [n.num_tokens for n in partial.evict_gpu(5)] == [10]  # only c
    assert partial.peek(["a", "b", "c"]) == (2, 2) and whole.peek(["a", "b", "c"]) == (0, 0)
    assert [n.units for n in partial.evict_gpu(15)] == [("a", "b")]  # still older than x: evicted next, whole
    assert partial.peek(["x"]) == (1, 1)
    audit(partial)


def test_same_input_same_summary():
    workflows = small_workload("hover", 40, 1)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    config = SimConfig(gpu_tokens=120_000, concurrency=8)
    from serving_integration.cache.predictions import NoisySource

    runs = [simulate(workflows, config, H100, policy="pbkv", prefetch="conservative",
                     predictions=NoisySource(PerfectSource(names, 3), 0.3, seed=5)) for _ in range(2)]
    assert runs[0] == runs[1]
    other = simulate(workflows, config, H100, policy="pbkv", prefetch="conservative",
                     predictions=NoisySource(PerfectSource(names, 3), 0.3, seed=6))
    assert other != runs[0]


def test_a_request_overhead_delays_each_call_and_counts_in_its_ttft_and_queue_time():
    """request_overhead_s (HTTP, tokenization): every call reaches the server that much after its
    workflow issued it; one workflow alone, so nothing else moves: each TTFT and the queue time grow
    by it, the latency by it per call, and the cache sees the same calls."""
    import dataclasses

    workflows = small_workload("hover", 1, 3)
    calls = len(workflows[0].calls)
    config = SimConfig(gpu_tokens=120_000, concurrency=1)
    base = simulate(workflows, config, H100, bound=False)
    slow = simulate(workflows, config, dataclasses.replace(H100, request_overhead_s=0.25), bound=False)
    assert slow["mean_workflow_latency_s"] == pytest.approx(base["mean_workflow_latency_s"] + 0.25 * calls)
    assert slow["mean_ttft_s"] == pytest.approx(base["mean_ttft_s"] + 0.25)
    assert slow["time_queue_s"] == pytest.approx(base["time_queue_s"] + 0.25 * calls)
    assert slow["hit_rate"] == base["hit_rate"] and slow["recomputed_tokens"] == base["recomputed_tokens"]


def test_a_replay_collects_cycles_less_often_and_gives_the_same_summary(monkeypatch):
    import gc

    from serving_integration.simulator import engine

    workflows = small_workload("hover", 30, 2)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    config = SimConfig(gpu_tokens=60_000, concurrency=8)
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    seen, frozen = [], []
    run = engine.Simulator._replay
    monkeypatch.setattr(engine.Simulator, "_replay",
                        lambda self: (seen.append(gc.get_threshold()), frozen.append(gc.get_freeze_count()), run(self))[2])
    raised = simulate(workflows, config, H100, policy="pbkv", predictions=PerfectSource(names, 3))
    assert seen == [(engine.REPLAY_GC_THRESHOLD, *before[1:])] and gc.get_threshold() == before
    # what existed before the replay (this test's modules, pytest's) is left out of its collections,
    # and handed back to the collector after it
    assert frozen[0] > 1000 and gc.get_freeze_count() == 0
    monkeypatch.setattr(engine, "REPLAY_GC_THRESHOLD", 0)  # the default collector's
    assert simulate(workflows, config, H100, policy="pbkv", predictions=PerfectSource(names, 3)) == raised
    assert seen[-1] == before
    with engine.fewer_collections():  # nested (simulate's own block inside): only the outer one undoes
        simulate(workflows, config, H100, policy="lru")
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), engine.fewer_collections():
        raise RuntimeError("a failing replay")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0  # restored whatever happens


def test_a_server_is_driven_from_outside_and_never_calls_back():
    """A replica runs without a Simulator: handed a call, then steps, it returns the completed call;
    the workflow's next call (the first's prompt, its output and a tool result) then hits the
    cache the first one left: prompt and output, 900 tokens, on the GPU."""
    first = SimCall("coder", ("sys", "task"), (500, 300), prefix_keys(("sys", "task")), "out0", 100, 0.0, None)
    units = ("sys", "task", "out0", "tool0")
    second = SimCall("coder", units, (500, 300, 100, 50), prefix_keys(units), "out1", 20, 1.5, None)
    wf = SimWorkflow("w", 0, "task", [first, second])
    config = SimConfig(gpu_tokens=10_000)
    server = Server(config, H100, config.gpu_tokens, "lru", None, "none", 0.5)
    assert not any(isinstance(v, Simulator) for v in vars(server).values())
    for call in wf.calls:
        server.receive(server.now + call.tool_time, wf, ())
        done = []
        while not done:
            done = server.step(INF, ())
        assert [r.call for r in done] == [call] and not server.busy
        server.finish(done[0])
        wf.next_call += 1
    assert [(r.gpu_hit, r.host_hit, r.miss) for r in server.trace[::2]] == [(0, 0, 800), (900, 0, 50)]
    assert server.counters.gpu_hit_tokens == 900 and server.tree.private_gpu == 0 and not server.running


def test_program_fcfs_admits_the_earliest_started_program_first():
    """sim.scheduling=program_fcfs (Continuum's): a waiting call of a program started earlier goes
    ahead of calls that arrived before it; fcfs keeps arrival order."""
    def call(name):
        return SimCall("coder", (name,), (100,), prefix_keys((name,)), f"{name}/out", 10, 0.0, None)

    for scheduling, order in (("fcfs", ["late", "middle", "early"]), ("program_fcfs", ["early", "middle", "late"])):
        config = SimConfig(gpu_tokens=10_000, scheduling=scheduling)
        server = Server(config, H100, config.gpu_tokens, "lru", None, "none", 0.5)
        for started, name in ((5.0, "late"), (3.0, "middle"), (1.0, "early")):
            wf = SimWorkflow(name, 0, "task", [call(name)])
            wf.start_time = started
            server.receive(6.0, wf, ())
        assert [r.wf.id for r in server.waiting] == order, scheduling


def cached(server: Server, units: tuple, lens: tuple) -> None:
    """Put a finished prompt's KV in the server's tree (the caller's private tokens, inserted)."""
    server.tree.private_gpu += sum(lens)
    server.tree.insert(units, lens)
    server.tree.private_gpu -= sum(lens)


def waiting_call(server: Server, name: str, units: tuple, lens: tuple, at: float) -> None:
    call = SimCall("coder", units, lens, prefix_keys(units), f"{name}/out", 10, 0.0, None)
    server.receive(at, SimWorkflow(name, 0, "task", [call]), ())


def test_eviction_counters_show_what_whole_node_eviction_frees_beyond_the_need():
    """An admission 5 tokens short of room evicts the oldest leaf, a 3-unit, 300-token context:
    whole-node eviction frees all 300 (overshoot 60), partial eviction the one 100-token unit of
    its tail that covers the 5 (overshoot 20); both count the 5 asked for."""
    for partial, evicted in ((False, 300), (True, 100)):
        config = SimConfig(gpu_tokens=1_000, partial_eviction=partial)
        server = Server(config, H100, config.gpu_tokens, "lru", None, "none", 0.5)
        cached(server, ("a", "b", "c"), (100, 100, 100))
        cached(server, ("x",), (600,))
        waiting_call(server, "w", ("new",), (95,), 0.0)  # 95 + 10 output tokens: 5 more than the 100 free
        server.step(INF, ())
        c = server.counters
        assert (c.eviction_requested_tokens, c.evicted_gpu_tokens) == (5, evicted), partial
        assert server.tree.peek(["x"]) == (1, 1)  # the newer leaf stays


def test_lpm_admits_the_longest_cached_prefix_first_and_defers_a_shared_uncached_one():
    """sim.scheduling=lpm (SGLang's): before admitting, the queue is sorted by cached prefix tokens,
    longest first, stably; of two calls with almost nothing cached that share 32+ tokens, the later
    one goes last (SGLang's in-batch prefix caching); fcfs keeps arrival order."""
    for scheduling, order in (("fcfs", ["none", "short", "long", "twin_a", "twin_b"]),
                              ("lpm", ["long", "short", "none", "twin_a", "twin_b"])):
        config = SimConfig(gpu_tokens=100_000, scheduling=scheduling, max_running_requests=1)
        server = Server(config, H100, config.gpu_tokens, "lru", None, "none", 0.5)
        cached(server, ("sys", "doc"), (100, 400))
        waiting_call(server, "none", ("other",), (300,), 1.0)
        waiting_call(server, "short", ("sys", "q1"), (100, 50), 2.0)
        waiting_call(server, "long", ("sys", "doc", "q2"), (100, 400, 50), 3.0)
        waiting_call(server, "twin_a", ("manual", "a"), (64, 10), 4.0)
        waiting_call(server, "twin_b", ("manual", "b"), (64, 10), 5.0)
        server._admit()
        admitted = [r.wf.id for r in server.prefilling]
        assert admitted + [r.wf.id for r in server.waiting] == order if scheduling == "fcfs" else \
            admitted == order[:1], scheduling
        if scheduling == "lpm":  # twin_b shares 64 uncached tokens with twin_a, which waits before it
            assert [r.wf.id for r in server.waiting] == ["short", "none", "twin_a", "twin_b"]
            server.waiting.rotate(-1)  # twin_b ahead of none and twin_a: the next sort still defers it
            server.waiting.rotate(-1)
            server._cache_aware_order()
            assert [r.wf.id for r in server.waiting] == ["short", "twin_a", "none", "twin_b"]


def test_hrrn_admits_the_highest_response_ratio_first():
    """sim.scheduling=hrrn (SGLang's): the queue sorted by prompt tokens the server prefilled while
    a call waited, per token the call must prefill itself, highest first; ties in queue order."""
    config = SimConfig(gpu_tokens=100_000, scheduling="hrrn", max_running_requests=1)
    server = Server(config, H100, config.gpu_tokens, "lru", None, "none", 0.5)
    cached(server, ("sys", "doc"), (100, 400))
    waiting_call(server, "old_uncached", ("other",), (301,), 1.0)  # 300 uncached (the last token is always)
    server.prefilled_tokens = 500
    waiting_call(server, "cached", ("sys", "doc", "q"), (100, 400, 20), 2.0)  # 21 uncached
    server.prefilled_tokens = 600  # ratios: 600 / 301, 100 / 21, 0 / 50
    waiting_call(server, "new", ("fresh",), (50,), 3.0)
    server._cache_aware_order()
    assert [r.wf.id for r in server.waiting] == ["cached", "old_uncached", "new"]
    server.prefilled_tokens = 10_000  # 10000 / 301 = 33, 9500 / 21 = 452, 9400 / 50 = 188
    server._cache_aware_order()
    assert [r.wf.id for r in server.waiting] == ["cached", "new", "old_uncached"]
    server.waiting[2].queued_at_prefilled = -200_000  # 210000 / 301 = 698: waited long enough to go first
    server._cache_aware_order()
    assert [r.wf.id for r in server.waiting] == ["old_uncached", "cached", "new"]


def test_spf_admits_the_fewest_tokens_to_prefill_first_and_caps_a_chunked_prefill_for_them():
    """sim.scheduling=spf (SGLang's shortest-prefill-first): the queue sorted by the tokens each call
    must prefill (prompt less cached prefix), fewest first, ties by arrival, and sorted above 128
    waiting calls too. When the call at the head is part-way through its prefill, the calls behind
    it shorter than what it has left reserve their tokens (page rounded) in the iteration's budget
    while they fit in the budget less a page, and the head's chunk takes the rest."""
    config = SimConfig(gpu_tokens=100_000, scheduling="spf", max_running_requests=1)
    server = Server(config, H100, config.gpu_tokens, "lru", None, "none", 0.5)
    cached(server, ("sys", "doc"), (100, 400))
    waiting_call(server, "uncached", ("other",), (300,), 1.0)  # 300 to prefill
    waiting_call(server, "cached", ("sys", "doc", "q"), (100, 400, 20), 2.0)  # 20
    waiting_call(server, "tie", ("fresh",), (20,), 3.0)  # 20 as well, later
    waiting_call(server, "short", ("sys", "q2"), (100, 10), 4.0)  # 10
    for n in range(LPM_QUEUE_MAX):
        waiting_call(server, f"filler{n}", (f"f{n}",), (400,), 5.0 + n)
    server._cache_aware_order()
    assert [r.wf.id for r in server.waiting][:4] == ["short", "cached", "tie", "uncached"]

    config = SimConfig(gpu_tokens=100_000, scheduling="spf", max_prefill_tokens=1000, page_size=16)
    server = Server(config, H100, config.gpu_tokens, "lru", None, "none", 0.5)
    waiting_call(server, "long", ("long",), (3000,), 0.0)
    server._admit()
    server._prefill_iteration()  # nothing behind it: a full chunk of 1000
    assert server.prefilling[0].prefill_left == 2000
    for name, tokens in (("mid", 500), ("small", 100), ("longer", 2500)):
        waiting_call(server, name, (name,), (tokens,), 1.0)
    server._admit()
    # small and mid are shorter than the 2000 long has left: they reserve 112 + 512 page-rounded
    # tokens, long's chunk is (1000 - 624) // 16 * 16 = 368, and longer gets the 32 left over
    server._prefill_iteration()
    left = {r.wf.id: r.prefill_left for r in server.prefilling}
    assert left == {"long": 2000 - 368, "longer": 2500 - 32} and server.prefilling[0].wf.id == "long"
    fcfs = Server(SimConfig(gpu_tokens=100_000, max_prefill_tokens=1000, page_size=16), H100, 100_000, "lru",
                  None, "none", 0.5)
    waiting_call(fcfs, "long", ("long",), (3000,), 0.0)
    fcfs._admit()
    fcfs._prefill_iteration()
    waiting_call(fcfs, "small", ("small",), (100,), 1.0)
    fcfs._admit()
    fcfs._prefill_iteration()  # fcfs: the head takes the whole budget
    assert [r.prefill_left for r in fcfs.prefilling] == [1000, 100]


def test_a_call_that_cannot_fit_evicts_nothing():
    """As SGLang's PrefillAdder: free + evictable tokens are checked before any eviction, so a call
    that would not fit even in an emptied cache leaves the cache whole, and waits."""
    config = SimConfig(gpu_tokens=1_000)
    server = Server(config, H100, config.gpu_tokens, "lru", None, "none", 0.5)
    cached(server, ("doc",), (400,))  # the least recently used
    cached(server, ("sys",), (100,))
    server.tree.private_gpu += 300  # a running call's tokens
    waiting_call(server, "big", ("other",), (400,), 1.0)  # needs 410: 200 free + 500 evictable would do
    waiting_call(server, "huge", ("more",), (800,), 1.0)
    server._admit()
    assert [r.wf.id for r in server.prefilling] == ["big"] and server.tree.gpu_used == 100  # doc evicted
    server.tree.private_gpu -= 300
    cached_before = server.tree.gpu_used
    assert not server.try_admit(server.waiting[0])  # 810 > 490 free + 100 evictable: nothing evicted
    assert server.tree.gpu_used == cached_before == 100
    audit(server.tree)


def test_too_small_gpu_is_a_clear_error():
    workflows = small_workload("swebench", 3, 0)
    with pytest.raises(ValueError, match="raise sim.gpu_tokens"):
        simulate(workflows, SimConfig(gpu_tokens=2_000, concurrency=2), H100, policy="lru")


def test_more_memory_helps_lru_and_the_oracle_beats_it():
    workflows = small_workload("hover", 60, 2)
    small = simulate(workflows, SimConfig(gpu_tokens=80_000, concurrency=16), H100, policy="lru")
    large = simulate(workflows, SimConfig(gpu_tokens=1_000_000, concurrency=16), H100, policy="lru")
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    oracle = simulate(workflows, SimConfig(gpu_tokens=80_000, concurrency=16), H100, policy="oracle",
                      predictions=PerfectSource(names, 3))
    assert large["hit_rate"] > small["hit_rate"]
    assert oracle["hit_rate"] >= small["hit_rate"]
    assert large["recomputed_tokens"] == 0  # nothing is ever evicted
    assert math.isclose(large["hit_rate"] + (large["host_hit_tokens"] + large["miss_tokens"]) / large["prompt_tokens"], 1)


class RetirementLog(Simulator):
    """Records when each workflow's last call finished and when the cache retired it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.done_at, self.retired_at = {}, {}
        end = self.ledger.end

        def logged_end(workflow):
            self.retired_at.setdefault(workflow, self.servers[0].now)
            return end(workflow)

        self.ledger.end = logged_end

    def _end_of_workflow(self, wf, server):
        self.done_at[wf.id] = server.now
        super()._end_of_workflow(wf, server)


def test_end_signal_arrives_after_the_last_call_and_lost_ones_time_out():
    workflows = small_workload("hover", 30, 2)
    names = vocabulary(c.agent for w in workflows for c in w.calls)

    def run(**end):
        fresh = [SimWorkflow(w.id, w.order, w.task, w.calls) for w in workflows]
        sim = RetirementLog(fresh, SimConfig(gpu_tokens=150_000, concurrency=6, **end), H100,
                            policy="pbkv", predictions=PerfectSource(names, 3))
        sim.run()
        return sim

    now = run()
    assert now.counters().ended_by_signal == len(workflows)
    assert all(now.retired_at[w] == now.done_at[w] for w in now.done_at)
    late = run(end_signal_delay_s=4.0)
    ended = [w for w in late.done_at if w in late.retired_at]
    assert ended and all(late.retired_at[w] >= late.done_at[w] + 4.0 for w in ended)
    assert all(late.retired_at[w] - late.done_at[w] < 4.0 + 1.0 for w in ended)  # within an iteration or so
    half = run(end_signal_delay_s=1.0, end_signal_loss=0.5, inactivity_timeout_s=1e9, seed=3)
    assert 5 < len(half.lost_signal) < 25 and half.lost_signal == run(end_signal_loss=0.5, seed=3).lost_signal
    assert not any(w in half.retired_at for w in half.lost_signal)  # nothing retires them within the run
    assert half.counters().ended_by_timeout == 0 and half.counters().ended_by_signal <= len(workflows) - len(half.lost_signal)
    timed = run(end_signal_loss=1.0, inactivity_timeout_s=5.0)
    assert timed.counters().ended_by_signal == 0 and timed.counters().ended_by_timeout > 0
    assert all(timed.retired_at[w] >= timed.done_at[w] + 5.0 for w in timed.done_at if w in timed.retired_at)
def test_adversarial_noise_misleads_always_and_accuracy_trust_recovers():
    from serving_integration.cache.predictions import NoisySource

    workflows = small_workload("hover", 60, 3)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    adversarial = NoisySource(PerfectSource(names, 3), 1.0, seed=0, kind="adversarial")
    live = [Simulator([w], SimConfig(), H100).workflows[0] for w in workflows[:5]]
    for w in live:
        w.next_call = 1
    probs = adversarial.predict(live)
    truth = PerfectSource(names, 3).predict(live)
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:2], dtype=probs.dtype))
    assert float((probs * truth).sum()) == 0.0  # no mass on what comes next
    with pytest.raises(ValueError, match="noise_kind"):
        NoisySource(PerfectSource(names, 3), 0.5, seed=0, kind="gaussian")
    config = SimConfig(gpu_tokens=150_000, concurrency=16)
    run = lambda trust: simulate(workflows, config, H100, policy="pbkv", policy_options={"trust": trust},
                                 predictions=NoisySource(PerfectSource(names, 3), 1.0, seed=0, kind="adversarial"))
    always, accuracy = run("always"), run("accuracy")
    lae = simulate(workflows, config, H100, policy="pbkv_lae")
    assert accuracy["trust_switches"] >= 1 and not accuracy["trusted_at_end"] and accuracy["prediction_quality"] < 0.1
    assert always["hit_rate"] < lae["hit_rate"] - 0.01  # misled by the noise
    assert accuracy["hit_rate"] >= lae["hit_rate"] - 0.01


def test_online_backoff_learns_served_transitions_and_new_agents():
    from types import SimpleNamespace

    from serving_integration.cache.predictions import OnlineBackoff, tell_finished

    class Stubborn:  # a trained predictor that always says "planner" next, and knows no "auditor"
        agent_names, horizon = ["<unk>", "coder", "planner"], 2

        def predict(self, workflows):
            probs = torch.zeros(len(workflows), 2, 4)
            probs[:, :, 2] = 1.0
            return probs

    source = OnlineBackoff(Stubborn(), beta=2.0)
    for i in range(30):  # served workflows: coder -> auditor -> END
        w = SimpleNamespace(id=f"w{i}", agents=["coder"])
        source.predict([w])
        w.agents.append("auditor")
        source.predict([w])
        tell_finished(source, w)
    assert source.agent_names == ["<unk>", "coder", "planner", "auditor"]  # grown in place
    probs = source.predict([SimpleNamespace(id="new", agents=["coder"])])
    assert probs.shape == (1, 2, 5) and torch.allclose(probs.sum(-1), torch.ones(1, 2, dtype=probs.dtype))
    assert probs[0, 0, 3] > 0.9  # auditor next, learnt while serving
    assert probs[0, 1, 4] > 0.9  # then END
    assert source.weights[1] > 0.9 and source.observed >= 30
    # the simulator folds finished workflows in too
    workflows = small_workload("swebench", 20, 0)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    online = OnlineBackoff(AgentStepGraph.from_traces([["planner", "coder"]], 3))
    simulate(workflows, SimConfig(gpu_tokens=300_000, concurrency=4), H100, policy="pbkv", predictions=online)
    assert online.observed > 0 and set(names[1:]) <= set(online.agent_names)


def test_online_backoff_scores_an_agent_unknown_at_prediction_as_given_no_probability():
    """The experts' rows of a prediction end with END's column; an agent first seen after it (its
    column is the next one) was given nothing by either, so the weights only take the fixed share."""
    from types import SimpleNamespace

    from serving_integration.cache.predictions import OnlineBackoff

    class HalfEnd:  # "planner" or END next, half each
        agent_names, horizon = ["<unk>", "coder", "planner"], 1

        def predict(self, workflows):
            probs = torch.zeros(len(workflows), 1, 4)
            probs[:, :, 2] = probs[:, :, 3] = 0.5
            return probs

    source = OnlineBackoff(HalfEnd(), beta=2.0)
    for i in range(5):  # served: coder -> planner, so the backoff expert gives END less than the model
        w = SimpleNamespace(id=f"w{i}", agents=["coder"])
        source.predict([w])
        w.agents.append("planner")
        source.predict([w])
    w = SimpleNamespace(id="x", agents=["coder"])
    source.predict([w])
    before = source.weights
    w.agents.append("auditor")  # neither expert knew it when they predicted
    source.predict([w])
    assert source.agent_names[-1] == "auditor"
    assert np.allclose(source.weights, (1 - source.share) * before + source.share / 2, rtol=0, atol=1e-12)


def test_online_backoff_mixes_as_the_arrays_formula_to_the_bit():
    """OnlineBackoff works row by row in Python floats: its predictions and weights are, to the bit,
    the arrays' (model padded with zero columns for agents it never saw, the Dirichlet posterior
    (n_k(a, .) + beta P^(k)) / (n_k(a) + beta) where a has counts, the weights' mixture), and its
    weights those of numpy's exp and log over the experts' probabilities of each next agent."""
    from types import SimpleNamespace

    from serving_integration.cache.predictions import OnlineBackoff, tell_finished

    rng = np.random.default_rng(7)

    class Random:  # a trained predictor over three agents, horizon 3, random rows
        agent_names, horizon = ["<unk>", "coder", "planner"], 3

        def predict(self, workflows):
            probs = rng.dirichlet(np.ones(4), size=(len(workflows), 3)).astype(np.float32)
            return torch.from_numpy(probs)

    def reference(source, workflows, model):
        names, n = source.agent_names, len(source.agent_names)
        out = np.zeros((len(workflows), 3, n + 1))
        out[..., :3] = model[..., :-1]
        out[..., n] = model[..., -1]
        posterior = out.copy()
        for b, w in enumerate(workflows):
            for k in range(3):
                seen = source.counts.get((w.agents[-1], k + 1))
                if seen:
                    counts = np.zeros(n + 1)
                    for nxt, c in seen.items():
                        counts[n if nxt is None else source.index[nxt]] = c
                    posterior[b, k] = (counts + source.beta * out[b, k]) / (counts.sum() + source.beta)
        w = np.exp(source.log_weight - source.log_weight.max())
        w = w / w.sum()
        firsts = [tuple({**dict(zip(names, p[b, 0, :n].tolist())), None: float(p[b, 0, n])} for p in (out, posterior))
                  for b in range(len(workflows))]  # each expert's P^(1), scored when the next call comes
        return w[0] * out + w[1] * posterior, firsts

    source, log_weight = OnlineBackoff(Random(), beta=1.5, share=0.02), np.zeros(2)
    agents = ["coder", "planner", "auditor", "tester"]  # two the model never saw
    live = [SimpleNamespace(id=f"w{i}", agents=[agents[i % 2]]) for i in range(6)]
    scored, score = [], source._score
    source._score = lambda *args: (scored.append(args), score(*args))  # the experts' P^(1) and the agent that came
    checked = 0
    for step in range(40):
        batch = [w for w in live if rng.random() < 0.6] or live[:1]
        state = rng.bit_generator.state
        model = source.inner.predict(batch).numpy().astype(np.float64)
        rng.bit_generator.state = state
        probs = source.predict(batch)
        for model_p1, backoff_p1, nxt in scored:  # numpy's weights, from what each expert gave each next agent
            log_weight = log_weight + np.log(np.maximum([model_p1.get(nxt, 0.0), backoff_p1.get(nxt, 0.0)], 1e-6))
            e = np.exp(log_weight - log_weight.max())
            log_weight = np.log((1 - source.share) * (e / e.sum()) + source.share / 2)
        scored.clear()
        assert source.log_weight.tolist() == log_weight.tolist()
        expected, firsts = reference(source, batch, model)
        assert probs.dtype == torch.float64 and probs.numpy().tolist() == expected.tolist()
        assert [source.last[w.id] for w in batch] == firsts
        checked += len(batch)
        for w in batch:
            w.agents.append(agents[int(rng.integers(4))])
            if len(w.agents) > 4 and rng.random() < 0.3:
                tell_finished(source, w)
                live[live.index(w)] = w = SimpleNamespace(id=f"{w.id}+", agents=["coder"])
    assert checked > 100 and source.observed > 50 and sorted(source.agent_names[3:]) == ["auditor", "tester"]


class _PerStep(PerfectSource):
    """The perfect predictor called once per scheduler step, as before tabling."""

    batch_invariant = False


class _ModelPerStep(ModelSource):
    """A trained predictor called once per scheduler step, as before tabling."""

    batch_invariant = False


def test_tabled_predictions_replay_exactly_as_per_step_predictions():
    from models.markov import MarkovPredictor
    from serving_integration.cache.predictions import NoisySource, OnlineBackoff

    workflows = small_workload("hover", 40, 2)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    index = {a: i for i, a in enumerate(names)}
    markov = MarkovPredictor.from_sequences(names, 3, [[index[c.agent] for c in w.calls] for w in workflows], order=1)

    config = SimConfig(gpu_tokens=120_000, concurrency=8)
    for policy, prefetch in (("pbkv", "conservative"), ("oracle", "aggressive"), ("pbkv", "none")):
        tabled = simulate(workflows, config, H100, policy=policy, prefetch=prefetch,
                          predictions=NoisySource(PerfectSource(names, 3), 0.2, seed=3))
        per_step = simulate(workflows, config, H100, policy=policy, prefetch=prefetch,
                            predictions=NoisySource(_PerStep(names, 3), 0.2, seed=3))
        assert tabled == per_step  # every summary field
    source = ModelSource(markov)
    assert source.batch_invariant
    tabled = simulate(workflows, config, H100, policy="pbkv", predictions=OnlineBackoff(source))
    assert source.table is not None and source.table.covers(workflows)
    per_step = simulate(workflows, config, H100, policy="pbkv", predictions=OnlineBackoff(_ModelPerStep(markov)))
    assert tabled == per_step


def test_a_tables_rows_are_those_of_its_folded_predictions_whichever_blocks_it_keeps(monkeypatch):
    """PrefixTable.lookup_rows makes a packed row a list from its block (ROW_BLOCK rows at once,
    the ROW_BLOCKS_KEPT latest kept): in any order of lookups, with blocks dropped and made again,
    each row is the one `ledger_rows` gives from the same predictions folded directly, to the bit."""
    from serving_integration.cache import predictions
    from serving_integration.cache.predictions import PrefixTable, fold, ledger_rows

    monkeypatch.setattr(predictions, "ROW_BLOCK", 3)
    monkeypatch.setattr(predictions, "ROW_BLOCKS_KEPT", 2)
    workflows = small_workload("swebench", 12, 4)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    source = NoisySource(PerfectSource(names, 3), 0.3, seed=1)  # rows of every value, not only one-hot
    table = PrefixTable(source.predict, workflows)
    direct = ledger_rows(fold(table.probs, 0.9), names)
    prefixes = [(w, n) for w in workflows for n in range(1, len(w.calls) + 1)]
    order = np.random.default_rng(0).permutation(len(prefixes)).tolist() + list(range(len(prefixes)))
    for i in order:
        w, n = prefixes[i]
        live = SimWorkflow(w.id, w.order, w.task, w.calls)
        live.next_call = n
        (row,) = table.lookup_rows([live], 0.9, names)
        assert row == direct[i]
        assert [x.hex() for x in row.value] == [x.hex() for x in direct[i].value]
    assert len(table._folded[0.9][2]) == 2  # the blocks kept: no more than ROW_BLOCKS_KEPT


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_policys_priorities_have_one_length(name):
    """The tree's heap entries are flat tuples (*priority, entry number, node), which order as
    (priority, number) only while a policy's priorities all have one length
    (EvictionPolicy.priority): every policy's are, over a replay with evictions on both tiers."""
    workflows = small_workload("hover", 30, 1)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    policy = POLICIES[name]
    kwargs = {}
    if policy.reads_step_graph:
        kwargs["predictions"] = AgentStepGraph(Hover().agent_graph(), 3, names)
    elif policy.uses_predictions:
        kwargs["predictions"] = PerfectSource(names, 3)
    sim = Simulator(workflows, SimConfig(gpu_tokens=40_000, concurrency=8), H100, policy=name, **kwargs)
    lengths = set()
    for server in sim.servers:
        def recorded(node, _priority=server.tree.priority):
            priority = _priority(node)
            lengths.add(len(priority))
            return priority
        server.tree.priority = recorded
    counters = sim.run()
    assert counters.evicted_gpu_tokens > 0
    assert len(lengths) == 1, lengths


def test_pbkv_time_reads_tabled_times_as_per_step_ones():
    """pbkv_time's times come from the table (computed for every prefix before the replay) exactly
    as a per-step source gives them: the perfect source's are the summed tool times of the next K
    calls. A source without times (this Markov fit) leaves the order to the queue and the scores."""
    from models.markov import MarkovPredictor
    from serving_integration.cache.predictions import predict_times

    workflows = small_workload("hover", 40, 2)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    w = SimWorkflow(workflows[0].id, 0, workflows[0].task, workflows[0].calls)
    w.next_call = 1
    gaps = [c.tool_time for c in w.calls[1:4]]
    assert predict_times(PerfectSource(names, 3), [w])[0].tolist() == pytest.approx(
        [sum(gaps[:k]) for k in (1, 2, 3)])
    config = SimConfig(gpu_tokens=120_000, concurrency=8)
    tabled_source = PerfectSource(names, 3)
    tabled = simulate(workflows, config, H100, policy="pbkv_time", predictions=tabled_source)
    assert tabled_source.table.seconds is not None  # read from the table
    assert tabled_source.table._derived  # and the policy's step values made from it (lookup_derived)
    assert tabled == simulate(workflows, config, H100, policy="pbkv_time", predictions=_PerStep(names, 3))
    index = {a: i for i, a in enumerate(names)}
    markov = MarkovPredictor.from_sequences(names, 3, [[index[c.agent] for c in w.calls] for w in workflows], order=1)
    assert predict_times(ModelSource(markov), [w]) is None

    tabled_markov = ModelSource(markov)
    without_times = simulate(workflows, config, H100, policy="pbkv_time", predictions=tabled_markov)
    assert without_times["hit_rate"] > 0 and tabled_markov.table._derived
    assert without_times == simulate(workflows, config, H100, policy="pbkv_time", predictions=_ModelPerStep(markov))


def test_a_tabled_network_replays_as_per_step_up_to_its_float32_rounding():
    """A float32 network's rows move by a few 1e-7 with the batch they share, so a tabled replay
    (evaluate's default, predictor.tabulate) is not bit for bit the per-step one; on this workload
    no decision moves, and the trust meter's running quality differs only in its last digits."""
    import torch

    from models.graph import CallGraph
    from models.graphsage import GraphSAGEPredictor

    workflows = small_workload("hover", 40, 2)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    index = {a: i for i, a in enumerate(names)}
    graph = CallGraph.from_sequences([[index[c.agent] for c in w.calls] for w in workflows], len(names))
    torch.manual_seed(0)
    network = GraphSAGEPredictor(names, 3, graph=graph.to_dict(), dim=16, hidden=32, identity=False).eval()
    config = SimConfig(gpu_tokens=120_000, concurrency=8)
    tabled_source = ModelSource(network, tabulate=True)
    accuracy = {"trust": "accuracy"}  # the trust mode whose summary reads the probabilities themselves
    tabled = simulate(workflows, config, H100, policy="pbkv", prefetch="conservative", predictions=tabled_source,
                      policy_options=accuracy)
    per_step = simulate(workflows, config, H100, policy="pbkv", prefetch="conservative",
                        predictions=ModelSource(network), policy_options=accuracy)
    assert tabled_source.table is not None and tabled_source.table.covers(workflows)
    quality = tabled.pop("prediction_quality"), per_step.pop("prediction_quality")
    assert quality[0] == pytest.approx(quality[1], abs=1e-6)
    tabled.pop("predictor_time_s", None), per_step.pop("predictor_time_s", None)
    assert tabled == per_step


def shared_prefix_workload(n, rereads, max_coder_calls=8, shared=4000, task=200, fresh=2000):
    """A planner call reads a prefix every workflow shares, then 1..8 coder calls follow (perfectly
    predictable). With `rereads` each coder prompt extends the last one, so the branch the score
    keeps for the predicted coder is read again; without it each coder prompt is fresh after the
    workflow's task, so that branch is never re-read, while the shared prefix (whose planner no live
    workflow calls again: score 0) is re-read by every new workflow."""
    workflows = []
    for i in range(n):
        calls = [("planner", ("shared", f"t{i}"), (shared, task))]
        units, lens = (f"t{i}",), (task,)
        for j in range(1 + (i * 7) % max_coder_calls):
            units, lens = ((units if rereads else (f"t{i}",)) + (f"c{i}/{j}",),
                           (lens if rereads else (task,)) + (fresh,))
            calls.append(("coder", units, lens))
        workflows.append(SimWorkflow(f"w{i}", i, "task", [
            SimCall(agent=a, units=u, lens=l, keys=prefix_keys(u), output_unit=f"o{i}/{k}", output_tokens=50,
                    tool_time=0.0 if k == 0 else 0.3 + 0.1 * ((i + k) % 5), hidden=None)
            for k, (a, u, l) in enumerate(calls)]))
    return workflows


def trust_runs(workflows, gpu_tokens, policy):
    names = vocabulary(["planner", "coder"])
    config = SimConfig(gpu_tokens=gpu_tokens, concurrency=8, hicache_ratio=0)
    runs = {"lae": simulate(workflows, config, H100, bound=False, policy="pbkv_lae")}
    for trust in ("always", "accuracy", "outcome"):
        runs[trust] = simulate(workflows, config, H100, bound=False, policy=policy, policy_options={"trust": trust},
                               predictions=PerfectSource(names, 3))
    return runs


@pytest.mark.parametrize("policy", ["pbkv", "pbkv_time"])
def test_outcome_trust_falls_back_where_right_predictions_keep_the_wrong_cache(policy):
    runs = trust_runs(shared_prefix_workload(200, rereads=False), 60_000, policy)
    always, accuracy, outcome, lae = runs["always"]["hit_rate"], runs["accuracy"], runs["outcome"], runs["lae"]["hit_rate"]
    assert always < lae - 0.05  # the score order loses although every prediction is right ...
    assert accuracy["prediction_quality"] == 1.0 and accuracy["trusted_at_end"]  # ... so accuracy keeps it
    assert not outcome["trusted_at_end"] and outcome["trust_switches"] >= 1  # outcome follows lifecycle-aware LRU
    assert outcome["shadow_hit_rate_lae"] > outcome["shadow_hit_rate_pbkv"] + 0.05
    assert outcome["hit_rate"] > always + 0.03
    assert outcome["hit_rate"] > lae - 0.01  # the fallback comes early: within a point of lifecycle-aware LRU
    assert outcome["shadow_hit_rate_pbkv"] == pytest.approx(always, abs=0.01)  # the shadow judged its own order


def test_with_a_host_tier_the_outcome_shadows_see_the_hit_rates_the_real_caches_get():
    """Each shadow is a GPU cache in front of the server's host tier: its hit rate is within a point
    of the real cache's under the same order (it was 3 points above the score's when the shadows
    read a host hit only at the call's finish and left what running calls load back uncharged)."""
    workflows = small_workload("hover", 40, 0)
    names = vocabulary(sorted({c.agent for w in workflows for c in w.calls}))
    config = SimConfig(gpu_tokens=60_000, concurrency=6, hicache_ratio=2.0)
    lae = simulate(workflows, config, H100, bound=False, policy="pbkv_lae")
    always, outcome = (simulate(workflows, config, H100, bound=False, policy="pbkv", policy_options={"trust": trust},
                                predictions=PerfectSource(names, 3)) for trust in ("always", "outcome"))
    assert outcome["trust_switches"] == 0 and outcome["hit_rate"] == always["hit_rate"]  # it followed the score
    assert always["host_hit_tokens"] > 0.1 * always["prompt_tokens"]  # the host tier matters here
    assert abs(outcome["shadow_hit_rate_pbkv"] - always["hit_rate"]) < 0.01
    assert abs(outcome["shadow_hit_rate_lae"] - lae["hit_rate"]) < 0.01


@pytest.mark.parametrize("policy", ["pbkv", "pbkv_time"])
def test_node_unit_shadows_see_the_hit_rate_a_whole_node_tree_gets(policy):
    """With SGLang's whole-node eviction, shadows that evict a leaf key with its node
    (outcome_unit=node) estimate the real tree's hit rate under their order within half a point, and
    closer than key-by-key shadows, which evict as partial eviction does (here 1.1 points above)."""
    workflows = small_workload("swebench", 60, 0)
    names = vocabulary(sorted({c.agent for w in workflows for c in w.calls}))
    config = SimConfig(gpu_tokens=150_000, concurrency=16, hicache_ratio=0)
    error = {}
    for unit in ("key", "node"):  # the judge never decides: both replays follow the order itself
        r = simulate(small_workload("swebench", 60, 0), config, H100, bound=False, policy=policy,
                     predictions=PerfectSource(names, 3),
                     policy_options={"trust": "outcome", "outcome_unit": unit, "outcome_min_calls": 10**9})
        error[unit] = abs(r["shadow_hit_rate_pbkv"] - r["hit_rate"])
    assert error["node"] < 0.005 and error["node"] < error["key"]


@pytest.mark.parametrize("policy", ["pbkv", "pbkv_time"])
def test_outcome_trust_keeps_the_score_where_it_wins(policy):
    runs = trust_runs(shared_prefix_workload(200, rereads=True), 40_000, policy)
    always, outcome, lae = runs["always"]["hit_rate"], runs["outcome"], runs["lae"]["hit_rate"]
    assert always > lae + 0.01
    assert outcome["trusted_at_end"] and outcome["trust_switches"] == 0 and outcome["hit_rate"] == always
