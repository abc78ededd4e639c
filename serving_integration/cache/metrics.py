"""The metrics of a replay, one definition for the simulator (evaluate.py) and the benchmark
client against a real server (bench.py): both write rows of the same summary.json schema."""

from __future__ import annotations

import numpy as np


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def replay_metrics(*, gpu_hit_tokens: int, host_hit_tokens: int, prompt_tokens: int, workflow_latencies,
                   ttfts, calls: int, makespan_s: float) -> dict:
    """hit_rate is GPU-hit prompt tokens over prompt tokens; prefix_hit_rate counts host hits too."""
    return {
        "hit_rate": gpu_hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "gpu_hit_tokens": gpu_hit_tokens,
        "host_hit_tokens": host_hit_tokens,
        "miss_tokens": prompt_tokens - gpu_hit_tokens - host_hit_tokens,
        "prompt_tokens": prompt_tokens,
        "prefix_hit_rate": (gpu_hit_tokens + host_hit_tokens) / prompt_tokens if prompt_tokens else 0.0,
        "mean_workflow_latency_s": _mean(workflow_latencies),
        "p50_workflow_latency_s": _percentile(workflow_latencies, 50),
        "p99_workflow_latency_s": _percentile(workflow_latencies, 99),
        "mean_ttft_s": _mean(ttfts),
        "throughput_calls_per_s": calls / makespan_s if makespan_s > 0 else 0.0,
    }
