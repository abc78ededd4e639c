"""Whole replays pinned to the numbers the simulator gave when they were written down: a change to
the event loop, the scheduler, a policy or a predictor that moves any decision changes a row here.

Each case replays a small generated workload (a few hundred calls, milliseconds) under one
policy, prefetch mode, end-signal setting and cluster shape; together they pass through every
path of serving_integration/simulator/engine.py (admission in arrival, lpm and spf order, chunked prefill and spf's capped chunk, decode runs cut at
the next event, idle-time and decode-time prefetch, delayed and lost end signals, the inactivity
timeout of finished and of live workflows, charged predictor time, the oracle's future index, two
replicas behind each router), and pbkv's and pbkv_time's outcome judges (their shadow caches' hit
rates: pbkv_time's scores are log-sum-exps). Counts are compared exactly, and so are the float
metrics: the replay is plain IEEE arithmetic in a fixed order, so the same code gives the same bits.

A change that is meant to move results updates GOLDEN with the new numbers (print them with
`python -m tests.simulator.test_replay_golden`) and says why in its commit."""

from __future__ import annotations

import math

import pytest

from models.markov import MarkovPredictor
from serving_integration.cache.predictions import AgentStepGraph, ModelSource, NoisySource, OnlineBackoff, \
    PerfectSource, vocabulary
from serving_integration.simulator.engine import SimConfig, simulate
from tests.simulator.test_simulator import H100, small_workload

METRICS = ("gpu_hit_tokens", "host_hit_tokens", "prompt_tokens", "recomputed_tokens", "prefetched_tokens",
           "predictor_calls", "ended_by_signal", "ended_by_timeout", "live_timeouts", "replica_calls", "migrations",
           "mean_workflow_latency_s", "p99_workflow_latency_s", "mean_ttft_s", "throughput_calls_per_s",
           "time_queue_s", "time_pcie_s")
# and, for the policies with a trust judge, what the judge measured and did (its shadow caches' hit rates
# decide when it switches)
JUDGE_METRICS = ("trust_switches", "shadow_hit_rate_pbkv", "shadow_hit_rate_lae")


def sources(kind: str, workflows):
    """The prediction sources a case can name, fitted on another draw of the same workload."""
    train = small_workload(kind, 30, 99)
    sequences = [[c.agent for c in w.calls] for w in train]
    names = vocabulary([a for s in sequences for a in s] + [c.agent for w in workflows for c in w.calls])
    index = {a: i for i, a in enumerate(names)}
    markov = MarkovPredictor.from_sequences(names, 3, [[index[a] for a in s] for s in sequences], order=1)
    return {"perfect": lambda: PerfectSource(names, 3),
            "noisy": lambda: NoisySource(PerfectSource(names, 3), 0.3, seed=4),
            "online_markov": lambda: OnlineBackoff(ModelSource(markov)),
            "step_graph": lambda: AgentStepGraph.from_traces(sequences, 3, names)}


