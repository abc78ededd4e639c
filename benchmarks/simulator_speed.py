"""Cost of the serving simulator per policy, as the work grows, and of one eviction as the tree grows.

    python -m benchmarks.simulator_speed                    # hover, 1,000 workflows, every policy
    python -m benchmarks.simulator_speed --checkpoint RUN/predictor.pt --scaling 1000,10000,100000
    python -m benchmarks.simulator_speed --workload swebench --gpu-tokens 300000
    python -m benchmarks.simulator_speed --replicas 4 --routing pbkv   # a cluster (gpu_tokens: its total)

Replays every workflow of a generated dataset (all splits) under each policy (pbkv under each trust
mode, with the microseconds per call spent in its trust judge and the replay's slowdown against
trust=always), the best of --repeats replays (fewer once a policy's replays took REPEAT_BUDGET_S),
and prints wall time, simulated calls per second and the hit rate, then the offline upper bound on
the run's own request sequence (its LP size and solve time, apart from the replay's). The predictive
policies run on the perfect predictor; with `--checkpoint` (a train.py checkpoint trained on the
same workload) pbkv also runs on it, its predictions computed once per scheduler step (evaluate.py's
`predictor.tabulate=false`), tabled before the replay, and tabled with the online backoff around
them (evaluate.py's default for a learned predictor: it mixes in the transitions of the replay's own
calls, once per scheduler step). A replay's wall time includes computing its table. With
`--scaling`, a table of wall time, calls per second and peak resident memory of lru, pbkv (perfect
predictions, its default trust judge) and pbkv [always] (the paper's policy: no judge) at each
number of workflows, each replay in a fresh process (its peak is its own, loading the workload
included). Then it times evict_gpu on trees of growing size (the heap built first), to show how the
per-eviction cost grows with n; then runs one insert / match / lock / unlock / evict stream through
our tree and through SGLang 0.5.23's own `RadixCache` (CPU, `create_simulated`, as
tests/simulator/test_radix_vs_sglang.py builds it) in a fresh process and prints operations per
second of each and ours / theirs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import random
import resource
import statistics
import tempfile
import time

from data.generators import WORKLOADS
from serving_integration.cache.config import TRUST_MODES
from serving_integration.simulator.cost_model import CostModel
from serving_integration.cache.predictions import AgentStepGraph, ModelSource, OnlineBackoff, PerfectSource, vocabulary
from serving_integration.simulator.radix import RadixTree
from serving_integration.cache.workload import workflows_from_rows
from serving_integration.cache.workload import SimWorkflow
from serving_integration.simulator.engine import SimConfig, Simulator, bound_metrics, fewer_collections

JUDGED = ("pbkv", "pbkv_time")  # the policies with trust modes, each replayed under every mode
REPEAT_BUDGET_S = 10.0  # a policy's replays stop repeating once they took this long
H100 = CostModel("qwen3-14b-h100", params=14.8e9, layers=40, q_heads=40, kv_heads=8, head_dim=128, dtype_bytes=2,
                 peak_flops=989e12, mem_bandwidth=3.35e12, pcie_bandwidth=64e9)


def time_trust(sim: Simulator) -> list[float]:
    """Wrap each replica's trust judge (pbkv's or pbkv_time's, cache/trust.py) to sum the seconds spent in it; the
    returned one-element list fills as the replay runs."""
    total = [0.0]
    for server in sim.servers:
        judge = getattr(server.policy, "judge", None)
        if judge is None:
            continue
        for name in ("observe_call", "observe_insert", "observe_queued"):
            method = getattr(judge, name, None)
            if method is None:
                continue

            def timed(*args, _method=method, **kwargs):
                started = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    total[0] += time.perf_counter() - started
            setattr(judge, name, timed)
    return total


def generated(workload: str, n: int) -> list[SimWorkflow]:
    return workflows_from_rows(WORKLOADS[workload]().generate(n, seed=0).calls)


def checkpoint_runs(checkpoint: str, names: list[str]) -> dict:
    """pbkv on a trained predictor: predicted once per scheduler step, tabled before the replay, and
    tabled with the online backoff around it, as evaluate.py runs a learned predictor by default
    (predictor.online_backoff: it learns from the replay's own calls, so each replay gets a fresh one)."""
    from models import load_predictor

    predictor = load_predictor(checkpoint, agents=names[1:], max_unknown=0.5)
    family, tabled = predictor.family, ModelSource(predictor, tabulate=True)
    return {f"pbkv/{family} per step": {"predictions": ModelSource(predictor)},
            f"pbkv/{family} tabled": {"predictions": tabled},
            f"pbkv/{family} tabled, online backoff": {"fresh_predictions": lambda: OnlineBackoff(tabled)}}


def policy_speed(workload: str, n: int, gpu_tokens: int, concurrency: int, replicas: int = 1,
                 routing: str = "none", checkpoint: str | None = None, repeats: int = 3) -> dict:
    workflows = generated(workload, n)
    sequences = [[c.agent for c in w.calls] for w in workflows]
    names = vocabulary(a for s in sequences for a in s)
    runs = {"lru": {}, "lfu": {}, "tlru": {}, "pbkv_lae": {},
            "kvflow_ideal": {"predictions": AgentStepGraph.from_traces(sequences, 3), "prefetch": "aggressive"},
            "kvflow": {"predictions": AgentStepGraph.from_traces(sequences, 3), "prefetch": "kvflow"},
            "lru_prefetch": {"prefetch": "last_call"}, "continuum": {},
            **{f"{policy} [{trust}]": {"predictions": PerfectSource(names, 3), "policy_options": {"trust": trust}}
               for policy in JUDGED for trust in TRUST_MODES},
            "pbkv+conservative": {"predictions": PerfectSource(names, 3), "prefetch": "conservative"},
            "oracle": {"predictions": PerfectSource(names, 3)}}
    if checkpoint:
        runs.update(checkpoint_runs(checkpoint, names))
    calls = sum(len(w.calls) for w in workflows)
    config = SimConfig(gpu_tokens=gpu_tokens, concurrency=concurrency, replicas=replicas, routing=routing)
    print(f"{workload}: {n} workflows, {calls} calls, gpu_tokens={gpu_tokens}, concurrency={concurrency}, "
          f"replicas={replicas}, routing={routing}; predictions perfect unless the label names a predictor")
    print(f"{'policy':>38} {'wall s':>8} {'calls/s':>9} {'hit rate':>9} {'bound':>7} {'bound s':>8} "
          f"{'LP intervals':>12} {'LP rows':>8} {'nonzeros':>9} {'trust us/call':>13}")
    measured = []
    for label, kwargs in runs.items():
        if routing == "pbkv" and "predictions" not in kwargs and "fresh_predictions" not in kwargs:
            kwargs = {**kwargs, "predictions": PerfectSource(names, 3)}
        policy = label.split("+")[0].split(" ")[0].split("/")[0]
        # the best of `repeats` replays (one slow replay of a shared machine does not set a policy's
        # figure), fewer for a policy whose replays already took REPEAT_BUDGET_S (pbkv per step)
        best, spent = None, 0.0
        for _ in range(repeats):
            if spent >= REPEAT_BUDGET_S:
                break
            fresh = [SimWorkflow(w.id, w.order, w.task, w.calls) for w in workflows]
            replay_kwargs = dict(kwargs)
            if "fresh_predictions" in replay_kwargs:  # a source that learns from its replay: a new one each
                replay_kwargs["predictions"] = replay_kwargs.pop("fresh_predictions")()
            started = time.perf_counter()
            with fewer_collections():  # as simulate() builds and runs a replay
                sim = Simulator(fresh, config, H100, policy=policy, **replay_kwargs)
                judged = time_trust(sim)
                counters = sim.run()
            wall = time.perf_counter() - started
            spent += wall
            if best is None or wall < best[0]:
                best = (wall, sim, counters, judged[0])
        wall, sim, counters, trust_s = best
        started = time.perf_counter()
        bound = bound_metrics(sim, reuse=False)  # the upper bound on the run's own sequence, solved (bound.py)
        bound_wall = time.perf_counter() - started
        print(f"{label:>38} {wall:8.2f} {calls / wall:9.0f} {counters.gpu_hit_tokens / counters.prompt_tokens:9.1%} "
              f"{bound['bound_hit_rate']:7.1%} {bound_wall:8.2f} {bound['bound_intervals']:12d} "
              f"{bound['bound_rows']:8d} {bound['bound_nonzeros']:9d} {trust_s / calls * 1e6:13.1f}")
        measured.append({"policy": label, "wall_s": wall, "calls_per_s": calls / wall,
                         "hit_rate": counters.gpu_hit_tokens / counters.prompt_tokens,
                         "bound_hit_rate": bound["bound_hit_rate"], "bound_s": bound_wall,
                         "bound_intervals": bound["bound_intervals"], "trust_us_per_call": trust_s / calls * 1e6})
    by = {m["policy"]: m for m in measured}
    for policy in JUDGED:
        always = by.get(f"{policy} [always]")
        for trust in TRUST_MODES:
            m = by.get(f"{policy} [{trust}]")
            if m and always and trust != "always":
                m["slowdown_vs_always"] = m["wall_s"] / always["wall_s"] - 1
                print(f"{policy} trust={trust}: {m['trust_us_per_call']:.1f} us per call in its judge, replay "
                      f"{m['slowdown_vs_always']:+.1%} against trust=always (best of {repeats})")
    return {"workload": workload, "workflows": n, "calls": calls, "gpu_tokens": gpu_tokens,
            "concurrency": concurrency, "replicas": replicas, "routing": routing, "repeats": repeats,
            "policies": measured}


def one_replay(path: str, label: str, gpu_tokens: int, concurrency: int) -> tuple:
    """In a fresh process: load the pickled calls of a generated workload and replay them under
    `label` (a policy, with its trust mode in brackets where not the default); (calls, wall s of
    the replay, hit rate, peak resident MiB of the process)."""
    with open(path, "rb") as f:
        workflows = workflows_from_rows(pickle.load(f))
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    policy, _, trust = label.rstrip("]").partition(" [")
    kwargs = {"predictions": PerfectSource(names, 3)} if policy != "lru" else {}
    if trust:
        kwargs["policy_options"] = {"trust": trust}
    started = time.perf_counter()
    with fewer_collections():  # as simulate() builds and runs a replay
        counters = Simulator(workflows, SimConfig(gpu_tokens=gpu_tokens, concurrency=concurrency), H100,
                             policy=policy, **kwargs).run()
    wall = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return sum(len(w.calls) for w in workflows), wall, counters.gpu_hit_tokens / counters.prompt_tokens, peak_mib


def in_fresh_process(fn, *args):
    """fn(*args) in a new interpreter (spawned, not forked): its timing and peak memory are its own,
    not shaped by what this process allocated before (the 100,000-leaf trees, the big replays)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def scaling(workload: str, sizes: list[int], gpu_tokens: int, concurrency: int,
            policies=("lru", "pbkv", "pbkv [always]")) -> dict:
    print(f"\nscaling: {workload}, gpu_tokens={gpu_tokens}, concurrency={concurrency}, pbkv on perfect predictions; "
          "each replay in a fresh process (peak: that process, loading the workload included)")
    print(f"{'workflows':>10} {'policy':>14} {'calls':>9} {'wall s':>8} {'calls/s':>9} {'hit rate':>9} {'peak MiB':>9}")
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as scratch:
            path = f"{scratch}/calls.pkl"
            with open(path, "wb") as f:  # generated once here (about 0.4 ms a hover workflow), replayed by each child
                pickle.dump(WORKLOADS[workload]().generate(n, seed=0).calls, f)
            for policy in policies:
                calls, wall, hit, peak = in_fresh_process(one_replay, path, policy, gpu_tokens, concurrency)
                print(f"{n:>10} {policy:>14} {calls:>9} {wall:8.2f} {calls / wall:9.0f} {hit:9.1%} {peak:9.0f}")
                rows.append({"workflows": n, "policy": policy, "calls": calls, "wall_s": wall,
                             "calls_per_s": calls / wall, "hit_rate": hit, "peak_mib": peak})
    return {"workload": workload, "gpu_tokens": gpu_tokens, "concurrency": concurrency, "rows": rows}


def eviction_cost(sizes=(1_000, 10_000, 100_000), evictions=2_000) -> dict[int, float]:
    print("\nper-eviction cost of RadixTree.evict_gpu (LRU) after the first (which builds the heap), "
          "microseconds, median of 5")
    medians = {}
    for size in sizes:
        samples = []
        for trial in range(5):
            rng = random.Random(trial)
            tree = RadixTree(gpu_tokens=10**12)
            for i in range(size):  # branches of 3 nodes under shared prefixes
                units = [rng.randrange(50), rng.randrange(50), i]
                tree.private_gpu += 3
                tree.insert(units, [1, 1, 1])
                tree.private_gpu -= 3
            # the first eviction enters every inserted node in the heap (RadixTree._flush): once
            # per tree, n pushes, not a cost of each eviction; it is left out of the timing
            tree.evict_gpu(1)
            started = time.perf_counter()
            for _ in range(evictions):
                tree.evict_gpu(1)
            samples.append((time.perf_counter() - started) / evictions * 1e6)
        medians[size] = statistics.median(samples)
        print(f"  {size:>7} leaves: {medians[size]:6.2f} us per eviction")
    return medians


def tree_stream(n_ops: int = 20_000, seed: int = 0) -> list[tuple]:
    """Workflow-like operations: prompts share one of 50 64-token prefixes, then 8-64 tokens of their own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(30_000) for _ in range(64)] for _ in range(50)]
    ops = []
    for _ in range(n_ops):
        r = rng.random()
        tokens = tuple(rng.choice(prefixes) + [rng.randrange(30_000) for _ in range(rng.randint(8, 64))])
        if r < 0.4:
            ops.append(("insert", tokens))
        elif r < 0.7:
            ops.append(("match", tokens, rng.random() < 0.3))
        elif r < 0.8:
            ops.append(("unlock", rng.random()))
        else:
            ops.append(("evict", rng.randint(16, 256)))
    return ops


