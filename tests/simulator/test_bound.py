"""The offline upper bounds (serving_integration/simulator/bound.py): each at least the exact
optimum of its abstract caching model (eviction only; eviction and prefetch from a host tier
within a PCIe budget per gap; hits in either tier), found by exhaustive search, on small random
instances; never below what a simulator run reaches on its own sequence."""

import dataclasses
import itertools
import math
import random
from functools import lru_cache

import numpy as np
import pytest

from serving_integration.cache.predictions import AgentStepGraph, PerfectSource, vocabulary
from serving_integration.simulator.bound import (MISSED, PREFETCH_LP_COST, _eviction_lp, _prefetch_lp,
                                                 eviction_solution, integer_solution, intervals, row_bounds,
                                                 upper_bound, upper_bounds)
from serving_integration.simulator.engine import SimConfig, simulate
from tests.simulator.test_simulator import H100, small_workload


def random_instance(rng: random.Random, flush: bool = False, slack: int = 6, admit: float = 0.5):
    """Requests over a few keys (outputs are keys later requests may read), admitted and finished
    in a random interleaving (a waiting request is admitted next with probability `admit`); a
    capacity that fits what the running requests hold, plus up to `slack`. With `flush`, one
    request in the middle reads a large key of its own, pushing what was cached off the GPU."""
    n_keys = rng.randint(2, 6) if not flush else rng.randint(3, 5)
    size = {k: rng.randint(1, 4) for k in range(n_keys)}
    requests = []
    for r in range(rng.randint(2, 6) if not flush else rng.randint(3, 6)):
        keys = tuple(rng.sample(range(n_keys), rng.randint(1, min(3, n_keys))))
        out = rng.choice([None, *range(n_keys)])
        if out in keys:
            out = None
        requests.append((keys, tuple(size[k] for k in keys), out, size[out] if out is not None else 0))
    if flush:
        size[n_keys] = rng.randint(4, 8)
        requests.insert(rng.randint(1, len(requests) - 1), ((n_keys,), (size[n_keys],), None, 0))
    events = interleave(rng, requests, admit)
    return events, fitting_capacity(events, size) + rng.randint(0, slack), size


def interleave(rng: random.Random, requests, admit: float) -> list:
    """The requests' (keys, lens, output key, output tokens) admitted in order and finished in a
    random interleaving: a waiting request is admitted next with probability `admit`."""
    events, waiting, running = [], list(range(len(requests))), []
    while waiting or running:
        if waiting and (not running or rng.random() < admit):
            r = waiting.pop(0)
            running.append(r)
            keys, lens, _, out_tokens = requests[r]
            events.append((True, r, keys, lens, None, out_tokens))
        else:
            r = running.pop(rng.randrange(len(running)))
            keys, lens, out, out_tokens = requests[r]
            events.append((False, r, keys, lens, out, out_tokens))
    return events


def fitting_capacity(events, size) -> int:
    """The least capacity that holds what the running requests hold after every event."""
    held = (running_state(events, e) for e in range(len(events)))
    return max(sum(size[k] for k in keys) + outs for keys, outs in held)


def running_state(events, e):
    """(keys held by requests running after event e, their output tokens)."""
    live = {}
    for admit, r, keys, _, _, out_tokens in events[: e + 1]:
        if admit:
            live[r] = (keys, out_tokens)
        else:
            del live[r]
    return {k for keys, _ in live.values() for k in keys}, sum(o for _, o in live.values())


def inserted_before(events) -> list[set]:
    """Per event, the keys some earlier finish inserted (its prompt and output): the only keys a
    cache can hold then."""
    seen: set = set()
    out = []
    for admit, _, keys, _, key_out, _ in events:
        out.append(set(seen))
        if not admit:
            seen.update(keys)
            if key_out is not None:
                seen.add(key_out)
    return out


def held_and_inserted(events) -> list[set]:
    """Per event, the keys a running request holds that a finish inserted before: a read of one is a
    hit (the cache may have kept the inserted copy, locked); one only held privately is a miss."""
    held = [running_state(events, e)[0] for e in range(len(events))]
    return [(held[e - 1] if e else set()) & inserted for e, inserted in enumerate(inserted_before(events))]