# name -> (workload, workflows, workload seed, SimConfig fields, simulate() arguments; "predictions" names a source)
CASES = {
    "lru": ("hover", 16, 0, dict(gpu_tokens=60_000, concurrency=6), dict(policy="lru")),
    "lru_lpm": ("hover", 16, 0, dict(gpu_tokens=60_000, concurrency=6, scheduling="lpm"), dict(policy="lru")),
    "lru_spf": ("hover", 16, 0, dict(gpu_tokens=60_000, concurrency=6, scheduling="spf", max_prefill_tokens=2048),
                dict(policy="lru")),
    "lfu_page16": ("swebench", 8, 1, dict(gpu_tokens=120_000, concurrency=4, page_size=16), dict(policy="lfu")),
    "kvflow_aggressive": ("hover", 16, 0, dict(gpu_tokens=60_000, concurrency=6),
                          dict(policy="kvflow_ideal", prefetch="aggressive", predictions="step_graph")),
    "pbkv_time_outcome": ("hover", 24, 3, dict(gpu_tokens=50_000, concurrency=8),
                          dict(policy="pbkv_time", predictions="perfect")),
    "pbkv_lae_end_delay": ("hover", 16, 0, dict(gpu_tokens=60_000, concurrency=6, end_signal_delay_s=1.5),
                           dict(policy="pbkv_lae")),
    "pbkv_conservative_online": ("hover", 16, 0, dict(gpu_tokens=60_000, concurrency=6, end_signal_delay_s=1.0),
                                 dict(policy="pbkv", prefetch="conservative", predictions="online_markov")),
    "pbkv_aggressive_lost_signals": ("hover", 16, 2, dict(gpu_tokens=50_000, concurrency=6, end_signal_delay_s=0.5,
                                                          end_signal_loss=0.5, inactivity_timeout_s=3.0, seed=2,
                                                          predictor_cost_s=0.01),
                                     dict(policy="pbkv", prefetch="aggressive", predictions="noisy")),
    "lru_prefetch_last_call": ("hover", 16, 0, dict(gpu_tokens=60_000, concurrency=6),
                               dict(policy="lru_prefetch", prefetch="last_call")),
    "oracle_conservative": ("hover", 16, 0, dict(gpu_tokens=60_000, concurrency=6),
                            dict(policy="oracle", prefetch="conservative", predictions="perfect")),
    **{f"two_replicas_{routing}": ("hover", 16, 1, dict(gpu_tokens=80_000, concurrency=8, replicas=2, routing=routing,
                                                         end_signal_delay_s=1.0, end_signal_loss=0.3,
                                                         inactivity_timeout_s=4.0, seed=1),
                                   dict(policy="pbkv", prefetch="conservative", predictions="perfect"))
       for routing in ("round_robin", "cache_aware", "sticky", "pbkv")},
}


def replay(name: str, whole: bool = False) -> dict:
    """The case's METRICS; `whole`: its whole summary, the run's bounds included."""
    kind, n, seed, config, policy = CASES[name]
    workflows = small_workload(kind, n, seed)
    policy = dict(policy)
    if "predictions" in policy:
        policy["predictions"] = sources(kind, workflows)[policy["predictions"]]()
    row = simulate(workflows, SimConfig(**config), H100, bound=whole, **policy)
    if whole:
        return row
    return {m: row[m] for m in METRICS} | {m: row[m] for m in JUDGE_METRICS if m in row}


