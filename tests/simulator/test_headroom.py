"""Where the bound's headroom lies (simulator/headroom.py): the run's own hits, rebuilt interval by
interval, are a feasible point of the eviction LP, and every split of the headroom adds up."""

import numpy as np
import pytest

from data.generators import WORKLOADS
from serving_integration.cache.predictions import PerfectSource, vocabulary
from serving_integration.cache.workload import SimWorkflow, workflows_from_rows
from serving_integration.simulator.bound import MISSED, eviction_solution, intervals, sequence_from_trace, upper_bound
from serving_integration.simulator.engine import SimConfig, Simulator
from serving_integration.simulator.headroom import (DISTANCE_BINS, PHASES, _kept_workflows, _phase_shares,
                                                    _read_on_gpu, headroom_fields, server_headroom)
from tests.simulator.test_simulator import H100 as COST


@pytest.fixture(scope="module")
def hover():
    return workflows_from_rows(WORKLOADS["hover"]().generate(80, seed=3).calls)


@pytest.mark.parametrize("policy,host", [("lru", 0.0), ("lru", 2.0), ("pbkv", 0.0)])
def test_the_runs_hits_are_a_feasible_point_of_the_lp(hover, policy, host):
    names = vocabulary(c.agent for w in hover for c in w.calls)
    kwargs = {"predictions": PerfectSource(names, 3)} if policy == "pbkv" else {}
    sim = Simulator([SimWorkflow(w.id, w.order, w.task, w.calls) for w in hover],
                    SimConfig(gpu_tokens=60_000, concurrency=8, hicache_ratio=host), COST, policy=policy, **kwargs)
    sim.run()
    server = sim.servers[0]
    events = sequence_from_trace(server.trace)
    free, a, b, s, w, keys, x = eviction_solution(events, server.tree.gpu_capacity)
    closure: list = []
    caps = intervals(events, server.tree.gpu_capacity, closure_out=closure)[5]
    hit = np.array([_read_on_gpu(server.trace[e + 1], k) for e, k in zip(b, keys)], dtype=float)
    assert 0 < hit.sum() < len(hit)  # a run under pressure: some intervals kept, some not
    load = np.zeros(len(caps) + 1)  # the run's kept intervals respect every gap's capacity (G)
    np.add.at(load, a, s * hit)
    np.add.at(load, b + 1, -s * hit)
    assert (np.cumsum(load)[:-1] <= caps + 1e-6).all()
    pairs = np.array(closure).reshape(-1, 2)
    below = pairs[pairs[:, 1] != MISSED]
    assert len(below) > 0  # prefix closure (C) has rows here, and the run's hits satisfy them, as the LP's do
    assert (hit[below[:, 0]] <= hit[below[:, 1]]).all() and (x[below[:, 0]] <= x[below[:, 1]] + 1e-6).all()
    assert (hit[pairs[pairs[:, 1] == MISSED, 0]] == 0).all()
    # bound.py, point 4a: on a trace whose keys are read at full size, (C) leaves the bound's optimum
    assert (w == s).all() and free + w @ x == pytest.approx(upper_bound(events, server.tree.gpu_capacity).hit_tokens,
                                                          rel=1e-5)
    found = server_headroom(server.trace, server.tree.gpu_capacity)
    assert found["lp_tokens"] >= found["run_tokens"] - 1e-6  # the LP's optimum is at least any feasible point
    delta = found["lp_tokens"] - found["run_tokens"]
    assert sum(found["by_distance"]) == pytest.approx(delta, abs=1e-6)
    assert sum(found["by_phase"].values()) == pytest.approx(delta, abs=1e-6)
    unit_hits = sum(sum(r.call.lens[:r.gpu_units]) for r in dict.fromkeys(server.trace))
    assert 0 <= unit_hits - found["run_tokens"] <= free + 1e-6  # the rest of the run's hits: running keys
    fields = headroom_fields(sim.servers)
    assert set(fields) == {"headroom_bound_hit_rate", "headroom_run_hit_rate", "kept_workflows_bound",
                           "kept_workflows_run", *(f"headroom_reuse_{b}" for b in DISTANCE_BINS),
                           *(f"headroom_phase_{p}" for p in PHASES)}


def test_the_integer_search_lies_between_the_runs_hits_and_its_bound(hover):
    """headroom_fields(integer=True): the integer optimum's proven bound lies between the run's own
    GPU hits (a 0/1 point of the model) and the LP bound of the row, with the search's plan below it;
    the same numbers on a second search (a node count, not a time, stops it)."""
    sim = Simulator([SimWorkflow(w.id, w.order, w.task, w.calls) for w in hover],
                    SimConfig(gpu_tokens=60_000, concurrency=8), COST, policy="lru")
    sim.run()
    server = sim.servers[0]
    fields = headroom_fields(sim.servers, integer=True)
    prompt = server.counters.prompt_tokens
    lp = upper_bound(sequence_from_trace(server.trace), server.tree.gpu_capacity).hit_tokens / prompt
    plan, dual = fields["headroom_integer_plan_hit_rate"], fields["headroom_integer_bound_hit_rate"]
    assert server.counters.gpu_hit_tokens / prompt <= dual + 1e-9 and plan <= dual <= lp + 1e-9
    assert headroom_fields(sim.servers, integer=True) == fields
    assert "headroom_integer_plan_hit_rate" not in headroom_fields(sim.servers)


def test_phase_shares_follow_the_workflows_timeline():
    timeline = [(0.0, 1.0, 3.0), (5.0, 6.0, 8.0)]  # issued, admitted, finished
    assert _phase_shares(timeline, 2.0, 6.0) == pytest.approx({"running": 0.25, "tool": 0.5, "queued": 0.25})
    assert _phase_shares(timeline, -2.0, 0.0) == pytest.approx({"not_started": 1.0})
    assert _phase_shares(timeline, 4.0, 4.0) == {"tool": 1.0}  # no length: the phase it lies in


def test_kept_workflows_count_each_workflow_once_per_gap():
    # gaps 0..5; workflow a keeps gaps 0-2 and 1-3 (union 0-3), b keeps gap 2
    starts, ends = np.array([0, 1, 2, 4]), np.array([2, 3, 2, 5])
    kept = np.array([True, True, True, False])
    assert _kept_workflows(starts, ends, ["a", "a", "b", "b"], kept, 6) == pytest.approx((1 + 1 + 2 + 1 + 0 + 0) / 6)
