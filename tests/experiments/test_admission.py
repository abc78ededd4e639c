"""The report's admission section (experiments/admission.py) on hand-made rows: the orders of one
setting side by side against FCFS LRU, paired by seed."""

from serving_integration.experiments.admission import admission_section
from serving_integration.experiments.regime import cells
from serving_integration.experiments.rows import make_row


def row(scheduling, policy, latencies, recompute):
    labels = {"workload": "tau_bench", "policy": policy, "gpu_tokens": 46592, "concurrency": 32, "hicache_ratio": 0.0,
              "gpu_working_set_fraction": 0.35, "scheduling": scheduling, "seed": 0}
    metrics = {"mean_workflow_latency_s": sum(latencies) / len(latencies), "mean_workflow_latency_s_per_seed": latencies,
               "p50_workflow_latency_s": 50.0, "p99_workflow_latency_s": 150.0, "mean_ttft_s": 1.0,
               "recompute_rate": recompute, "hit_rate": 1 - recompute, "throughput_calls_per_s": 6.0,
               "seeds": [0, 1, 2]}
    return make_row(labels, metrics)


def test_each_order_is_compared_with_fcfs_lru_per_seed_and_only_fcfs_feeds_the_regime_map(tmp_path):
    rows = [row("fcfs", "lru", [80.0, 78.0, 79.0], 0.56), row("fcfs", "pbkv", [80.0, 77.0, 80.0], 0.55),
            row("lpm", "lru", [60.0, 59.0, 59.5], 0.33), row("hrrn", "lru", [81.0, 77.0, 78.0], 0.55)]
    md = admission_section(rows, tmp_path)
    lines = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in md.splitlines() if line.startswith("| ")}
    assert "| 1.33 ± " in lines[("lpm", "lru")]  # 80/60, 78/59, 79/59.5
    assert "no difference" in lines[("hrrn", "lru")] and "no difference" in lines[("fcfs", "pbkv")]
    assert "the fastest row is lru under lpm" in md and "recomputes 33.0% of prompt tokens against 56.0%" in md
    assert (tmp_path / "admission_speedup.png").stat().st_size > 0 and "](admission_speedup.png)" in md
    assert {x["scheduling"] for c in cells(rows).values() for x in c["rows"]} == {"fcfs"}


def test_no_section_without_two_orders_of_one_setting(tmp_path):
    assert admission_section([row("fcfs", "lru", [80.0], 0.5), row("fcfs", "pbkv", [79.0], 0.5)], tmp_path) == ""