GOLDEN = {  # recorded from the code of the commit that added this test
    'kvflow_aggressive': {
        'gpu_hit_tokens': 356993, 'host_hit_tokens': 118373, 'prompt_tokens': 1059700, 'recomputed_tokens': 94508,
        'prefetched_tokens': 201148, 'predictor_calls': 130, 'ended_by_signal': 16, 'ended_by_timeout': 0,
        'live_timeouts': 0, 'replica_calls': [149], 'migrations': 0, 'mean_workflow_latency_s': 43.154381563032814,
        'p99_workflow_latency_s': 87.66093388462893, 'mean_ttft_s': 0.5702531535001881, 'throughput_calls_per_s':
        1.1082295251876653, 'time_queue_s': 2.3383950482161153, 'time_pcie_s': 0.126773
    },
    'lfu_page16': {
        'gpu_hit_tokens': 311760, 'host_hit_tokens': 43392, 'prompt_tokens': 704577, 'recomputed_tokens': 0,
        'prefetched_tokens': 0, 'predictor_calls': 0, 'ended_by_signal': 8, 'ended_by_timeout': 0, 'live_timeouts':
        0, 'replica_calls': [50], 'migrations': 0, 'mean_workflow_latency_s': 117.20979455319647,
        'p99_workflow_latency_s': 333.47619784883835, 'mean_ttft_s': 0.5975667410598186, 'throughput_calls_per_s':
        0.11989223891073318, 'time_queue_s': 0.16635149372164149, 'time_pcie_s': 0.034496
    },
    'lru': {
        'gpu_hit_tokens': 180603, 'host_hit_tokens': 181318, 'prompt_tokens': 1059700, 'recomputed_tokens': 207953,
        'prefetched_tokens': 0, 'predictor_calls': 0, 'ended_by_signal': 16, 'ended_by_timeout': 0, 'live_timeouts':
        0, 'replica_calls': [149], 'migrations': 0, 'mean_workflow_latency_s': 45.745084760359475,
        'p99_workflow_latency_s': 88.07531751603695, 'mean_ttft_s': 0.5686652289627924, 'throughput_calls_per_s':
        1.0489330055665738, 'time_queue_s': 2.045059835557584, 'time_pcie_s': 0.2017753999999999
    },
    'lru_lpm': {
        'gpu_hit_tokens': 185105, 'host_hit_tokens': 187778, 'prompt_tokens': 1059700, 'recomputed_tokens': 196991,
        'prefetched_tokens': 0, 'predictor_calls': 0, 'ended_by_signal': 16, 'ended_by_timeout': 0, 'live_timeouts':
        0, 'replica_calls': [149], 'migrations': 0, 'mean_workflow_latency_s': 45.549306893600956,
        'p99_workflow_latency_s': 89.4248390800368, 'mean_ttft_s': 0.5844117103631896, 'throughput_calls_per_s':
        1.0590137489783362, 'time_queue_s': 2.2236907481494583, 'time_pcie_s': 0.20663719999999985
    },
    'lru_prefetch_last_call': {
        'gpu_hit_tokens': 187988, 'host_hit_tokens': 178215, 'prompt_tokens': 1059700, 'recomputed_tokens': 203671,
        'prefetched_tokens': 39957, 'predictor_calls': 0, 'ended_by_signal': 16, 'ended_by_timeout': 0,
        'live_timeouts': 0, 'replica_calls': [149], 'migrations': 0, 'mean_workflow_latency_s': 45.63679400985109,
        'p99_workflow_latency_s': 87.80165151468124, 'mean_ttft_s': 0.563118665177107, 'throughput_calls_per_s':
        1.0510879825227952, 'time_queue_s': 2.01111358538812, 'time_pcie_s': 0.197757
    },
    'lru_spf': {
        'gpu_hit_tokens': 184886, 'host_hit_tokens': 187784, 'prompt_tokens': 1059700, 'recomputed_tokens': 197204,
        'prefetched_tokens': 0, 'predictor_calls': 0, 'ended_by_signal': 16, 'ended_by_timeout': 0, 'live_timeouts':
        0, 'replica_calls': [149], 'migrations': 0, 'mean_workflow_latency_s': 45.75581728045285,
        'p99_workflow_latency_s': 91.0235110523442, 'mean_ttft_s': 0.5577360821165699, 'throughput_calls_per_s':
        1.0546791961803823, 'time_queue_s': 1.8374228659952885, 'time_pcie_s': 0.20742679999999997
    },
    'oracle_conservative': {
        'gpu_hit_tokens': 297172, 'host_hit_tokens': 232291, 'prompt_tokens': 1059700, 'recomputed_tokens': 40411,
        'prefetched_tokens': 23716, 'predictor_calls': 130, 'ended_by_signal': 16, 'ended_by_timeout': 0,
        'live_timeouts': 0, 'replica_calls': [149], 'migrations': 0, 'mean_workflow_latency_s': 41.847394583732125,
        'p99_workflow_latency_s': 84.29933650063843, 'mean_ttft_s': 0.4973151481269871, 'throughput_calls_per_s':
        1.138789544611489, 'time_queue_s': 2.086074647418128, 'time_pcie_s': 0.2325582000000001
    },
    'pbkv_aggressive_lost_signals': {
        'gpu_hit_tokens': 229876, 'host_hit_tokens': 77995, 'prompt_tokens': 656697, 'recomputed_tokens': 0,
        'prefetched_tokens': 833732, 'predictor_calls': 114, 'ended_by_signal': 8, 'ended_by_timeout': 6,
        'live_timeouts': 1, 'replica_calls': [115], 'migrations': 0, 'mean_workflow_latency_s': 30.38651501677923,
        'p99_workflow_latency_s': 48.272242870434674, 'mean_ttft_s': 0.2370669099783462, 'throughput_calls_per_s':
        1.303752889619508, 'time_queue_s': 0.18177119061974778, 'time_pcie_s': 0.08134299999999997,
        'trust_switches': 0, 'shadow_hit_rate_pbkv': 0.3044752755075781, 'shadow_hit_rate_lae': 0.1655405765520476
    },
    'pbkv_conservative_online': {
        'gpu_hit_tokens': 283697, 'host_hit_tokens': 194645, 'prompt_tokens': 1059700, 'recomputed_tokens': 91532,
        'prefetched_tokens': 89569, 'predictor_calls': 146, 'ended_by_signal': 15, 'ended_by_timeout': 0,
        'live_timeouts': 0, 'replica_calls': [149], 'migrations': 0, 'mean_workflow_latency_s': 43.10860789987211,
        'p99_workflow_latency_s': 87.8564896366432, 'mean_ttft_s': 0.5623188496939535, 'throughput_calls_per_s':
        1.1115738176779904, 'time_queue_s': 2.3043742727311, 'time_pcie_s': 0.20167020000000005, 'trust_switches':
        0, 'shadow_hit_rate_pbkv': 0.23777201094649428, 'shadow_hit_rate_lae': 0.18055581768425025
    },
    'pbkv_lae_end_delay': {
        'gpu_hit_tokens': 183945, 'host_hit_tokens': 219472, 'prompt_tokens': 1059700, 'recomputed_tokens': 166457,
        'prefetched_tokens': 0, 'predictor_calls': 0, 'ended_by_signal': 15, 'ended_by_timeout': 0, 'live_timeouts':
        0, 'replica_calls': [149], 'migrations': 0, 'mean_workflow_latency_s': 45.1470574347297,
        'p99_workflow_latency_s': 91.67650563977232, 'mean_ttft_s': 0.6305015109216111, 'throughput_calls_per_s':
        1.0651140620690127, 'time_queue_s': 2.6962041261478626, 'time_pcie_s': 0.24025279999999993
    },
    'pbkv_time_outcome': {
        'gpu_hit_tokens': 175112, 'host_hit_tokens': 247187, 'prompt_tokens': 937277, 'recomputed_tokens': 16536,
        'prefetched_tokens': 0, 'predictor_calls': 139, 'ended_by_signal': 24, 'ended_by_timeout': 0,
        'live_timeouts': 0, 'replica_calls': [164], 'migrations': 0, 'mean_workflow_latency_s': 32.20029413347218,
        'p99_workflow_latency_s': 73.45136540508042, 'mean_ttft_s': 0.5023531696622268, 'throughput_calls_per_s':
        1.5079586552668067, 'time_queue_s': 1.553110666982845, 'time_pcie_s': 0.2207496000000001, 'trust_switches':
        0, 'shadow_hit_rate_pbkv': 0.18737577044993103, 'shadow_hit_rate_lae': 0.14013893438119146
    },
    'two_replicas_cache_aware': {
        'gpu_hit_tokens': 221955, 'host_hit_tokens': 83209, 'prompt_tokens': 673087, 'recomputed_tokens': 0,
        'prefetched_tokens': 2768, 'predictor_calls': 119, 'ended_by_signal': 12, 'ended_by_timeout': 2,
        'live_timeouts': 0, 'replica_calls': [69, 51], 'migrations': 47, 'mean_workflow_latency_s':
        27.095671149443163, 'p99_workflow_latency_s': 45.76817669972552, 'mean_ttft_s': 0.273568246254614,
        'throughput_calls_per_s': 1.6929730943011427, 'time_queue_s': 0.6367624257419107, 'time_pcie_s':
        0.047841800000000004, 'trust_switches': 0, 'shadow_hit_rate_pbkv': 0.3304293294840205,
        'shadow_hit_rate_lae': 0.2111117663622592
    },
    'two_replicas_pbkv': {
        'gpu_hit_tokens': 240085, 'host_hit_tokens': 61423, 'prompt_tokens': 673087, 'recomputed_tokens': 0,
        'prefetched_tokens': 0, 'predictor_calls': 120, 'ended_by_signal': 13, 'ended_by_timeout': 2,
        'live_timeouts': 0, 'replica_calls': [68, 52], 'migrations': 3, 'mean_workflow_latency_s':
        26.831549627433088, 'p99_workflow_latency_s': 49.699938361736045, 'mean_ttft_s': 0.23923554549581388,
        'throughput_calls_per_s': 1.6625657524667687, 'time_queue_s': 0.18297886571926242, 'time_pcie_s': 0.0354362,
        'trust_switches': 0, 'shadow_hit_rate_pbkv': 0.36400722118631246, 'shadow_hit_rate_lae': 0.2129863572221768
    },
    'two_replicas_round_robin': {
        'gpu_hit_tokens': 146250, 'host_hit_tokens': 51938, 'prompt_tokens': 673087, 'recomputed_tokens': 0,
        'prefetched_tokens': 6191, 'predictor_calls': 117, 'ended_by_signal': 13, 'ended_by_timeout': 2,
        'live_timeouts': 0, 'replica_calls': [60, 60], 'migrations': 49, 'mean_workflow_latency_s':
        28.66925940855667, 'p99_workflow_latency_s': 52.25554257757621, 'mean_ttft_s': 0.31047856517414213,
        'throughput_calls_per_s': 1.5924959585402598, 'time_queue_s': 0.773031929773994, 'time_pcie_s': 0.0257982,
        'trust_switches': 0, 'shadow_hit_rate_pbkv': 0.21358094107342943, 'shadow_hit_rate_lae': 0.15299341178884607
    },
    'two_replicas_sticky': {
        'gpu_hit_tokens': 243247, 'host_hit_tokens': 65012, 'prompt_tokens': 673087, 'recomputed_tokens': 0,
        'prefetched_tokens': 2888, 'predictor_calls': 119, 'ended_by_signal': 13, 'ended_by_timeout': 2,
        'live_timeouts': 0, 'replica_calls': [56, 64], 'migrations': 0, 'mean_workflow_latency_s':
        26.593751163800782, 'p99_workflow_latency_s': 46.47089714462514, 'mean_ttft_s': 0.2309774179192451,
        'throughput_calls_per_s': 1.6853743506462917, 'time_queue_s': 0.13171560312532238, 'time_pcie_s': 0.036005,
        'trust_switches': 0, 'shadow_hit_rate_pbkv': 0.35892276847581683, 'shadow_hit_rate_lae': 0.22568099848826484
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_matches_the_recorded_numbers(name):
    assert replay(name) == GOLDEN[name]


def test_the_cases_cover_every_path():
    """Each path named in the module docstring happens in at least one case (else the pins miss it)."""
    rows = GOLDEN.values()
    assert any(r["prefetched_tokens"] for r in rows) and any(r["host_hit_tokens"] for r in rows)
    assert any(r["ended_by_timeout"] for r in rows) and any(r["live_timeouts"] for r in rows)
    assert any(r["migrations"] for r in rows) and all(sum(r["replica_calls"]) for r in rows)
    assert all(math.isfinite(r["mean_workflow_latency_s"]) for r in rows)


def golden_source(golden: dict) -> str:
    """GOLDEN as it is written above, for pasting after a change meant to move results."""
    import textwrap

    lines = ["GOLDEN = {"]
    for case, row in golden.items():
        items = ", ".join(f"{k!r}: {v!r}" for k, v in row.items())
        lines += [f"    {case!r}: {{", *textwrap.wrap(items, 116, initial_indent=" " * 8, subsequent_indent=" " * 8,
                                                   break_long_words=False, break_on_hyphens=False), "    },"]
    return "\n".join([*lines, "}"])


if __name__ == "__main__":
    print(golden_source({case: replay(case) for case in sorted(CASES)}))