def run_ours(ops) -> int:
    tree, locked = RadixTree(gpu_tokens=10**12), []
    for op in ops:
        if op[0] == "insert":
            tree.insert(op[1], [1] * len(op[1]))
        elif op[0] == "match":
            path = tree.match(op[1], [1] * len(op[1]))
            if path and op[2]:
                tree.lock(path[-1])
                locked.append(path[-1])
        elif op[0] == "unlock":
            if locked:
                tree.unlock(locked.pop(int(op[1] * len(locked))))
        else:
            tree.evict_gpu(op[1])
    return tree.gpu_used


def run_sglang(ops) -> int:
    from array import array

    from serving_integration.server.compat import install_torchvision_guard

    install_torchvision_guard()
    import sglang.srt.mem_cache.radix_cache as radix_cache
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

    class FreedSlots:  # create_simulated's documented mock allocator: counts freed slots, no GPU
        device = "cpu"

        def free_segment(self, value, start_pos=0):
            pass

    tree, locked = radix_cache.RadixCache.create_simulated(mock_allocator=FreedSlots()), []

    def key(tokens):
        return radix_cache.RadixKey(token_ids=array("q", tokens))

    for op in ops:
        if op[0] == "insert":
            tree.insert(InsertParams(key=key(op[1])))
        elif op[0] == "match":
            result = tree.match_prefix(MatchPrefixParams(key=key(op[1])))
            if result.device_prefix_len and op[2]:
                tree.inc_lock_ref(result.last_device_node)
                locked.append(result.last_device_node)
        elif op[0] == "unlock":
            if locked:
                tree.dec_lock_ref(locked.pop(int(op[1] * len(locked))))
        else:
            tree.evict(EvictParams(num_tokens=op[1]))
    return tree.total_size()


