"""The simulated cluster: replicas behind a router model (serving_integration/cache/router.py)."""

from types import SimpleNamespace

import pytest

from data.generators import Hover, SweBench
from serving_integration.cache.policies import WorkflowLedger
from serving_integration.cache.predictions import PerfectSource, vocabulary
from serving_integration.cache.workload import SimCall, SimWorkflow, prefix_keys, workflows_from_rows
from serving_integration.simulator.engine import SimConfig, Simulator, simulate
from serving_integration.simulator.radix import RadixTree, audit
from serving_integration.cache.router import CacheAware, PBKVRouting, make_router
from tests.simulator.test_simulator import H100

ROUTINGS = ("round_robin", "cache_aware", "sticky", "pbkv")


def workload(kind="hover", n=30, seed=3):
    return workflows_from_rows((Hover if kind == "hover" else SweBench)().generate(n, seed).calls)


def source(workflows):
    return PerfectSource(vocabulary(c.agent for w in workflows for c in w.calls), 3)


class RecordingSimulator(Simulator):
    """Audits every replica's tree after each finished call; records where each call was routed
    and the pbkv router's load bound at that moment."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.placements: dict[str, list[int]] = {}
        self.bound_checks: list[tuple[int, float]] = []
        route = self.router.route

        def recording_route(wf, call, servers, now):
            if isinstance(self.router, PBKVRouting):
                loads = [s.load for s in servers]
                bound = self.router.bound(sum(loads))
            i = route(wf, call, servers, now)
            if isinstance(self.router, PBKVRouting):
                self.bound_checks.append((loads[i] + 1, bound))
            self.placements.setdefault(wf.id, []).append(i)
            return i

        self.router.route = recording_route

    def _finish(self, r):
        super()._finish(r)
        audit(r.server.tree)


def run(workflows, replicas, routing, policy="lru", gpu=240_000, concurrency=8):
    fresh = [SimWorkflow(w.id, w.order, w.task, w.calls) for w in workflows]
    config = SimConfig(gpu_tokens=gpu, concurrency=concurrency, replicas=replicas, routing=routing)
    sim = RecordingSimulator(fresh, config, H100, policy=policy, predictions=source(workflows))
    return sim, sim.run()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_one_replica_is_the_single_server(routing):
    workflows = workload()
    single = simulate(workflows, SimConfig(gpu_tokens=100_000, concurrency=6), H100, policy="pbkv",
                      predictions=source(workflows))
    routed = simulate(workflows, SimConfig(gpu_tokens=100_000, concurrency=6, replicas=1, routing=routing), H100,
                      policy="pbkv", predictions=source(workflows))
    assert routed == single


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("policy", ["lru", "pbkv"])
def test_a_cluster_conserves_tokens_and_calls(routing, policy):
    workflows = workload("swebench", 12, 1)
    sim, c = run(workflows, 3, routing, policy, gpu=3 * 80_000)
    assert c.gpu_hit_tokens + c.host_hit_tokens + c.miss_tokens == c.prompt_tokens
    assert c.prompt_tokens == sum(call.prompt_tokens for w in workflows for call in w.calls)
    assert len(c.latencies) == len(workflows) and len(c.ttfts) == sum(len(w.calls) for w in workflows)
    assert sum(s.calls for s in sim.servers) == sum(len(w.calls) for w in workflows)
    assert all(s.tree.gpu_capacity == 80_000 for s in sim.servers)  # the total split evenly
    for s in sim.servers:
        assert s.tree.private_gpu == 0 and not any(x.lock_ref for x in s.tree.nodes())
    assert sum(len(p) for p in sim.placements.values()) == sum(len(w.calls) for w in workflows)


def test_more_replicas_than_one_need_a_routing_policy():
    with pytest.raises(ValueError, match="needs a routing policy"):
        simulate(workload(n=3), SimConfig(gpu_tokens=200_000, replicas=2), H100)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router("random_walk", 2)


def test_sticky_keeps_a_workflow_on_one_replica_and_spreads_new_ones():
    workflows = workload(n=24)
    sim, _ = run(workflows, 4, "sticky")
    assert all(len(set(p)) == 1 for p in sim.placements.values())
    assert sim.router.migrations == 0
    assert len({p[0] for p in sim.placements.values()}) == 4  # min_load assignment uses every replica
    spread, _ = run(workflows, 4, "round_robin")
    assert spread.router.migrations > 0 and any(len(set(p)) > 1 for p in spread.placements.values())


def call_of(units, lens):
    return SimCall("a", tuple(units), tuple(lens), prefix_keys(units), "out", 1, 0.0, None)


def servers_with(loads):
    return [SimpleNamespace(load=n) for n in loads]


def test_cache_aware_follows_its_threshold_rule():
    router = CacheAware(3, cache_threshold=0.5, balance_abs_threshold=2, balance_rel_threshold=1.5,
                        eviction_interval_s=0)
    wf = SimWorkflow("w", 0, "t", [])
    first = call_of(["sys", "ctx"], [60, 40])
    assert router.route(wf, first, servers_with([3, 1, 2]), 0.0) == 1  # nothing matched: the least loaded
    # 100 of 120 tokens matched on worker 1 (rate 0.83 > 0.5): worker 1, though worker 0 is less loaded
    assert router.route(wf, call_of(["sys", "ctx", "q"], [60, 40, 20]), servers_with([1, 3, 2]), 1.0) == 1
    # 60 of 160 matched (0.375 <= 0.5): the least loaded
    assert router.route(wf, call_of(["sys", "other"], [60, 100]), servers_with([2, 3, 1]), 2.0) == 2
    # max - min = 3 > 2 but 13 <= 1.5 x 10: balanced, so the match decides
    assert router.route(wf, call_of(["sys", "ctx"], [60, 40]), servers_with([10, 13, 10]), 3.0) == 1
    # imbalanced, max - min = 4 > 2 and 5 > 1.5 x 1: the least loaded despite a full match on worker 1
    assert router.route(wf, call_of(["sys", "ctx"], [60, 40]), servers_with([1, 5, 3]), 4.0) == 0


def test_cache_aware_trees_are_cut_back_least_recent_first():
    router = CacheAware(1, eviction_interval_s=10, max_tree_size=400, chars_per_token=4)  # 100 tokens
    wf = SimWorkflow("w", 0, "t", [])
    router.route(wf, call_of(["old", "x"], [50, 30]), servers_with([0]), 0.0)
    router.route(wf, call_of(["new", "y"], [50, 30]), servers_with([0]), 1.0)
    router.route(wf, call_of(["z"], [1]), servers_with([0]), 11.0)  # eviction runs first
    assert router.matched(0, call_of(["new", "y"], [50, 30])) == 80
    assert router.matched(0, call_of(["old", "x"], [50, 30])) == 0


def test_pbkv_routing_respects_its_load_bound_in_a_run():
    workflows = workload("hover", 40, 4)
    sim, c = run(workflows, 4, "pbkv", "pbkv", gpu=4 * 60_000, concurrency=16)
    assert sim.bound_checks and all(load <= bound for load, bound in sim.bound_checks)
    assert c.gpu_hit_tokens + c.host_hit_tokens + c.miss_tokens == c.prompt_tokens


def test_pbkv_routing_follows_the_cache_and_migrates_off_an_overloaded_replica():
    units, lens = ["sys", "ctx"], [500, 500]
    servers = []
    for _ in range(3):
        tree = RadixTree(10_000)
        servers.append(SimpleNamespace(load=0, tree=tree, ledger=WorkflowLedger()))
    tree = servers[2].tree
    tree.private_gpu += 1000
    tree.insert(units, lens)
    tree.private_gpu -= 1000
    router = PBKVRouting(3, load_factor=1.0, load_slack=1)
    wf = SimWorkflow("w", 0, "t", [])
    call = call_of(units + ["q"], lens + [10])
    assert router.route(wf, call, servers, 0.0) == 2  # its prefix is cached there
    servers[2].load, servers[0].load = 4, 1  # bound: 1.0 x (5 + 1) / 3 + 1 = 3 < 4 + 1
    assert router.route(wf, call, servers, 1.0) == 1  # migrates to the best replica within the bound
    assert router.migrations == 1


def test_report_names_the_best_four_replica_combination(tmp_path):
    import json

    from serving_integration.experiments.rows import make_row
    from serving_integration.experiments.report import build

    rows = []
    for i, (replicas, routing, policy, hit, latency) in enumerate([
            (1, "round_robin", "lru", 0.40, 10.0), (1, "pbkv", "lru", 0.40, 10.0),
            (4, "round_robin", "lru", 0.20, 8.0), (4, "cache_aware", "lru", 0.30, 6.0),
            (4, "pbkv", "pbkv", 0.36, 5.0), (4, "sticky", "pbkv", 0.33, 5.5)]):
        labels = dict(workload="hover", policy=policy, gpu_tokens=600_000, concurrency=32, cost_model="h100",
                      workflows=10, calls=80, replicas=replicas, routing=routing)
        rows.append(make_row(labels, dict(
            hit_rate=hit, gpu_hit_tokens=int(hit * 1000), host_hit_tokens=0, miss_tokens=1000 - int(hit * 1000),
            prompt_tokens=1000, recompute_rate=1 - hit, mean_workflow_latency_s=latency,
            p99_workflow_latency_s=2 * latency, mean_ttft_s=0.1, prefetch_precision=None,
            load_imbalance=1.0 + i / 10, migrations=i)))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"rows": rows}))
    md = build([str(tmp_path / "run")], tmp_path / "report").read_text()
    section = md[md.index("## A cluster"):]
    section = section[:section.index("\n## ")]  # up to the next section
    assert "best **pbkv + pbkv** at 36.0% GPU hit rate" in section
    assert "hit rate x 1.80, latency speed-up 1.60 over round_robin + lru" in section  # one seed: no interval
    assert "hit rate x 1.20, latency speed-up 1.20 over cache_aware + lru" in section
    one_server = [line for line in section.splitlines() if line.startswith("| 1 |")]
    assert len(one_server) == 1 and "| none |" in one_server[0]  # one replica: routing cannot matter


# -------------------------------------------------------------------- the real cluster's client side
# (the servers themselves: tests/server/test_sglang_cluster.py)


def test_client_replicas_route_with_the_pbkv_router_class():
    """The bench's pbkv routing: PBKVRouting over ClientReplica views (what the client sent where)."""
    from serving_integration.cache.router import ClientReplica

    router, views = make_router("pbkv", 2), [ClientReplica(1000), ClientReplica(1000)]
    wf, other = SimWorkflow("w", 0, "t", []), SimWorkflow("v", 1, "t", [])
    views[1].sent(call_of(["sys", "w0"], [100, 50]))
    assert views[1].tree.peek(("sys", "w0", "w1")) == (2, 2) and views[0].tree.peek(("sys",)) == (0, 0)
    # the longest prefix the client sent: replica 1, though replica 0 is as loaded
    assert router.route(wf, call_of(["sys", "w0", "w1"], [100, 50, 20]), views, 0.0) == 1
    views[1].load = 3  # over the bound 1.25 x (3 + 1) / 2 + 1 = 3.5: the workflow migrates
    assert router.route(wf, call_of(["sys", "w0", "w1", "w2"], [100, 50, 20, 10]), views, 0.0) == 0
    assert router.migrations == 1
    views[1].load = 0  # nothing cached anywhere for a new prefix: the least loaded, then the lowest index
    views[0].load = 1
    assert router.route(other, call_of(["x"], [10]), views, 0.0) == 1
    # the record is cut back to the replica's capacity, least recently sent first
    views[0].sent(call_of(["a"], [600]))
    views[0].sent(call_of(["b"], [600]))
    assert views[0].tree.peek(("a",)) == (0, 0) and views[0].tree.peek(("b",)) == (1, 1)