def exact_optimum(events, capacity, size, prefix: bool = False) -> int:
    """Most prompt-token hits over every choice of what stays cached after each event: a read hits
    if its key is cached, or held by a running request and inserted by an earlier finish; the cache
    gains keys only when a request finishes (its prompt and output); after every event the cached
    keys plus what running requests hold fit the capacity. No host tier, and unless `prefix`, no
    prefix closure (with it, a read hits only the longest prefix of its keys that would hit, as a
    radix cache's match does: point 4a): a relaxation of the simulator."""
    held = [running_state(events, e) for e in range(len(events))]
    free = held_and_inserted(events)

    @lru_cache(maxsize=None)
    def best(e: int, cached: frozenset) -> int:
        if e == len(events):
            return 0
        admit, _, keys, lens, out, _ = events[e]
        gain = 0
        for k, t in zip(keys, lens) if admit else ():
            if k in cached or k in free[e]:
                gain += t
            elif prefix:
                break
        allowed = sorted(cached if admit else cached | set(keys) | ({out} if out is not None else set()))
        running_keys, outputs = held[e]
        options = []
        for n in range(len(allowed) + 1):
            for keep in itertools.combinations(allowed, n):
                if sum(size[k] for k in set(keep) | running_keys) + outputs <= capacity:
                    options.append(best(e + 1, frozenset(keep)))
        return gain + max(options)

    return best(0, frozenset())


def test_bound_is_at_least_the_exact_optimum():
    rng = random.Random(0)
    tight = 0
    for _ in range(300):
        events, capacity, size = random_instance(rng)
        exact = exact_optimum(events, capacity, size)
        lp = upper_bound(events, capacity)
        assert lp.method == "lp"
        assert lp.hit_tokens >= exact - 1e-9, (events, capacity)
        cheap = upper_bound(events, capacity, max_lp_intervals=0)  # the PFOO-U relaxation bounds the LP
        assert cheap.method in ("pfoo_u", "lp") and cheap.hit_tokens >= lp.hit_tokens - 1e-4  # (the LP adds a tolerance margin)
        tight += abs(lp.hit_tokens - exact) < 1e-3
    assert tight > 150  # and it is not a trivial bound: mostly it is the optimum itself


def closed_lp(events, capacity) -> float:
    """The eviction bound with prefix closure (C) (point 4a), as eviction_solution solves it."""
    free, _, _, _, w, _, x = eviction_solution(events, capacity)
    return free + float(w @ x) if len(w) else free


def test_prefix_closure_cuts_a_key_kept_without_its_prefix():
    # request 0 caches a, b (3 tokens each); request 1 fills the GPU with d; request 2 reads a, b.
    # Beside d only 3 tokens fit: the LP without (C) may keep b alone, but b is a hit only below a
    events = [(True, 0, ("a", "b"), (3, 3), None, 0), (False, 0, ("a", "b"), (3, 3), None, 0),
              (True, 1, ("d",), (4,), None, 0), (False, 1, ("d",), (4,), None, 0),
              (True, 2, ("a", "b"), (3, 3), None, 0), (False, 2, ("a", "b"), (3, 3), None, 0)]
    closure: list = []
    intervals(events, 7, closure_out=closure)
    assert closure == [(1, 0)]  # b's interval below a's
    assert closed_lp(events, 7) == pytest.approx(3, abs=1e-3)
    # request 1 reads e, never accessed before, then a: a misses below it, however much room there is
    events = [(True, 0, ("a",), (3,), None, 0), (False, 0, ("a",), (3,), None, 0),
              (True, 1, ("e", "a"), (1, 3), None, 0), (False, 1, ("e", "a"), (1, 3), None, 0)]
    closure = []
    intervals(events, 10, closure_out=closure)
    assert closure == [(0, MISSED)]
    assert upper_bound(events, 10).hit_tokens == pytest.approx(3, abs=1e-3)  # without (C): a kept
    assert closed_lp(events, 10) == pytest.approx(0, abs=1e-3)