def tree_vs_sglang(n_ops: int = 20_000) -> dict:
    ops = tree_stream(n_ops)
    run_sglang(ops[:200])  # imports and first-call costs outside the timing
    timings = {}
    for name, run in (("ours", run_ours), ("sglang", run_sglang)):
        samples = []
        for _ in range(3):
            started = time.perf_counter()
            size = run(ops)
            samples.append(time.perf_counter() - started)
        timings[name] = (min(samples), size)
    (ours, our_size), (theirs, their_size) = timings["ours"], timings["sglang"]
    print(f"\none stream of {n_ops:,} insert / match / lock / unlock / evict operations (best of 3)")
    print(f"  our RadixTree:        {n_ops / ours:10,.0f} ops/s   (tokens cached at the end: {our_size:,})")
    print(f"  SGLang RadixCache:    {n_ops / theirs:10,.0f} ops/s   (tokens cached at the end: {their_size:,})")
    print(f"  ours / theirs:        {theirs / ours:10.2f}x")
    return {"ops": n_ops, "ours_ops_per_s": n_ops / ours, "sglang_ops_per_s": n_ops / theirs, "ratio": theirs / ours}


def how_compiled() -> str:
    """Whether the replay's hot modules run from their Cython builds (serving_integration/compiled.py)."""
    import importlib

    from serving_integration.compiled import MODULES, loaded

    for name in MODULES:
        importlib.import_module(name)
    built = len(loaded())
    return f"its hot modules compiled ({built} of {len(MODULES)}: serving_integration/compiled.py)" if built \
        else "its hot modules interpreted"


