"""The report's time-aware section (experiments/time_aware.py) on hand-made rows: pbkv_time beside
the field per setting, and the beyond-PBKV targets checked row by row."""

from serving_integration.experiments.rows import make_row
from serving_integration.experiments.time_aware import gap_closed, margin, time_aware_section


def row(policy, latencies, recompute, hits, floor=(0.70, 0.70, 0.70), host=0.0, real=True, trust="outcome"):
    labels = {"workload": "who_and_when", "policy": policy, "gpu_tokens": 121226, "concurrency": 32,
              "hicache_ratio": host, "gpu_working_set_fraction": 0.5, "partial_eviction": True, "seed": 0,
              "trust": trust if policy in ("pbkv", "pbkv_time") else "none", "predictor": "graphsage"}
    metrics = {"mean_workflow_latency_s": sum(latencies) / 3, "mean_workflow_latency_s_per_seed": latencies,
               "recompute_rate": sum(recompute) / 3, "recompute_rate_per_seed": recompute,
               "hit_rate": sum(hits) / 3, "hit_rate_per_seed": hits, "seeds": [0, 1, 2],
               "setting_bound_recompute_rate": sum(floor) / 3, "setting_bound_recompute_rate_per_seed": list(floor),
               "per_workflow": {"w": [1.0]} if real else None}
    return make_row(labels, metrics)


def test_gap_closed_margin_and_the_targets_per_setting(tmp_path):
    lru = row("lru", [100.0, 90.0, 80.0], [0.90, 0.80, 0.90], [0.10, 0.20, 0.10])
    lae = row("pbkv_lae", [100.0, 90.0, 80.0], [0.90, 0.80, 0.90], [0.10, 0.21, 0.10])
    mine = row("pbkv_time", [96.0, 88.0, 77.0], [0.80, 0.79, 0.76], [0.20, 0.20, 0.24])
    # gap closed per seed: 0.1/0.2, 0.01/0.1, 0.14/0.2 -> median 0.5; margin: +10, -1, +14 points
    assert round(gap_closed(mine, lru), 9) == 0.5
    by = {"lru": lru, "pbkv_lae": lae, "pbkv_time": mine}
    assert round(margin(mine, by), 6) == -1.0
    # its own order throughout (trust always) trails by 3 points in seed 1: the targets read the outcome row
    always = row("pbkv_time", [96.0, 88.0, 77.0], [0.80, 0.79, 0.76], [0.20, 0.18, 0.24], trust="always")
    md = time_aware_section([lru, lae, always, mine], tmp_path)
    lines = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert "| 50% |" in lines["pbkv_time (graphsage)"] and "| -1.0 |" in lines["pbkv_time (graphsage)"]
    assert "| -3.0 |" in lines["pbkv_time (graphsage) [always]"] and "| 0% |" in lines["lru"]
    assert "in 1 of 1 settings" in md  # a real trace: 30% is the target
    assert "(time_aware_gap.png)" in md and (tmp_path / "time_aware_gap.png").stat().st_size > 0
    assert "below the best of lru, pbkv_lae and continuum in some seed in 0 of 1" in md  # -1.0 is not below -1
    worse = row("pbkv_time", [110.0, 99.0, 88.0], [0.89, 0.80, 0.90], [0.08, 0.20, 0.10], real=False)
    md = time_aware_section([lru, lae, worse], tmp_path)
    assert "in 0 of 1 settings (missed: who_and_when 0.5x, no host tier 0%)" in md  # generated: 60% is the target
    assert "in some seed in 1 of 1 settings (who_and_when 0.5x, no host tier (-2.0))" in md
    assert "slower than LRU beyond the interval in 1 (who_and_when 0.5x, no host tier (0.909" in md


def test_no_section_without_a_pbkv_time_row(tmp_path):
    assert time_aware_section([row("lru", [1.0, 1.0, 1.0], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])], tmp_path) == ""
