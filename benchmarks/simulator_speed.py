"""Cost of the serving simulator per policy, as the work grows, and of one eviction as the tree grows.

    python -m benchmarks.simulator_speed                    # hover, 1,000 workflows, every policy
    python -m benchmarks.simulator_speed --checkpoint RUN/predictor.pt   # pbkv driven by a trained predictor too
    python -m benchmarks.simulator_speed --scaling 1000,10000,100000     # the scaling table up to 100k workflows
    python -m benchmarks.simulator_speed --workload swebench --gpu-tokens 300000
    python -m benchmarks.simulator_speed --replicas 4 --routing pbkv   # a cluster (gpu_tokens: its total)

Replays every workflow of a generated dataset (all splits) under each policy and prints wall
time, simulated calls per second and the hit rate, then the offline upper bound on the run's own
request sequence (its LP size and solve time, apart from the replay's). The predictive policies
run on the perfect predictor; with `--checkpoint` (a train.py checkpoint, e.g. graphsage trained on
a generated hover dataset) pbkv also runs on it three ways: called once per scheduler step (the
default, what evaluate.py does), tabled before the replay (`ModelSource(tabulate=True)`), and
tabled with online backoff on top (evaluate's `predictor.online`). Then a scaling table: wall
time, calls per second and peak resident memory of lru and pbkv (perfect) on 1k and 10k
workflows (`--scaling`; each run in a fresh process, so its peak is its own); then times
evict_gpu on trees of growing size, to show the per-eviction cost grows like log n (heap), not n
(scan); then runs one insert / match / lock / unlock / evict stream through our tree and through
SGLang 0.5.23's own `RadixCache` (CPU, `create_simulated`, as tests/test_radix_vs_sglang.py builds
it) in this process and prints operations per second of each and ours / theirs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import resource
import statistics
import time

from data.generators import WORKLOADS
from serving_integration.simulator.cost_model import CostModel
from serving_integration.cache.predictions import AgentStepGraph, ModelSource, OnlineBackoff, PerfectSource, vocabulary
from serving_integration.simulator.radix import RadixTree
from serving_integration.cache.workload import workflows_from_rows
from serving_integration.cache.workload import SimWorkflow
from serving_integration.simulator.engine import SimConfig, Simulator, bound_metrics

H100 = CostModel("qwen3-14b-h100", params=14.8e9, layers=40, q_heads=40, kv_heads=8, head_dim=128, dtype_bytes=2,
                 peak_flops=989e12, mem_bandwidth=3.35e12, pcie_bandwidth=64e9)


def hover_like(workload: str, n: int) -> list[SimWorkflow]:
    return workflows_from_rows(WORKLOADS[workload]().generate(n, seed=0).calls)


def model_runs(checkpoint: str, names: list[str]) -> dict:
    """pbkv on a trained predictor: per-step batches, tabled, tabled with online backoff."""
    from models import load_predictor

    predictor = load_predictor(checkpoint, agents=names[1:], max_unknown=0.5)
    family = predictor.family
    return {f"pbkv/{family}/step": {"predictions": ModelSource(predictor)},
            f"pbkv/{family}/tabled": {"predictions": ModelSource(predictor, tabulate=True)},
            f"pbkv/{family}/tabled+online": {"predictions": OnlineBackoff(ModelSource(predictor, tabulate=True))}}


def policy_speed(workload: str, n: int, gpu_tokens: int, concurrency: int, replicas: int = 1,
                 routing: str = "none", checkpoint: str | None = None) -> None:
    workflows = hover_like(workload, n)
    sequences = [[c.agent for c in w.calls] for w in workflows]
    names = vocabulary(a for s in sequences for a in s)
    runs = {"lru": {}, "lfu": {}, "tlru": {}, "pbkv_lae": {},
            "kvflow": {"predictions": AgentStepGraph.from_traces(sequences, 3), "prefetch": "aggressive"},
            "pbkv": {"predictions": PerfectSource(names, 3)},
            "pbkv+conservative": {"predictions": PerfectSource(names, 3), "prefetch": "conservative"},
            "oracle": {"predictions": PerfectSource(names, 3)}}
    if checkpoint:
        runs.update(model_runs(checkpoint, names))
    calls = sum(len(w.calls) for w in workflows)
    config = SimConfig(gpu_tokens=gpu_tokens, concurrency=concurrency, replicas=replicas, routing=routing)
    print(f"{workload}: {n} workflows, {calls} calls, gpu_tokens={gpu_tokens}, concurrency={concurrency}, "
          f"replicas={replicas}, routing={routing}; predictions perfect unless the label names a predictor")
    print(f"{'policy':>28} {'wall s':>8} {'calls/s':>9} {'hit rate':>9} {'bound':>7} {'bound s':>8} "
          f"{'LP intervals':>12} {'LP rows':>8} {'nonzeros':>9}")
    for label, kwargs in runs.items():
        fresh = [SimWorkflow(w.id, w.order, w.task, w.calls) for w in workflows]
        started = time.perf_counter()
        if routing == "pbkv" and "predictions" not in kwargs:
            kwargs = {**kwargs, "predictions": PerfectSource(names, 3)}
        sim = Simulator(fresh, config, H100, policy=label.split("+")[0].split("/")[0], **kwargs)
        counters = sim.run()  # the wall time includes tabling the predictions (Simulator's constructor)
        wall = time.perf_counter() - started
        started = time.perf_counter()
        bound = bound_metrics(sim)  # the offline upper bound on the run's own sequence (simulator/bound.py)
        bound_wall = time.perf_counter() - started
        print(f"{label:>28} {wall:8.2f} {calls / wall:9.0f} {counters.gpu_hit_tokens / counters.prompt_tokens:9.1%} "
              f"{bound['bound_hit_rate']:7.1%} {bound_wall:8.2f} {bound['bound_intervals']:12d} "
              f"{bound['bound_rows']:8d} {bound['bound_nonzeros']:9d}")


def one_replay(workload: str, n: int, policy: str, gpu_tokens: int, concurrency: int) -> tuple:
    """In a fresh process: generate n workflows and replay them; (calls, wall s of the replay,
    hit rate, peak resident MiB of the process)."""
    workflows = hover_like(workload, n)
    names = vocabulary(c.agent for w in workflows for c in w.calls)
    kwargs = {"predictions": PerfectSource(names, 3)} if policy != "lru" else {}
    started = time.perf_counter()
    counters = Simulator(workflows, SimConfig(gpu_tokens=gpu_tokens, concurrency=concurrency), H100,
                         policy=policy, **kwargs).run()
    wall = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return sum(len(w.calls) for w in workflows), wall, counters.gpu_hit_tokens / counters.prompt_tokens, peak_mib


def scaling(workload: str, sizes: list[int], gpu_tokens: int, concurrency: int, policies=("lru", "pbkv")) -> None:
    print(f"\nscaling: {workload}, gpu_tokens={gpu_tokens}, concurrency={concurrency}, pbkv on perfect predictions; "
          "each replay in a fresh process (peak: that process, generation included)")
    print(f"{'workflows':>10} {'policy':>8} {'calls':>9} {'wall s':>8} {'calls/s':>9} {'hit rate':>9} {'peak MiB':>9}")
    context = multiprocessing.get_context("spawn")
    for n in sizes:
        for policy in policies:
            with context.Pool(1) as pool:
                calls, wall, hit, peak = pool.apply(one_replay, (workload, n, policy, gpu_tokens, concurrency))
            print(f"{n:>10} {policy:>8} {calls:>9} {wall:8.2f} {calls / wall:9.0f} {hit:9.1%} {peak:9.0f}")


def eviction_cost(sizes=(1_000, 10_000, 100_000), evictions=2_000) -> None:
    print("\nper-eviction cost of RadixTree.evict_gpu (LRU), microseconds, median of 5")
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
            started = time.perf_counter()
            for _ in range(evictions):
                tree.evict_gpu(1)
            samples.append((time.perf_counter() - started) / evictions * 1e6)
        print(f"  {size:>7} leaves: {statistics.median(samples):6.2f} us per eviction")


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


def tree_vs_sglang(n_ops: int = 20_000) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hover", choices=sorted(WORKLOADS))
    parser.add_argument("--n-workflows", type=int, default=1000)
    parser.add_argument("--gpu-tokens", type=int, default=300_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--routing", default="none")
    parser.add_argument("--checkpoint", help="a train.py checkpoint (e.g. graphsage on hover): pbkv rows driven by it")
    parser.add_argument("--scaling", default="1000,10000",
                        help="workflow counts of the scaling table, comma separated ('' skips it; 100000 takes minutes)")
    parser.add_argument("--no-eviction-cost", action="store_true", help="skip the evict_gpu timing")
    parser.add_argument("--no-tree-vs-sglang", action="store_true", help="skip the tree-vs-SGLang stream")
    parser.add_argument("--tree-ops", type=int, default=20_000, help="operations of the tree-vs-SGLang stream")
    parser.add_argument("--only-tree-vs-sglang", action="store_true")
    args = parser.parse_args()
    if not args.only_tree_vs_sglang:
        policy_speed(args.workload, args.n_workflows, args.gpu_tokens, args.concurrency, args.replicas, args.routing,
                     args.checkpoint)
        if args.scaling:
            scaling(args.workload, [int(n) for n in args.scaling.split(",")], args.gpu_tokens, args.concurrency)
        if not args.no_eviction_cost:
            eviction_cost()
    if not args.no_tree_vs_sglang:
        tree_vs_sglang(args.tree_ops)


if __name__ == "__main__":
    main()
