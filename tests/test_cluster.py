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
from tests.test_simulator import H100

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

    from serving_integration.experiments.presentation import make_row
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
    section = md[md.index("## A cluster"):md.index("## Plots")]
    assert "best **pbkv + pbkv** at 36.0% GPU hit rate" in section
    assert "x1.80 hit rate, x1.60 latency speed-up over round_robin + lru" in section
    assert "x1.20 hit rate, x1.20 latency speed-up over cache_aware + lru" in section
    one_server = [line for line in section.splitlines() if line.startswith("| 1 |")]
    assert len(one_server) == 1 and "| none |" in one_server[0]  # one replica: routing cannot matter


def test_evaluate_runs_a_cluster(tmp_path, tmp_path_factory):
    from tests.test_evaluate import evaluate

    summary, stdout = evaluate(tmp_path / "run", "sim.replicas=2", "sim.routing=pbkv", "policies=[lru,pbkv]",
                               "pbkv.trust=adaptive", "prefetch=[none]", cache=tmp_path_factory.mktemp("data-cache"))
    rows = summary["rows"]
    assert [(r["policy"], r["replicas"], r["routing"]) for r in rows] == [("lru", 2, "pbkv"), ("pbkv", 2, "pbkv")]
    for r in rows:
        assert r["gpu_hit_tokens"] + r["host_hit_tokens"] + r["miss_tokens"] == r["prompt_tokens"]
        assert sum(r["replica_calls"]) == r["calls"] and r["load_imbalance"] >= 1.0
        assert r["predictor"] == "markov"  # the pbkv router reads the learned predictor, whatever evicts
    assert "2 replicas (gpu_tokens in total), routing=pbkv" in stdout
