"""No online policy reads the future: a replay, and the same replay with every call issued after
time t replaced by other calls, make the same eviction and prefetch decisions up to t, for every
policy that claims to be online. The clairvoyant ones (the oracle, pbkv fed the true future) must
differ, or the test could not catch a leak."""

import random
from dataclasses import replace

import pytest

from models.markov import MarkovPredictor
from serving_integration.cache.predictions import AgentStepGraph, ModelSource, PerfectSource, vocabulary
from serving_integration.cache.workload import SimWorkflow, prefix_keys
from serving_integration.simulator.engine import SimConfig, Simulator
from tests.simulator.test_simulator import H100, small_workload

# tight enough that live workflows' cache is evicted before t (not only finished workflows', which
# every policy may evict alike): a clairvoyant policy then decides differently when the future changes
CONFIG = SimConfig(gpu_tokens=60_000, concurrency=6)


def replay(workflows, scheduling="fcfs", partial_eviction=False, **policy):
    sim = Simulator([SimWorkflow(w.id, w.order, w.task, w.calls) for w in workflows],
                    SimConfig(gpu_tokens=CONFIG.gpu_tokens, concurrency=CONFIG.concurrency, scheduling=scheduling,
                              partial_eviction=partial_eviction),
                    H100, record_decisions=True, **policy)
    sim.run()
    return sim


def issue_times(sim) -> dict:
    """(workflow id, call index) -> when the call was issued, from the run's trace."""
    times, seen, count = {}, set(), {}
    for r in sim.trace:
        if id(r) in seen:
            continue
        seen.add(id(r))
        j = count[r.wf.id] = count.get(r.wf.id, -1) + 1
        times[r.wf.id, j] = r.scheduled
    return times


def other_future(workflows, times, t, agents, seed=0):
    """Every call issued after t replaced by another: other agent, prompt, output; same tool time
    (so it is still issued after t) and the same number of calls per workflow."""
    rng = random.Random(seed)
    out = []
    for w in workflows:
        calls = []
        for j, call in enumerate(w.calls):
            if times[w.id, j] > t:
                units = call.units[: rng.randrange(len(call.units))] + tuple(
                    f"other/{w.id}/{j}/{i}" for i in range(rng.randint(1, 3)))
                lens = call.lens[: len(units)] + tuple(rng.randint(200, 4000) for _ in range(len(units)))
                lens = lens[: len(units)]
                call = replace(call, agent=rng.choice(agents), units=units, lens=lens, keys=prefix_keys(units),
                               output_unit=f"other/{w.id}/{j}/out", output_tokens=rng.randint(20, 400))
            calls.append(call)
        out.append(SimWorkflow(w.id, w.order, w.task, calls))
    return out


@pytest.fixture(scope="module")
def setting():
    workflows = small_workload("hover", 40, 7)
    train = small_workload("hover", 60, 8)  # predictors and KVFlow's graph are fitted elsewhere
    sequences = [[c.agent for c in w.calls] for w in train]
    names = vocabulary([a for s in sequences for a in s] + [c.agent for w in workflows for c in w.calls])
    index = {a: i for i, a in enumerate(names)}
    markov = MarkovPredictor.from_sequences(names, 3, [[index[a] for a in s] for s in sequences], order=1)
    return workflows, names, sequences, markov


def policies(names, sequences, markov):
    online = {
        "lru": {"policy": "lru"}, "lfu": {"policy": "lfu"},
        "tlru": {"policy": "tlru", "policy_options": {"threshold": 2000, "next_prompt_estimate": 500}},
        "pbkv_lae": {"policy": "pbkv_lae"},
        "kvflow_ideal": {"policy": "kvflow_ideal", "prefetch": "aggressive",
                         "predictions": AgentStepGraph.from_traces(sequences, 3)},
        "kvflow_nolae": {"policy": "kvflow_nolae", "predictions": AgentStepGraph.from_traces(sequences, 3)},
        "kvflow": {"policy": "kvflow", "prefetch": "kvflow", "predictions": AgentStepGraph.from_traces(sequences, 3)},
        "lru_prefetch": {"policy": "lru_prefetch", "prefetch": "last_call"},
        "continuum": {"policy": "continuum"},
        "continuum+program_fcfs": {"policy": "continuum", "scheduling": "program_fcfs"},
        **{name: {"policy": name} for name in ("fifo", "mru", "filo", "slru", "priority")},
        "pbkv": {"policy": "pbkv", "predictions": ModelSource(markov)},
        # outcome trust on a hair trigger (every workflow sampled, no margin): it flips, from the past alone
        "pbkv+outcome-flipping": {"policy": "pbkv", "predictions": ModelSource(markov), "policy_options": {
            "trust": "outcome", "outcome_sample": 1.0, "outcome_min_calls": 1, "outcome_z": 0.0,
            "outcome_margin": 0.0, "outcome_window": 8}},
        "pbkv+accuracy": {"policy": "pbkv", "predictions": ModelSource(markov), "policy_options": {"trust": "accuracy"}},
        "pbkv+conservative": {"policy": "pbkv", "prefetch": "conservative", "predictions": ModelSource(markov)},
        # the admission queue it reads is the past: calls already issued
        "pbkv_time": {"policy": "pbkv_time", "predictions": ModelSource(markov)},
        "pbkv_time+partial": {"policy": "pbkv_time", "predictions": ModelSource(markov), "partial_eviction": True},
    }
    clairvoyant = {"oracle": {"policy": "oracle", "predictions": PerfectSource(names, 3)},
                   "pbkv_perfect": {"policy": "pbkv", "predictions": PerfectSource(names, 3)},
                   "pbkv_time_perfect": {"policy": "pbkv_time", "predictions": PerfectSource(names, 3)}}
    return online, clairvoyant


def before(decisions, t):
    return [d for d in decisions if d[0] <= t]


def test_online_policies_decide_the_same_until_the_future_changes(setting):
    workflows, names, sequences, markov = setting
    online, clairvoyant = policies(names, sequences, markov)
    reads_future = {}
    for name, kwargs in {**online, **clairvoyant}.items():
        first = replay(workflows, **kwargs)
        times = issue_times(first)
        t = sorted(times.values())[len(times) // 2]  # half the calls are issued after t
        changed = other_future(workflows, times, t, names[1:])
        second = replay(changed, **kwargs)
        a, b = before(first.decisions, t), before(second.decisions, t)
        assert len(a) > 20, f"{name}: too few decisions before t to compare"
        if name in online:
            assert a == b, f"{name} decided differently before t = {t:.1f} s: it reads the future"
            assert first.decisions != second.decisions  # the future did change
            if name == "pbkv+outcome-flipping":  # its order did flip during the replay
                assert first.servers[0].policy.judge.switches > 0
        else:
            reads_future[name] = a != b
    # the clairvoyant policies must decide differently before t, else this test could not catch a leak
    assert all(reads_future.values()), f"clairvoyant policies that did not read the future: {reads_future}"
