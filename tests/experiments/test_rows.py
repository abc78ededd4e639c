"""The rules across rows (serving_integration/experiments/rows.py): the bound of a setting and
prefetch class, gap closed against it on GPU hits and on recomputed tokens, and the check that
stops evaluate where a row beats a proven bound, on made-up rows and on a real debug run."""

import copy

import pytest
from hydra import compose, initialize_config_dir

from serving_integration.experiments.rows import (ROW_METRIC_DEFAULTS, BoundViolated, add_setting_bounds,
                                                  check_bounds, make_row)
from tests.conftest import REPO

SETTING = dict(workload="hover", gpu_tokens=1000, concurrency=4, cost_model="h100", workflows=10, calls=80,
               hicache_ratio=2.0)


def row(policy, prefetch, hit, recompute, bound, bound_prefetch, bound_recompute, seed=0):
    return make_row({**SETTING, "policy": policy, "prefetch": prefetch, "seed": seed},
                    dict(hit_rate=hit, recompute_rate=recompute, bound_hit_rate=bound,
                         bound_prefetch_hit_rate=bound_prefetch, bound_recompute_rate=bound_recompute))


def test_every_row_of_a_class_gets_the_settings_bound_and_gap_closed_against_it():
    rows = add_setting_bounds([
        row("lru", "none", 0.20, 0.50, 0.40, 0.45, 0.35),
        row("pbkv", "none", 0.30, 0.45, 0.42, 0.46, 0.36),
        row("pbkv", "conservative", 0.44, 0.45, 0.41, 0.48, 0.34),  # above every eviction bound, within its own
        row("lru", "none", 0.25, 0.50, 0.50, 0.55, 0.30, seed=1)])  # another seed: compared only with itself
    lru, pbkv, prefetch, other_seed = rows
    assert [r["setting_bound_hit_rate"] for r in rows] == [0.42, 0.42, 0.48, 0.50]  # max over the setting's rows
    assert [r["setting_bound_recompute_rate"] for r in rows] == [0.34, 0.34, 0.34, 0.30]  # min over them
    assert lru["gap_closed"] == 0 and lru["gap_closed_recompute"] == 0
    assert pbkv["gap_closed"] == pytest.approx((0.30 - 0.20) / (0.42 - 0.20))
    assert prefetch["gap_closed"] == pytest.approx((0.44 - 0.20) / (0.48 - 0.20))
    assert prefetch["gap_closed_recompute"] == pytest.approx((0.50 - 0.45) / (0.50 - 0.34))
    assert other_seed["gap_closed"] == 0
    check_bounds(rows)


def test_rows_without_a_bound_or_without_lru_keep_none():
    bench = add_setting_bounds([row("pbkv", "none", 0.3, 0.5, None, None, None)])[0]
    assert {k: bench[k] for k in ROW_METRIC_DEFAULTS if k != "bound_method"} == \
        {k: None for k in ROW_METRIC_DEFAULTS if k != "bound_method"}
    alone = add_setting_bounds([row("pbkv", "none", 0.3, 0.5, 0.4, 0.45, 0.35)])[0]
    assert alone["setting_bound_hit_rate"] == 0.4 and alone["gap_closed"] is None  # no LRU row to start from
    check_bounds([bench, alone])


@pytest.mark.parametrize("field,value,message", [
    ("hit_rate", 0.43, "exceeds setting_bound_hit_rate"),  # above the max of its class
    ("recompute_rate", 0.33, "below setting_bound_recompute_rate")])
def test_the_check_fires_on_a_doctored_row(field, value, message):
    rows = add_setting_bounds([row("lru", "none", 0.20, 0.50, 0.40, 0.45, 0.35),
                               row("pbkv", "none", 0.30, 0.45, 0.42, 0.46, 0.34)])
    check_bounds(rows)
    doctored = copy.deepcopy(rows)
    doctored[1][field] = value
    with pytest.raises(BoundViolated, match=message):
        check_bounds(doctored)


def test_the_check_fires_on_a_row_above_its_own_sequences_bound():
    rows = add_setting_bounds([row("lru", "none", 0.20, 0.50, 0.40, 0.45, 0.35),
                               row("pbkv", "none", 0.41, 0.45, 0.40, 0.46, 0.34),
                               row("kvflow", "none", 0.30, 0.45, 0.42, 0.46, 0.34)])
    with pytest.raises(BoundViolated, match="pbkv.*exceeds bound_hit_rate"):  # within the setting's, not its own
        check_bounds(rows)