def results_json(speed: dict | None, evictions: dict | None, tree: dict, grown: dict | None = None) -> dict:
    """The figures and tables of the results page (experiments.results, a `bench` step)."""
    figures, tables = [], []
    if speed:
        by = {m["policy"]: m for m in speed["policies"]}
        figures += [{"name": f"simulated calls/s, {name} ({speed['workload']}, {speed['calls']:,} calls)",
                     "value": f"{m['calls_per_s']:,.0f}"} for name, m in by.items()
                    if name in ("lru", "pbkv [outcome]", "pbkv_time [outcome]", "kvflow", "kvflow_ideal")
                    or name.startswith("pbkv/")]
        figures += [{"name": f"{policy} trust={trust}: its judge per call, and the replay against trust=always",
                     "value": f"{by[f'{policy} [{trust}]']['trust_us_per_call']:.1f} us, "
                              f"{by[f'{policy} [{trust}]']['slowdown_vs_always']:+.1%}"}
                    for policy in JUDGED for trust in TRUST_MODES
                    if "slowdown_vs_always" in by.get(f"{policy} [{trust}]", {})]
        slowest = max(speed["policies"], key=lambda m: m["bound_s"])
        figures.append({"name": f"upper bound's LP solve ({slowest['bound_intervals']:,} intervals, HiGHS)",
                        "value": f"{slowest['bound_s']:.2f} s (largest of the policies' runs)"})
        tables.append({"title": f"{speed['workload']}: {speed['workflows']:,} workflows, {speed['calls']:,} calls, "
                                f"{speed['gpu_tokens']:,} GPU tokens, {speed['concurrency']} live workflows "
                                f"(each policy the best of {speed['repeats']} replays, fewer past "
                                f"{REPEAT_BUDGET_S:.0f} s)",
                       "head": ["policy", "wall s", "calls/s", "GPU hit rate", "upper bound", "bound solve s",
                                "LP intervals", "trust judge us/call"],
                       "rows": [[m["policy"], f"{m['wall_s']:.2f}", f"{m['calls_per_s']:,.0f}", f"{m['hit_rate']:.1%}",
                                 f"{m['bound_hit_rate']:.1%}", f"{m['bound_s']:.2f}", f"{m['bound_intervals']:,}",
                                 f"{m['trust_us_per_call']:.1f}"]
                                for m in speed["policies"]]})
    if grown:
        tables.append({"title": f"as the work grows: {grown['workload']}, {grown['gpu_tokens']:,} GPU tokens, "
                                f"{grown['concurrency']} live workflows (pbkv: perfect predictions, its default trust "
                                "judge; [always]: no judge; each replay in a fresh process, peak memory includes "
                                "loading the workload)",
                       "head": ["workflows", "policy", "calls", "wall s", "calls/s", "GPU hit rate", "peak MiB"],
                       "rows": [[f"{r['workflows']:,}", r["policy"], f"{r['calls']:,}", f"{r['wall_s']:.1f}",
                                 f"{r['calls_per_s']:,.0f}", f"{r['hit_rate']:.1%}", f"{r['peak_mib']:,.0f}"]
                                for r in grown["rows"]]})
        largest = [r for r in grown["rows"] if r["workflows"] == max(r["workflows"] for r in grown["rows"])]
        figures.append({"name": f"replay of {largest[0]['workflows']:,} {grown['workload']} workflows "
                                f"({largest[0]['calls']:,} calls): wall time, peak memory",
                        "value": "; ".join(f"{r['policy']} {r['wall_s']:.0f} s, {r['peak_mib']:,.0f} MiB"
                                           for r in largest)})
    if evictions:
        tables.append({"title": "one GPU eviction (LRU) once the heap is built, median of 5", "head": ["evictable leaves", "us per eviction"],
                       "rows": [[f"{n:,}", f"{us:.2f}"] for n, us in evictions.items()]})
        largest = max(evictions)
        figures.append({"name": f"one GPU eviction with {largest:,} evictable leaves", "value": f"{evictions[largest]:.1f} us"})
    figures.append({"name": f"our radix tree against SGLang 0.5.23's RadixCache ({tree['ops']:,} operations)",
                    "value": f"{tree['ours_ops_per_s']:,.0f} against {tree['sglang_ops_per_s']:,.0f} ops/s "
                             f"({tree['ratio']:.2f}x)"})
    tables.append({"title": "one operation stream through both trees (best of 3, in a fresh process)",
                   "head": ["tree", "ops/s"],
                   "rows": [["ours (simulator/radix.py)", f"{tree['ours_ops_per_s']:,.0f}"],
                            ["SGLang RadixCache", f"{tree['sglang_ops_per_s']:,.0f}"]]})
    return {"about": "benchmarks/simulator_speed.py: the serving simulator per policy (perfect predictions for "
                     "pbkv unless a row names a predictor), as the number of workflows grows, one eviction as the "
                     "tree grows, and our radix tree against SGLang's. One process on a shared 2-core machine; "
                     f"the simulator ran with {how_compiled()}.",
            "figures": figures, "tables": tables}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hover", choices=sorted(WORKLOADS))
    parser.add_argument("--n-workflows", type=int, default=1000)
    parser.add_argument("--gpu-tokens", type=int, default=300_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--routing", default="none")
    parser.add_argument("--checkpoint", help="a train.py checkpoint: pbkv on it too (per step, tabled, "
                                             "tabled with the online backoff)")
    parser.add_argument("--scaling", help="comma-separated numbers of workflows for the scaling table, e.g. 1000,10000")
    parser.add_argument("--repeats", type=int, default=3, help="replays per policy, the best wall time counted "
                        f"(fewer once {REPEAT_BUDGET_S:.0f} s are spent)")
    parser.add_argument("--no-eviction-cost", action="store_true", help="skip the evict_gpu timing")
    parser.add_argument("--tree-ops", type=int, default=20_000, help="operations of the tree-vs-SGLang stream")
    parser.add_argument("--only-tree-vs-sglang", action="store_true")
    parser.add_argument("--json", help="also write the figures and tables for the results page here")
    args = parser.parse_args()
    speed = evictions = grown = None
    print(f"the simulator runs with {how_compiled()}")
    if not args.only_tree_vs_sglang:
        speed = policy_speed(args.workload, args.n_workflows, args.gpu_tokens, args.concurrency, args.replicas,
                             args.routing, args.checkpoint, args.repeats)
        if args.scaling:
            grown = scaling(args.workload, [int(n) for n in args.scaling.split(",")], args.gpu_tokens, args.concurrency)
        if not args.no_eviction_cost:
            evictions = eviction_cost()
    # in a fresh process: run after the replays and the eviction trees in this one, the stream
    # measured 2.23x once where alone it measured 3.09-3.18x (2026-12-06)
    tree = in_fresh_process(tree_vs_sglang, args.tree_ops)
    if args.json:
        from data.atomic import write_json

        write_json(args.json, results_json(speed, evictions, tree, grown))


if __name__ == "__main__":
    main()