def test_the_integer_search_is_a_bound_between_the_exact_optimum_and_the_lp():
    """bound.integer_solution: the interval model with 0/1 keeps is still a relaxation of caching
    (bound.py, points 1-4a), so its proven dual bound is no lower than the exact optimum of prefix-
    matching reads, and no higher than the LP's; its plan is a 0/1 point of the model (at most the
    dual), and on instances this small the search closes its own gap."""
    rng = random.Random(5)
    closed = 0
    for _ in range(150):
        events, capacity, size = random_instance(rng)
        exact = exact_optimum(events, capacity, size, prefix=True)
        plan, dual = integer_solution(events, capacity, node_limit=1000)
        assert exact <= dual + 1e-6 and plan <= dual + 1e-6, (events, capacity)
        assert dual <= closed_lp(events, capacity) + 1e-3
        closed += abs(dual - plan) < 1e-3
    assert closed > 140


def test_the_integer_search_closes_what_the_lp_keeps_in_fractions():
    # a and b (3 tokens each) wait through a gap where only 2 tokens are free beside the other one's
    # running request: the LP keeps 2/3 of each (4 tokens of hits), no 0/1 plan keeps either
    events = [(True, 0, ("a",), (3,), None, 0), (True, 1, ("b",), (3,), None, 0),
              (False, 0, ("a",), (3,), None, 0), (False, 1, ("b",), (3,), None, 0),
              (True, 2, ("a",), (3,), None, 0), (True, 3, ("b",), (3,), None, 0),
              (False, 2, ("a",), (3,), None, 0), (False, 3, ("b",), (3,), None, 0)]
    assert upper_bound(events, 5).hit_tokens == pytest.approx(4, abs=1e-3)
    plan, dual = integer_solution(events, 5, node_limit=1)
    assert plan == 0 and dual == pytest.approx(0, abs=1e-3)
    assert integer_solution(events, 6, node_limit=1) == pytest.approx((6, 6), abs=1e-3)  # room for both


def test_prefix_closure_is_a_valid_cut_where_reads_are_not_prefix_chains():
    """Random key orders (a key read after different keys): (C) lowers the LP in some instances,
    never below the exact optimum of prefix-matching reads."""
    rng = random.Random(3)
    below = 0
    for _ in range(200):
        events, capacity, size = random_instance(rng, flush=True, slack=2)
        closed = closed_lp(events, capacity)
        loose = upper_bound(events, capacity).hit_tokens
        assert exact_optimum(events, capacity, size, prefix=True) - 1e-9 <= closed <= loose + 1e-6, (events, capacity)
        below += closed < loose - 1e-3
    assert below > 20


def chain_instance(rng: random.Random):
    """Requests that read root paths of a small tree of units (each key a prefix: its identity is
    its path), and leave an output below their last key; every key always read at its full size."""
    size: dict = {}

    def key(path):
        size.setdefault(path, rng.randint(1, 4))
        return path

    requests = []
    for _ in range(rng.randint(3, 10)):
        depth = rng.randint(1, 4)
        path = tuple(rng.randint(0, 1) for _ in range(depth))
        keys = tuple(key(path[: i + 1]) for i in range(depth))
        out = key(path + (2,)) if rng.random() < 0.5 else None
        requests.append((keys, tuple(size[k] for k in keys), out, size[out] if out is not None else 0))
    events = interleave(rng, requests, 0.5)
    return events, fitting_capacity(events, size) + rng.randint(0, 4)


def test_prefix_closure_leaves_the_bound_unchanged_on_prefix_chains():
    """Point 4a: where every key is read at its full size and a key's identity is its prefix, the
    LP with (C) has the optimum of the LP without it, at every capacity."""
    rng = random.Random(4)
    open_solutions = 0
    for _ in range(300):
        events, capacity = chain_instance(rng)
        closure: list = []
        free, a, b, s, w, caps = intervals(events, capacity, closure_out=closure)
        assert (w == s).all() and all(parent != MISSED for _, parent in closure)
        assert closed_lp(events, capacity) == pytest.approx(upper_bound(events, capacity).hit_tokens, abs=1e-4)
        if closure:  # the LP without (C) found an optimum that keeps a key beyond its prefix
            x = _eviction_lp(a, b, s, w, caps)[3]
            open_solutions += any(x[child] > x[parent] + 1e-6 for child, parent in closure)
    assert open_solutions >= 5  # 10 of these 300: the equality is not the LP finding a closed optimum by chance