def test_routing_headers_and_router_command():
    from serving_integration.server.cluster import (ROUTING_KEY_HEADER, TARGET_WORKER_HEADER, router_command,
                                                    router_parser, routing_headers)

    assert routing_headers("sticky", "wf-1") == {ROUTING_KEY_HEADER: "wf-1"} == {"x-smg-routing-key": "wf-1"}
    assert routing_headers("pbkv", "wf-1", 1) == {TARGET_WORKER_HEADER: "1"} == {"x-smg-target-worker": "1"}
    assert routing_headers("round_robin", "wf-1") == routing_headers("cache_aware", "wf-1") == {}
    with pytest.raises(ValueError, match="index"):
        routing_headers("pbkv", "wf-1")
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for routing, policy in (("sticky", "manual"), ("pbkv", "consistent_hashing"), ("cache_aware", "cache_aware")):
        cmd = router_command(urls, routing, 30000, 29000)
        # sglang-router's own parser (consistent_hashing added) reads what the cluster passes
        args = router_parser().parse_args(cmd[cmd.index("--host"):])
        assert args.policy == policy and args.worker_urls == urls and args.port == 30000
        assert args.assignment_mode == ("min_load" if routing == "sticky" else "random")
    with pytest.raises(ValueError, match="unknown routing"):
        router_command(urls, "none", 30000, 29000)