@pytest.mark.slow
def test_a_debug_run_passes_the_check(tmp_path):
    """evaluate (debug=evaluate: 60 small hover workflows) with both prefetch classes: every row within
    its setting's bounds (evaluate_seed checks; here again, after the fact), and prefetch rows bounded
    by the prefetch-aware bound even where they beat the eviction-only one."""
    from serving_integration.experiments.evaluation import evaluate

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=[
            "debug=evaluate", f"data.cache_dir={tmp_path / 'cache'}", "policies=[lru,pbkv_lae,pbkv,oracle]",
            "prefetch=[none,aggressive]"])
    rows = evaluate(cfg, tmp_path)["rows"]
    check_bounds(rows)
    assert {r["prefetch"] for r in rows} == {"none", "aggressive"}
    for r in rows:
        assert r["bound_method"] == "lp"
        assert r["bound_hit_rate"] <= r["bound_prefetch_hit_rate"] <= 1 - r["bound_recompute_rate"] + 1e-12
        cls = "bound_hit_rate" if r["prefetch"] == "none" else "bound_prefetch_hit_rate"
        assert r["setting_bound_hit_rate"] == max(x[cls] for x in rows)
        assert r["hit_rate"] <= r["setting_bound_hit_rate"] and r["recompute_rate"] >= r["setting_bound_recompute_rate"]
    lru = next(r for r in rows if r["policy"] == "lru")
    assert lru["gap_closed"] == 0 and lru["gap_closed_recompute"] == 0


def seed_row(policy, seed, hit, workflows=("a", "b")):
    r = row(policy, "none", hit, 1 - hit, 0.9, 0.9, 0.05, seed=seed)
    return {**r, "per_workflow": {"workflow": list(workflows), "latency_s": [seed + 0.5, seed + 1.5]}}


def job(seeds, source, hits=None):
    """A summary of one job: its rows over `seeds` and its seed rows (per_workflow trimmed, as evaluate writes them)."""
    from serving_integration.experiments.rows import aggregate_seeds

    seed_rows = [seed_row(p, s, (hits or {}).get((p, s), 0.1 * s + (p == "pbkv") / 10)) for s in seeds
                 for p in ("lru", "pbkv")]
    rows = [{**r, "sources": [source]} for r in aggregate_seeds(seed_rows)]
    return rows, [{**r, "per_workflow": None} for r in seed_rows]


def test_jobs_of_one_sweep_on_disjoint_seeds_merge_into_the_row_of_one_run_over_them_all():
    from serving_integration.experiments.rows import aggregate_seeds, merge_seed_splits

    whole = aggregate_seeds([seed_row(p, s, 0.1 * s + (p == "pbkv") / 10) for s in (0, 1, 2, 3) for p in ("lru", "pbkv")])
    (a, a_seeds), (b, b_seeds) = job([2, 3], "b.json"), job([0, 1], "a.json")  # a later job listed first
    merged = merge_seed_splits(a + b, {"a.json": ("cfg", b_seeds), "b.json": ("cfg", a_seeds)})
    assert [r["sources"] for r in merged] == [["b.json", "a.json"]] * 2
    assert [{k: v for k, v in r.items() if k != "sources"} for r in merged] == whole
    assert merged[0]["seeds"] == [0, 1, 2, 3] and merged[0]["per_workflow"]["workflow"][:3] == ["0/a", "0/b", "1/a"]
    assert merged[0]["hit_rate_ci95"] is not None and merged[0]["workflows"] == 40


@pytest.mark.parametrize("case", ["other config", "overlapping seeds", "no seed rows"])
def test_jobs_of_other_configs_or_overlapping_seeds_stay_apart(case):
    from serving_integration.experiments.rows import merge_seed_splits

    (a, a_seeds), (b, b_seeds) = job([0, 1], "a.json"), job([1, 2] if case == "overlapping seeds" else [2, 3], "b.json")
    runs = {"a.json": ("cfg", a_seeds), "b.json": ("other" if case == "other config" else "cfg",
                                                   [] if case == "no seed rows" else b_seeds)}
    assert merge_seed_splits(a + b, runs) == a + b