def test_first_reads_miss_and_running_reads_are_free_once_inserted():
    # request 0 reads key 1 (first access: a miss); request 1 reads it while 0 runs, before any
    # finish inserted it (a miss: only 0's private copy exists); request 2 reads key 1 while 1 runs,
    # after 0's finish inserted it (free); request 3 reads key 2, with no room to keep key 1
    # (capacity = what 3 holds); request 4 reads key 1 again
    events = [(True, 0, (1,), (5,), None, 0), (True, 1, (1,), (5,), None, 0), (False, 0, (1,), (5,), None, 0),
              (True, 2, (1,), (5,), None, 0), (False, 1, (1,), (5,), None, 0), (False, 2, (1,), (5,), None, 0),
              (True, 3, (2,), (5,), None, 0), (False, 3, (2,), (5,), None, 0),
              (True, 4, (1,), (5,), None, 0), (False, 4, (1,), (5,), None, 0)]
    free, starts, *_ = intervals(events, 5)
    assert free == 5 and len(starts) == 1
    assert upper_bound(events, 5).hit_tokens == pytest.approx(5, abs=1e-3)  # request 3 takes all: key 1 goes
    assert upper_bound(events, 8).hit_tokens == pytest.approx(5 + 5 * 3 / 5, abs=1e-3)  # 3 tokens left: 3/5 of it
    assert upper_bound(events, 10).hit_tokens == pytest.approx(10, abs=1e-3)  # both fit: key 1 stays


def exact_with_host(events, capacity, size, host, pcie, either_tier: bool) -> int:
    """Most prompt-token hits in the model with a host tier: after each event the policy chooses
    what the host holds (at most `host` tokens, of keys that are in the cache, the finished
    request's keys included) and what the GPU holds: keys it kept, plus keys it loads from the host
    during the gap that follows (at most pcie[e] tokens); GPU keys plus what running requests hold
    fit the capacity. A key enters the cache only when a request that read it finishes. A read hits
    if its key is on the GPU, or held by a running request and inserted before, or, with
    `either_tier`, on the host.
    Choices that hold a subset of what another allowed choice holds are never better: only the
    maximal ones are searched."""
    held = [running_state(events, e) for e in range(len(events))]
    free = held_and_inserted(events)

    def maximal(sets):
        return [x for x in sets if not any(x < y for y in sets)]

    def fits(keys, budget):
        return sum(size[k] for k in keys) <= budget

    @lru_cache(maxsize=None)
    def best(e: int, gpu: frozenset, on_host: frozenset) -> int:
        if e == len(events):
            return 0
        admit, _, keys, lens, out, _ = events[e]
        cached = gpu | on_host if either_tier else gpu
        gain = sum(t for k, t in zip(keys, lens) if k in cached or k in free[e]) if admit else 0
        kept = gpu if admit else gpu | set(keys) | ({out} if out is not None else set())
        present = sorted(kept | on_host)
        running_keys, outputs = held[e]
        hosts = maximal([frozenset(c) for n in range(len(present) + 1) for c in itertools.combinations(present, n)
                         if fits(c, host)])
        options = []
        for h in hosts:
            loadable = sorted(kept | h)
            gpus = [frozenset(c) for n in range(len(loadable) + 1) for c in itertools.combinations(loadable, n)
                    if fits(set(c) - kept, pcie[e]) and fits(set(c) | running_keys, capacity - outputs)]
            options += [best(e + 1, g, h) for g in maximal(gpus)]
        return gain + max(options)

    return best(0, frozenset(), frozenset())


def random_tiers(rng: random.Random):
    """An instance under pressure (a flush, little slack) with a host capacity (or none) and a
    PCIe budget in about half of the gaps."""
    events, capacity, size = random_instance(rng, flush=True, slack=1, admit=0.3)
    host = rng.choice([0, rng.randint(2, 8), rng.randint(2, 8)])
    pcie = [rng.choice([0, rng.randint(1, 6)]) for _ in events]
    return events, capacity, size, host, pcie