def test_cluster_arguments_are_checked_before_anything_starts(tmp_path):
    from serving_integration.server.cluster import LocalCluster

    with pytest.raises(ValueError, match="cluster's total"):
        LocalCluster(["--cpu", "--max-total-tokens", "100"], 2, "sticky", 4000, log_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown routing"):
        LocalCluster(["--cpu"], 2, "least_loaded", 4000, log_dir=tmp_path)
    cluster = LocalCluster(["--cpu"], 3, ["sticky", "pbkv"], 4000, log_dir=tmp_path)
    assert cluster.tokens_per_replica == 1333 and len(cluster.worker_urls) == 3
    assert all(s.launch_args[-4:-2] == ["--max-total-tokens", "1333"] for s in cluster.servers)


def test_server_metrics_parse_sglang_counters():
    from serving_integration.experiments.bench import replica_stats
    from serving_integration.server.cluster import parse_metrics

    text = "\n".join([
        "# TYPE sglang:num_requests_total counter",
        'sglang:num_requests_total{engine_type="unified",is_streaming="false"} 3.0',
        'sglang:num_requests_total{engine_type="unified",is_streaming="true"} 7.0',
        "# TYPE sglang:prompt_tokens_total counter",
        'sglang:prompt_tokens_total{engine_type="unified",is_streaming="true"} 1000.0',
        "# TYPE sglang:cached_tokens_total counter",
        'sglang:cached_tokens_total{cache_source="device",engine_type="unified"} 300.0',
        'sglang:cached_tokens_total{cache_source="host",engine_type="unified"} 200.0', ""])
    after = parse_metrics(text)
    assert after == {"requests": 10.0, "prompt_tokens": 1000.0, "cached_tokens_device": 300.0,
                     "cached_tokens_host": 200.0}
    before = {"requests": 2.0, "prompt_tokens": 200.0, "cached_tokens_device": 100.0}
    stats = replica_stats([before], [after], [{}])
    assert stats == [{"requests": 8, "prompt_tokens": 800, "device_tokens": 200, "host_tokens": 200,
                      "hit_rate": 0.25, "plugin_counters": {}, "live_workflows": None}]


def test_workflow_tag_travels_in_the_request_id():
    """sglang-router drops custom_params and kv_hints; the request id carries the tag through it."""
    from serving_integration.cache.workflow_tags import (BadTag, WorkflowTag, custom_params_for, end_signal_tag,
                                                         rid_for, tag_of_request)

    def req(rid, custom=None):
        return SimpleNamespace(rid=rid, kv_hints=None, sampling_params=SimpleNamespace(custom_params=custom))

    tag = WorkflowTag("wf-7", "verifier", 3, task="is the claim supported? ü")
    for t in (tag, end_signal_tag("wf-7", "verifier")):
        rid = rid_for(t, "wf-7/3/123")
        assert rid.startswith("pbkv1.") and rid.endswith(".wf-7/3/123")
        assert tag_of_request(req(rid)) == t
    assert rid_for(tag, "a") != rid_for(tag, "b")
    assert tag_of_request(req("wf-7/3/123")) is None  # a plain request id: no tag
    other = WorkflowTag("other", "a", 0)
    assert tag_of_request(req(rid_for(tag, "x"), custom_params_for(other))) == other  # custom_params first
    with pytest.raises(BadTag):
        tag_of_request(req("pbkv1.bm90IGpzb24.x"))  # "not json"
