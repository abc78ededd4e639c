"""Cost per call of the PBKV plugin's runtime in an SGLang scheduler, per pbkv trust mode.

    python -m benchmarks.plugin_overhead                      # hover, 200 workflows, 32 live
    python -m benchmarks.plugin_overhead --workload swebench --n-workflows 100

Drives `server/runtime.py` `WorkflowRuntime` (the object the plugin's hooks call; it imports no
SGLang) as the hooks do, without a server: per call, the request's first checkpoint (`on_cached`,
the path's node ids), its release (`on_finished`) and the next scheduler step's batched prediction
round (`run_predictions`, an order-1 Markov checkpoint fitted on the workflows themselves). Each
call carries the token ids a bench client would send (a segment's ids drawn from its id, so shared
segments share tokens). Prints microseconds per call of those three hooks under trust=always,
accuracy and outcome (the best of --repeats), and the difference against always: what the trust
judge costs the scheduler thread (outcome: hashing a sampled call's token blocks, and its shadows).
"""

from __future__ import annotations

import argparse
import random
import time
import types

from data.generators import WORKLOADS
from models.markov import MarkovPredictor
from serving_integration.cache.config import TRUST_MODES
from serving_integration.cache.predictions import ModelSource, vocabulary
from serving_integration.cache.workload import workflows_from_rows
from serving_integration.server.runtime import PluginConfig, WorkflowRuntime


def segment_tokens(unit, length: int, cache: dict) -> list[int]:
    tokens = cache.get(unit)
    if tokens is None or len(tokens) != length:
        rng = random.Random(str(unit))
        tokens = cache[unit] = [rng.randrange(32_000) for _ in range(length)]
    return tokens


def requests(workload: str, n: int, concurrency: int):
    """(request, node ids) per call in a closed-loop order: `concurrency` workflows interleaved."""
    workflows = workflows_from_rows(WORKLOADS[workload]().generate(n, seed=0).calls)
    cache, order, live, queue, rid = {}, [], [], list(workflows), 0
    node_of: dict = {}
    while queue or live:
        while queue and len(live) < concurrency:
            live.append([queue.pop(0), 0])
        for entry in list(live):
            wf, j = entry
            call = wf.calls[j]
            tokens = [t for unit, length in zip(call.units, call.lens) for t in segment_tokens(unit, length, cache)]
            output = segment_tokens(call.output_unit, call.output_tokens, cache)
            rid += 1
            tag = {"workflow_id": wf.id, "agent": call.agent, "step": j, "workflow_end": j == len(wf.calls) - 1}
            req = types.SimpleNamespace(rid=f"r{rid}", kv_hints=None, origin_input_ids=tokens, output_ids=output,
                                        sampling_params=types.SimpleNamespace(custom_params={"pbkv": tag}))
            nodes = [node_of.setdefault(key, len(node_of) + 1) for key in call.keys]
            order.append((req, nodes))
            entry[1] += 1
            if entry[1] == len(wf.calls):
                live.remove(entry)
    agents = [[c.agent for c in w.calls] for w in workflows]
    return order, agents


def hook_cost(trust: str, calls: list, predictor, gpu_tokens: int) -> float:
    """Seconds of on_cached + on_finished + run_predictions over the calls under one trust mode."""
    runtime = WorkflowRuntime("pbkv", PluginConfig(trust=trust, predictor_timeout_s=0), ModelSource(predictor))
    runtime.policy.set_capacity(gpu_tokens)
    started = time.perf_counter()
    for req, nodes in calls:
        runtime.on_cached(req, nodes)
        runtime.on_finished(req)
        runtime.run_predictions()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hover", choices=sorted(WORKLOADS))
    parser.add_argument("--n-workflows", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--gpu-tokens", type=int, default=300_000, help="the device pool the shadows scale")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    calls, sequences = requests(args.workload, args.n_workflows, args.concurrency)
    names = vocabulary(a for s in sequences for a in s)
    index = {a: i for i, a in enumerate(names)}
    predictor = MarkovPredictor.from_sequences(names, 3, [[index[a] for a in s] for s in sequences], order=1)
    print(f"{args.workload}: {args.n_workflows} workflows, {len(calls)} calls, {args.concurrency} live, "
          f"{args.gpu_tokens:,} device tokens")
    cost = {trust: min(hook_cost(trust, calls, predictor, args.gpu_tokens) for _ in range(args.repeats))
            for trust in TRUST_MODES}
    for trust in TRUST_MODES:
        per_call = cost[trust] / len(calls) * 1e6
        extra = (cost[trust] - cost["always"]) / len(calls) * 1e6
        print(f"  trust={trust:>8}: {per_call:8.1f} us per call (hooks and prediction round), "
              f"{extra:+7.1f} us against always")


if __name__ == "__main__":
    main()