def test_prefetch_and_either_tier_bounds_are_at_least_the_exact_optima():
    rng = random.Random(1)
    tight = {"prefetch": 0, "any_tier": 0}
    above_eviction = 0
    for _ in range(200):
        events, capacity, size, host, pcie = random_tiers(rng)
        bounds = upper_bounds(events, capacity, host, pcie)
        exact = {"prefetch": exact_with_host(events, capacity, size, host, pcie, either_tier=False),
                 "any_tier": exact_with_host(events, capacity, size, host, pcie, either_tier=True)}
        for kind, value in exact.items():
            bound = getattr(bounds, kind)
            assert bound.method == "lp"
            assert bound.hit_tokens >= value - 1e-9, (kind, events, capacity, host, pcie)
            tight[kind] += abs(bound.hit_tokens - value) < 1e-3
        if host and any(pcie):  # the prefetch LP itself, also where the any-tier optimum stands for it
            free, a, b, s, w, caps = intervals(events, capacity)
            solved = _prefetch_lp(a, b, s, w, caps, caps + host, np.asarray(pcie, dtype=float)) if len(a) else (0,)
            assert exact["prefetch"] - 1e-9 <= free + solved[0] <= bounds.prefetch.hit_tokens + 1e-6
        assert bounds.eviction.hit_tokens <= bounds.prefetch.hit_tokens <= bounds.any_tier.hit_tokens
        above_eviction += exact["prefetch"] > bounds.eviction.hit_tokens + 1e-3  # prefetch beats every eviction policy
        cheap = upper_bounds(events, capacity, host, pcie, max_lp_intervals=0)  # PFOO-U bounds each LP
        for kind in ("eviction", "prefetch", "any_tier"):
            assert getattr(cheap, kind).hit_tokens >= getattr(bounds, kind).hit_tokens - 1e-4
    assert above_eviction > 15  # the instances exercise prefetch: the eviction bound would not hold there
    assert tight["prefetch"] > 120 and tight["any_tier"] > 150  # and the bounds are mostly the optima themselves


def test_without_host_or_pcie_time_prefetch_is_eviction():
    rng = random.Random(2)
    for _ in range(100):
        events, capacity, size, host, pcie = random_tiers(rng)
        eviction = upper_bound(events, capacity).hit_tokens
        assert upper_bounds(events, capacity, 0, pcie).prefetch.hit_tokens == eviction  # no host copies
        assert upper_bounds(events, capacity, 0, pcie).any_tier.hit_tokens == eviction
        assert upper_bounds(events, capacity, max(host, 1), [0] * len(events)).prefetch.hit_tokens == \
            pytest.approx(eviction, abs=1e-3)  # no PCIe time: (P) forces y = 0


def test_a_sequence_solved_before_gets_its_bounds_from_memory():
    rng = random.Random(3)
    events, capacity, size, host, pcie = random_tiers(rng)
    while not host or len(intervals(events, capacity)[1]) == 0:
        events, capacity, size, host, pcie = random_tiers(rng)
    first = upper_bounds(events, capacity, host, pcie)
    assert upper_bounds(list(events), capacity, host, pcie) is first  # equal LP inputs: not solved again
    solved = upper_bounds(events, capacity, host, pcie, reuse=False)
    assert solved is not first and dataclasses.replace(solved.any_tier, seconds=0) == \
        dataclasses.replace(first.any_tier, seconds=0)
    other = upper_bounds(events, capacity, host + 1, pcie)  # any input that differs is its own LP
    assert other is not first and other.any_tier.hit_tokens >= first.any_tier.hit_tokens - 1e-6
    assert upper_bounds(events, capacity, host, [p + 1 for p in pcie]) is not first
    # two replicas with equal sequences share one Bounds and are counted each
    one, two = row_bounds([first], 1000), row_bounds([first, first], 1000)
    assert two["bound_rows"] == 2 * one["bound_rows"] and two["bound_intervals"] == 2 * one["bound_intervals"]


