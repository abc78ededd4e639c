"""Cost of the serving simulator per policy, and of one eviction as the tree grows.

    python -m benchmarks.simulator_speed                    # hover, 1,000 workflows, every policy
    python -m benchmarks.simulator_speed --workload swebench --gpu-tokens 300000
    python -m benchmarks.simulator_speed --replicas 4 --routing pbkv   # a cluster (gpu_tokens: its total)

Replays every workflow of a generated dataset (all splits) under each policy and prints wall
time, simulated calls per second and the hit rate, then the offline upper bound on the run's own
request sequence (its LP size and solve time, apart from the replay's); then times evict_gpu on trees of
growing size, to show the per-eviction cost grows like log n (heap), not n (scan).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from data.generators import WORKLOADS
from serving_integration.simulator.cost_model import CostModel
from serving_integration.cache.predictions import AgentStepGraph, PerfectSource, vocabulary
from serving_integration.simulator.radix import RadixTree
from serving_integration.cache.workload import workflows_from_rows
from serving_integration.cache.workload import SimWorkflow
from serving_integration.simulator.engine import SimConfig, Simulator, bound_metrics

H100 = CostModel("qwen3-14b-h100", params=14.8e9, layers=40, q_heads=40, kv_heads=8, head_dim=128, dtype_bytes=2,
                 peak_flops=989e12, mem_bandwidth=3.35e12, pcie_bandwidth=64e9)


def policy_speed(workload: str, n: int, gpu_tokens: int, concurrency: int, replicas: int = 1,
                 routing: str = "none") -> None:
    workflows = workflows_from_rows(WORKLOADS[workload]().generate(n, seed=0).calls)
    sequences = [[c.agent for c in w.calls] for w in workflows]
    names = vocabulary(a for s in sequences for a in s)
    runs = {"lru": {}, "lfu": {}, "tlru": {}, "pbkv_lae": {},
            "kvflow": {"predictions": AgentStepGraph.from_traces(sequences, 3), "prefetch": "aggressive"},
            "pbkv": {"predictions": PerfectSource(names, 3)},
            "pbkv+conservative": {"predictions": PerfectSource(names, 3), "prefetch": "conservative"},
            "oracle": {"predictions": PerfectSource(names, 3)}}
    calls = sum(len(w.calls) for w in workflows)
    config = SimConfig(gpu_tokens=gpu_tokens, concurrency=concurrency, replicas=replicas, routing=routing)
    print(f"{workload}: {n} workflows, {calls} calls, gpu_tokens={gpu_tokens}, concurrency={concurrency}, "
          f"replicas={replicas}, routing={routing}")
    print(f"{'policy':>18} {'wall s':>8} {'calls/s':>9} {'hit rate':>9} {'bound':>7} {'bound s':>8} "
          f"{'LP intervals':>12} {'LP rows':>8} {'nonzeros':>9}")
    for label, kwargs in runs.items():
        fresh = [SimWorkflow(w.id, w.order, w.task, w.calls) for w in workflows]
        started = time.perf_counter()
        if routing == "pbkv" and "predictions" not in kwargs:
            kwargs = {**kwargs, "predictions": PerfectSource(names, 3)}
        sim = Simulator(fresh, config, H100, policy=label.split("+")[0], **kwargs)
        counters = sim.run()
        wall = time.perf_counter() - started
        started = time.perf_counter()
        bound = bound_metrics(sim)  # the offline upper bound on the run's own sequence (simulator/bound.py)
        bound_wall = time.perf_counter() - started
        print(f"{label:>18} {wall:8.2f} {calls / wall:9.0f} {counters.gpu_hit_tokens / counters.prompt_tokens:9.1%} "
              f"{bound['bound_hit_rate']:7.1%} {bound_wall:8.2f} {bound['bound_intervals']:12d} "
              f"{bound['bound_rows']:8d} {bound['bound_nonzeros']:9d}")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hover", choices=sorted(WORKLOADS))
    parser.add_argument("--n-workflows", type=int, default=1000)
    parser.add_argument("--gpu-tokens", type=int, default=300_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--routing", default="none")
    parser.add_argument("--no-eviction-cost", action="store_true", help="skip the evict_gpu timing")
    args = parser.parse_args()
    policy_speed(args.workload, args.n_workflows, args.gpu_tokens, args.concurrency, args.replicas, args.routing)
    if args.no_eviction_cost:
        return
    eviction_cost()


if __name__ == "__main__":
    main()
