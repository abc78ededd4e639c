"""The report's eviction-unit section (experiments/eviction_unit.py) on hand-made rows: each policy
with whole-node and with partial eviction, paired by seed."""

from serving_integration.experiments.eviction_unit import eviction_unit_section
from serving_integration.experiments.regime import cells
from serving_integration.experiments.rows import make_row


def row(partial, policy, latencies, recompute, asked=None, freed=None):
    labels = {"workload": "who_and_when", "policy": policy, "gpu_tokens": 121226, "concurrency": 32,
              "hicache_ratio": 0.0, "gpu_working_set_fraction": 0.5, "partial_eviction": partial, "seed": 0}
    metrics = {"mean_workflow_latency_s": sum(latencies) / len(latencies), "mean_workflow_latency_s_per_seed": latencies,
               "recompute_rate": sum(recompute) / 3, "recompute_rate_per_seed": recompute,
               "hit_rate": 1 - sum(recompute) / 3, "hit_rate_per_seed": [1 - x for x in recompute], "seeds": [0, 1, 2]}
    if asked is not None:  # the simulator's eviction counters (rows made before them lack both)
        metrics.update(eviction_requested_tokens=asked, evicted_gpu_tokens=freed)
    return make_row(labels, metrics)


def test_each_policy_is_compared_with_itself_under_whole_node_eviction_and_only_that_feeds_the_regime_map():
    rows = [row(False, "lru", [100.0, 90.0, 80.0], [0.83, 0.80, 0.86]),
            row(True, "lru", [100.0, 91.0, 79.0], [0.78, 0.76, 0.80]),
            row(False, "pbkv", [100.0, 90.0, 80.0], [0.82, 0.80, 0.84]),
            row(True, "pbkv", [95.0, 85.0, 76.0], [0.73, 0.72, 0.75])]
    md = eviction_unit_section(rows)
    lines = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert "| 1.05" in lines["pbkv"] and "no difference" not in lines["pbkv"].split("|")[4]  # 100/95, 90/85, 80/76
    assert "no difference (1.00" in lines["lru"]  # 1.0, 0.989, 1.013
    assert "| -5.0 ± " in lines["lru"]  # recomputed: -5, -4, -6 points
    assert "faster than whole-node eviction beyond the interval in 1, slower in 0, and neither in 1" in md
    assert "saves the most recomputed work for pbkv on who_and_when at 0.5x the working set" in md
    assert {x["partial_eviction"] for c in cells(rows).values() for x in c["rows"]} == {False}
    assert lines["lru"].endswith("| n/a | n/a |") and "tokens per token an admission asked for" not in md


def test_tokens_freed_per_token_needed_for_each_eviction_unit():
    rows = [row(False, "lru", [100.0, 90.0, 80.0], [0.83, 0.80, 0.86], 1000, 1900),
            row(True, "lru", [100.0, 91.0, 79.0], [0.78, 0.76, 0.80], 1500, 1650),
            row(False, "pbkv", [100.0, 90.0, 80.0], [0.82, 0.80, 0.84], 1000, 1800),
            row(True, "pbkv", [95.0, 85.0, 76.0], [0.73, 0.72, 0.75], 1500, 1560)]
    md = eviction_unit_section(rows)
    lines = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert lines["lru"].endswith("| 1.90 | 1.10 |") and lines["pbkv"].endswith("| 1.80 | 1.04 |")
    assert ("Whole-node eviction frees 1.80 to 1.90 GPU tokens per token an admission asked for (median 1.85), "
            "partial eviction 1.04 to 1.10 (median 1.07)") in md


def test_no_section_without_both_eviction_units_of_one_setting():
    assert eviction_unit_section([row(False, "lru", [80.0, 80.0, 80.0], [0.5, 0.5, 0.5])]) == ""