def test_a_key_brought_back_within_the_pcie_budget():
    # request 0 reads key 1 and finishes; request 1 needs the whole GPU, so key 1 must leave it
    # (to the host); request 2 reads key 1 again: a GPU hit only if prefetch loads it back in the
    # gap before its admission, and only as much of it as that gap's PCIe budget carries
    events = [(True, 0, (1,), (5,), None, 0), (False, 0, (1,), (5,), None, 0), (True, 1, (2,), (5,), None, 0),
              (False, 1, (2,), (5,), None, 0), (True, 2, (1,), (5,), None, 0), (False, 2, (1,), (5,), None, 0)]
    size = {1: 5, 2: 5}
    for pcie_before_read, expected in ((5, 5), (3, 3), (0, 0)):
        pcie = [0, 0, 0, pcie_before_read, 0, 0]
        bounds = upper_bounds(events, 5, 5, pcie)
        assert bounds.eviction.hit_tokens == pytest.approx(0, abs=1e-3)
        assert bounds.prefetch.hit_tokens == pytest.approx(expected, abs=1e-3)
        assert bounds.any_tier.hit_tokens == pytest.approx(5, abs=1e-3)  # a host hit in any case
        assert exact_with_host(events, 5, size, 5, pcie, either_tier=False) == (5 if pcie_before_read == 5 else 0)
    # a run too large for the prefetch LP (here: max_lp_intervals / PREFETCH_LP_COST < 1 interval):
    # the any-tier bound stands for it
    stand_in = upper_bounds(events, 5, 5, [0, 0, 0, 3, 0, 0], max_lp_intervals=PREFETCH_LP_COST - 1)
    assert stand_in.prefetch.method == "any_tier" and stand_in.eviction.method == "lp"
    assert stand_in.prefetch.hit_tokens == pytest.approx(5, abs=1e-3)
    # budget only before key 1 was cached: nothing to load then
    assert upper_bounds(events, 5, 5, [5, 0, 0, 0, 0, 0]).prefetch.hit_tokens == pytest.approx(0, abs=1e-3)
    assert upper_bounds(events, 5, 0, [0, 0, 0, 5, 0, 0]).any_tier.hit_tokens == pytest.approx(0, abs=1e-3)  # no host


# (workload, GPU tokens, PCIe bandwidth in bytes/s): H100's 64 GB/s, and a slow link on which the
# idle time's PCIe budget, not the host tier, limits what prefetch can bring back
CASES = [("hover", 60_000, 64e9), ("hover", 150_000, 64e9), ("swebench", 120_000, 64e9), ("swebench", 120_000, 2e8)]


@pytest.mark.parametrize("kind,gpu,pcie", CASES)
def test_no_policy_beats_its_own_bound(kind, gpu, pcie):
    workflows = small_workload(kind, 30, 3)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    gpu = max(gpu, max(c.prompt_tokens + c.output_tokens for w in workflows for c in w.calls))
    config = SimConfig(gpu_tokens=gpu, concurrency=8)
    cost = dataclasses.replace(H100, pcie_bandwidth=pcie)
    perfect = PerfectSource(names, 3)
    graph = AgentStepGraph.from_traces([[c.agent for c in w.calls] for w in workflows], 3)
    runs = {"lru": {}, "lfu": {}, "tlru": {}, "pbkv_lae": {}, "pbkv": {"predictions": perfect},
            "pbkv+conservative": {"predictions": perfect, "prefetch": "conservative"},
            "pbkv+aggressive": {"predictions": perfect, "prefetch": "aggressive"},
            "kvflow_ideal": {"predictions": graph, "prefetch": "aggressive"},
            "kvflow": {"predictions": graph, "prefetch": "kvflow"}, "oracle": {"predictions": perfect},
            "oracle+aggressive": {"predictions": perfect, "prefetch": "aggressive"}}
    rows = {}
    for label, kwargs in runs.items():
        row = rows[label] = simulate(workflows, config, cost, policy=label.split("+")[0], **kwargs)
        own = "bound_prefetch_hit_rate" if kwargs.get("prefetch", "none") != "none" else "bound_hit_rate"
        assert row["hit_rate"] <= row[own], label
        assert row["recompute_rate"] >= row["bound_recompute_rate"], label  # GPU + host hits: any policy
        assert row["bound_hit_rate"] <= row["bound_prefetch_hit_rate"] <= 1 - row["bound_recompute_rate"] + 1e-12
        assert row["bound_method"] == "lp"
        assert row["bound_hit_rate"] < 1.0  # first reads always miss
    if (kind, pcie) == ("swebench", 64e9):  # prefetch reaches GPU hits no eviction policy can: the bound it needs
        assert rows["pbkv+aggressive"]["hit_rate"] > rows["pbkv+aggressive"]["bound_hit_rate"]
    if pcie < 1e9:  # the PCIe budget binds: less than every hit in either tier could be brought back
        aggressive = rows["pbkv+aggressive"]
        assert aggressive["bound_prefetch_hit_rate"] < 1 - aggressive["bound_recompute_rate"] - 0.01


