"""The offline upper bound (serving_integration/simulator/bound.py): at least the exact optimum
of the abstract caching model, found by exhaustive search, on small random instances; never below
the hit rate of a simulator run on its own sequence."""

import itertools
import random
from functools import lru_cache

import pytest

from serving_integration.cache.predictions import AgentStepGraph, PerfectSource, vocabulary
from serving_integration.simulator.bound import intervals, upper_bound
from serving_integration.simulator.engine import SimConfig, simulate
from tests.simulator.test_simulator import H100, small_workload


def random_instance(rng: random.Random):
    """Requests over a few keys (outputs are keys later requests may read), admitted and finished
    in a random interleaving; a capacity that fits what the running requests hold."""
    n_keys = rng.randint(2, 6)
    size = {k: rng.randint(1, 4) for k in range(n_keys)}
    requests = []
    for r in range(rng.randint(2, 6)):
        keys = tuple(rng.sample(range(n_keys), rng.randint(1, min(3, n_keys))))
        out = rng.choice([None, *range(n_keys)])
        if out in keys:
            out = None
        requests.append((keys, tuple(size[k] for k in keys), out, size[out] if out is not None else 0))
    events, waiting, running = [], list(range(len(requests))), []
    while waiting or running:
        if waiting and (not running or rng.random() < 0.5):
            r = waiting.pop(0)
            running.append(r)
            keys, lens, _, out_tokens = requests[r]
            events.append((True, r, keys, lens, None, out_tokens))
        else:
            r = running.pop(rng.randrange(len(running)))
            keys, lens, out, out_tokens = requests[r]
            events.append((False, r, keys, lens, out, out_tokens))
    held = [running_state(events, e) for e in range(len(events))]
    need = max(sum(size[k] for k in keys) + outs for keys, outs in held)
    return events, need + rng.randint(0, 6), size


def running_state(events, e):
    """(keys held by requests running after event e, their output tokens)."""
    live = {}
    for admit, r, keys, _, _, out_tokens in events[: e + 1]:
        if admit:
            live[r] = (keys, out_tokens)
        else:
            del live[r]
    return {k for keys, _ in live.values() for k in keys}, sum(o for _, o in live.values())


def exact_optimum(events, capacity, size) -> int:
    """Most prompt-token hits over every choice of what stays cached after each event: a read hits
    if its key is cached or held by a running request; the cache gains keys only when a request
    finishes (its prompt and output); after every event the cached keys plus what running
    requests hold fit the capacity. No prefix closure, no host tier: a relaxation of the simulator."""
    held = [running_state(events, e) for e in range(len(events))]
    before = [(set(), 0)] + held[:-1]

    @lru_cache(maxsize=None)
    def best(e: int, cached: frozenset) -> int:
        if e == len(events):
            return 0
        admit, _, keys, lens, out, _ = events[e]
        gain = sum(t for k, t in zip(keys, lens) if k in cached or k in before[e][0]) if admit else 0
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


def test_first_reads_miss_and_running_reads_are_free():
    # request 0 reads key 1 (first access: a miss); request 1 reads it while 0 runs (free);
    # request 2 reads it after both finished, with no room to keep it (capacity = what 2 holds)
    events = [(True, 0, (1,), (5,), None, 0), (True, 1, (1,), (5,), None, 0), (False, 0, (1,), (5,), None, 0),
              (False, 1, (1,), (5,), None, 0), (True, 2, (2,), (5,), None, 0), (False, 2, (2,), (5,), None, 0),
              (True, 3, (1,), (5,), None, 0), (False, 3, (1,), (5,), None, 0)]
    free, starts, *_ = intervals(events, 5)
    assert free == 5 and len(starts) == 1
    assert upper_bound(events, 5).hit_tokens == pytest.approx(5, abs=1e-3)  # request 2 takes all: key 1 goes
    assert upper_bound(events, 8).hit_tokens == pytest.approx(5 + 5 * 3 / 5, abs=1e-3)  # 3 tokens left: 3/5 of it
    assert upper_bound(events, 10).hit_tokens == pytest.approx(10, abs=1e-3)  # both fit: key 1 stays


@pytest.mark.parametrize("kind,gpu", [("hover", 60_000), ("hover", 150_000), ("swebench", 120_000)])
def test_no_policy_beats_its_own_bound(kind, gpu):
    workflows = small_workload(kind, 30, 3)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    gpu = max(gpu, max(c.prompt_tokens + c.output_tokens for w in workflows for c in w.calls))
    config = SimConfig(gpu_tokens=gpu, concurrency=8)
    perfect = PerfectSource(names, 3)
    graph = AgentStepGraph.from_traces([[c.agent for c in w.calls] for w in workflows], 3)
    runs = {"lru": {}, "lfu": {}, "tlru": {}, "pbkv_lae": {}, "pbkv": {"predictions": perfect},
            "pbkv+conservative": {"predictions": perfect, "prefetch": "conservative"},
            "kvflow_ideal": {"predictions": graph, "prefetch": "aggressive"},
            "kvflow": {"predictions": graph, "prefetch": "kvflow"}, "oracle": {"predictions": perfect}}
    for label, kwargs in runs.items():
        row = simulate(workflows, config, H100, policy=label.split("+")[0], **kwargs)
        assert row["hit_rate"] <= row["bound_hit_rate"], label
        assert row["bound_method"].startswith("lp")
        assert row["bound_hit_rate"] < 1.0  # first reads always miss
