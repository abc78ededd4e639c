"""A real cluster on the CPU (docs/cluster.md, "A real cluster"): two `launch --cpu` servers with
the PBKV plugin behind sglang-router 0.3.2 (serving_integration/server/cluster.py), replayed by the
bench client under sticky routing (the workflow id as the routing key, the router's manual policy)
and under pbkv routing (the PBKV router class picks the replica, the target-worker header names it).

Sized for CI: the 4 small test workflows of tests/server/test_sglang_cpu.py (its fixtures), two per
routing, one pair of servers (each with the 2,500-token device pool of that test) and one router
per routing in front of them, so that the servers start once.
"""

from __future__ import annotations

import json
import time

import pytest

from serving_integration.experiments import bench, validate_sim
from serving_integration.server.cluster import LocalCluster
from tests.server.test_sglang_cpu import CONCURRENCY, GPU_TOKENS, TOOL_TIME_SCALE, checkpoint, dataset  # noqa: F401

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore")]

REPLICAS = 2
ROUTINGS = ("sticky", "pbkv")


@pytest.fixture(scope="module")
def cluster_runs(dataset, checkpoint, tmp_path_factory):  # noqa: F811
    """Two servers (pbkv eviction, so each plugin records the calls it served), a router per routing;
    the first two test workflows replayed through the sticky router, the other two through pbkv's."""
    workflows = bench.replay_workflows(dataset.rows("test"))
    assert len(workflows) == 4
    args = ["--cpu", "--policy", "pbkv", "--checkpoint", str(checkpoint),
            "--policy-config", json.dumps({"predictor_timeout_s": 0})]
    began = time.monotonic()
    runs = {}
    with LocalCluster(args, REPLICAS, list(ROUTINGS), GPU_TOKENS * REPLICAS,
                      log_dir=tmp_path_factory.mktemp("cluster-logs"), health_timeout_s=240.0) as cluster:
        print(f"cluster ready in {cluster.ready_s:.0f} s; router index of each server {cluster.worker_index}")
        for k, routing in enumerate(ROUTINGS):
            runs[routing] = validate_sim.replay_and_collect(
                cluster.urls[routing], cluster.worker_urls, workflows[2 * k: 2 * k + 2], "pbkv",
                gpu_tokens=GPU_TOKENS * REPLICAS, concurrency=CONCURRENCY, tool_time_scale=TOOL_TIME_SCALE,
                routing=routing, worker_index=cluster.worker_index or None,
                replica_capacity_tokens=cluster.tokens_per_replica * 3.0)
            runs[routing]["workflows"] = workflows[2 * k: 2 * k + 2]
            print(f"{routing}: replay {runs[routing]['replay_s']:.0f} s, per replica {runs[routing]['replicas']}")
    print(f"total {time.monotonic() - began:.0f} s")
    return runs


def test_no_failed_call_and_cached_tokens_come_back_through_the_router(cluster_runs):
    for routing, run in cluster_runs.items():
        results, stats = run["results"], run["replicas"]
        assert len(results) == sum(len(wf) for wf in run["workflows"])
        assert run["row"]["failed_calls"] == 0, (routing, sorted({r.error for r in results if not r.ok}))
        assert all(r.device_tokens + r.host_tokens == r.cached_tokens for r in results)
        assert sum(r.device_tokens for r in results) > 0, routing  # each workflow's growing transcript
        # what came back through the router is what the servers counted: every prompt token of the
        # calls (plus one per end signal), every device and host hit
        ends = run["replay"].end_signals_sent
        assert run["replay"].end_signals_failed == 0 and ends >= len(run["workflows"])
        assert sum(s["prompt_tokens"] for s in stats) == sum(r.prompt_tokens for r in results) + ends, routing
        assert sum(s["device_tokens"] for s in stats) == sum(r.device_tokens for r in results), routing
        assert sum(s["host_tokens"] for s in stats) == sum(r.host_tokens for r in results), routing
        assert sum(s["requests"] for s in stats) == len(results) + ends, routing
        assert run["row"]["replicas"] == REPLICAS and run["row"]["routing"] == routing


def test_sticky_keeps_each_workflow_on_one_replica(cluster_runs):
    run = cluster_runs["sticky"]
    served = run["served_by"]
    for wf in run["workflows"]:
        where = [served.get((c.workflow_id, c.step)) for c in wf]
        assert None not in where, (wf[0].workflow_id, where)  # each call recorded by one replica's plugin
        assert len(set(where)) == 1, (wf[0].workflow_id, where)


def test_pbkv_routing_lands_where_the_router_class_chose(cluster_runs):
    run = cluster_runs["pbkv"]
    served, results = run["served_by"], run["results"]
    assert all(r.replica in range(REPLICAS) for r in results)
    assert all(served.get((r.workflow_id, r.step)) == r.replica for r in results), \
        [(r.workflow_id, r.step, r.replica, served.get((r.workflow_id, r.step))) for r in results]


def test_end_signals_reach_every_replica_of_their_workflow(cluster_runs):
    """Every workflow (both routings) was ended by an end signal on each replica it ran on (sticky:
    one; pbkv: every replica the router class sent it to), and no replica keeps a live workflow
    (the counters are the plugins' totals, read after the last replay)."""
    stats = cluster_runs[ROUTINGS[-1]]["replicas"]
    visits = {(r.workflow_id, cluster_runs["sticky"]["served_by"][(r.workflow_id, r.step)])
              for r in cluster_runs["sticky"]["results"]}
    visits |= {(r.workflow_id, r.replica) for r in cluster_runs["pbkv"]["results"]}
    assert sum(s["plugin_counters"].get("workflows_started", 0) for s in stats) == len(visits)
    assert sum(s["plugin_counters"].get("workflows_ended", 0) for s in stats) == len(visits)
    assert sum(s["plugin_counters"].get("end_signals", 0) for s in stats) == len(visits)
    assert all(s["live_workflows"] == 0 for s in stats)