def test_prefetch_budgets_are_whole_tokens_blind_to_the_clocks_last_bits():
    """Policies that admit the same calls at the same times sum their clocks in another order: the
    budgets, whole tokens, come out equal (so upper_bounds solves their prefetch LP once), each at
    least the clocks' own budget less BUDGET_SLACK, and below it plus one token."""
    from serving_integration.simulator.bound import BUDGET_SLACK, clock_budgets, prefetch_budgets
    from serving_integration.simulator.engine import Simulator

    cost = dataclasses.replace(H100, pcie_bandwidth=2e8)
    sim = Simulator(small_workload("swebench", 30, 3), SimConfig(gpu_tokens=120_000, concurrency=8), cost,
                    policy="lru")
    sim.run()
    trace = sim.servers[0].trace
    budgets = prefetch_budgets(trace, cost.pcie_tokens_per_s)
    assert np.count_nonzero(budgets) > 10 and np.array_equal(budgets, np.floor(budgets))
    for step in (math.inf, -math.inf):  # every admission's clock one bit later, or earlier
        nudged = {id(r): dataclasses.replace(r, admitted=math.nextafter(r.admitted, step)) for r in trace}
        assert prefetch_budgets([nudged[id(r)] for r in trace], cost.pcie_tokens_per_s).tobytes() == budgets.tobytes()
    raw = clock_budgets(trace, cost.pcie_tokens_per_s)
    assert not np.array_equal(raw, np.floor(raw))  # the clocks' own budgets have fractions
    assert np.all(budgets >= raw - BUDGET_SLACK) and np.all(budgets < raw + 1)


def test_a_clusters_bounds_are_the_sum_of_its_replicas():
    """Hits happen per replica: each replica's bounds on the calls routed to it, at its own GPU and
    host capacity and PCIe time, summed, bound the cluster's hits."""
    from serving_integration.simulator.bound import prefetch_budgets, sequence_from_trace
    from serving_integration.simulator.engine import Simulator, bound_metrics

    workflows = small_workload("hover", 20, 5)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    config = SimConfig(gpu_tokens=120_000, concurrency=8, replicas=2, routing="round_robin")
    sim = Simulator(workflows, config, H100, policy="pbkv", prefetch="aggressive", predictions=PerfectSource(names, 3))
    counters = sim.run()
    row = bound_metrics(sim)
    parts = [upper_bounds(sequence_from_trace(s.trace), s.tree.gpu_capacity, s.tree.host_capacity,
                          prefetch_budgets(s.trace, H100.pcie_tokens_per_s)) for s in sim.servers]
    assert all(s.tree.gpu_capacity == 60_000 and s.tree.host_capacity == 120_000 for s in sim.servers)
    prompt = counters.prompt_tokens
    assert row["bound_prefetch_hit_rate"] == pytest.approx(sum(p.prefetch.hit_tokens for p in parts) / prompt)
    assert row["bound_recompute_rate"] == pytest.approx(1 - sum(p.any_tier.hit_tokens for p in parts) / prompt)
    assert counters.gpu_hit_tokens / prompt <= row["bound_prefetch_hit_rate"]
    assert (counters.miss_tokens / prompt) >= row["bound_recompute_rate"]
