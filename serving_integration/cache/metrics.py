"""The metrics of a replay, one definition for the simulator (evaluate.py) and the benchmark
client against a real server (bench.py): both write rows of the same summary.json schema."""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


# where a workflow's time goes: tool time between its calls, admission wait (queueing), and, while
# one of its calls runs, the server's prefill compute, decode iterations and PCIe (host-to-GPU) loads
TIME_SPLIT = ("tool", "queue", "prefill", "decode", "pcie")


def eviction_overshoot(counts) -> float | None:
    """GPU tokens evicted per token the evictions were asked to free, from `evicted_gpu_tokens` and
    `eviction_requested_tokens` in `counts` (a summary row, a row's means over seeds, the plugin's
    counters); None without an eviction. 1 at best: whole-node eviction frees a victim whole."""
    asked = counts.get("eviction_requested_tokens")
    return counts.get("evicted_gpu_tokens", 0) / asked if asked else None


def per_workflow_results(latencies: dict, calls) -> dict:
    """What each workflow of a replay cost, as columns ordered by workflow id (so that two policies'
    replays of the same workflows pair index by index): `workflow` (ids), `latency_s`,
    `missed_tokens` (prompt tokens prefilled: neither a GPU nor a host hit, what recompute_rate
    counts) and `prompt_tokens`. `latencies`: workflow id -> its latency (finished workflows only);
    `calls`: (workflow id, prompt tokens, missed tokens) per call. The report's paired bootstrap over
    workflows reads them."""
    missed, prompt = defaultdict(int), defaultdict(int)
    for workflow, prompt_tokens, missed_tokens in calls:
        prompt[workflow] += prompt_tokens
        missed[workflow] += missed_tokens
    ids = sorted(latencies)
    return {"workflow": ids, "latency_s": [round(float(latencies[w]), 6) for w in ids],
            "missed_tokens": [int(missed[w]) for w in ids], "prompt_tokens": [int(prompt[w]) for w in ids]}


def replay_metrics(*, gpu_hit_tokens: int, host_hit_tokens: int, prompt_tokens: int, workflow_latencies,
                   ttfts, calls: int, makespan_s: float, time_totals: dict | None = None,
                   per_workflow: dict | None = None) -> dict:
    """hit_rate is GPU-hit prompt tokens over prompt tokens; reuse_rate (the prefix-cache hit rate)
    counts host hits too; recompute_rate is the share of prompt tokens prefilled (missed).
    `per_workflow`: per_workflow_results of the replay (null where the caller has none).

    `time_totals`: seconds summed over all workflows for each part of TIME_SPLIT (a part the caller
    cannot measure is None or absent); reported as means per workflow, `time_{part}_s` (null where
    not measured). In the simulator a workflow's latency is exactly the sum of its parts (plus
    charged predictor time, `time_predictor_s`, when sim.predictor_cost_s > 0)."""
    totals = time_totals or {}
    n = len(workflow_latencies)
    split = {f"time_{part}_s": (totals[part] / n if n else 0.0) if totals.get(part) is not None else None
             for part in (*TIME_SPLIT, "predictor")}
    reuse = (gpu_hit_tokens + host_hit_tokens) / prompt_tokens if prompt_tokens else 0.0
    return {
        "hit_rate": gpu_hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "gpu_hit_tokens": gpu_hit_tokens,
        "host_hit_tokens": host_hit_tokens,
        "miss_tokens": prompt_tokens - gpu_hit_tokens - host_hit_tokens,
        "prompt_tokens": prompt_tokens,
        "reuse_rate": reuse,
        "recompute_rate": (prompt_tokens - gpu_hit_tokens - host_hit_tokens) / prompt_tokens if prompt_tokens else 0.0,
        "mean_workflow_latency_s": _mean(workflow_latencies),
        "p50_workflow_latency_s": _percentile(workflow_latencies, 50),
        "p99_workflow_latency_s": _percentile(workflow_latencies, 99),
        "mean_ttft_s": _mean(ttfts),
        "throughput_calls_per_s": calls / makespan_s if makespan_s > 0 else 0.0,
        **split,
        "per_workflow": per_workflow,
    }
