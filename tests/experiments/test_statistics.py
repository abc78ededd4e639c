"""The statistics of the results pages (experiments/statistics.py and the claims in report.py): the
paired bootstrap over workflows, "no difference" where an interval contains the null value, ratios
paired by seed, one operating point per workload chosen on val by latency, and the per-workflow
results a replay writes for them."""

import numpy as np
import pytest

from serving_integration.experiments import report
from serving_integration.experiments.rows import aggregate_seeds, make_row
from serving_integration.experiments.statistics import (Estimate, over_seeds, paired_ratios, shown,
                                                        workflow_bootstrap)


def workflow_row(ids, latency, missed, prompt, **labels) -> dict:
    return {"per_workflow": {"workflow": list(ids), "latency_s": list(latency), "missed_tokens": list(missed),
                             "prompt_tokens": list(prompt)}, **labels}


@pytest.fixture
def spread():
    """200 workflows whose latencies differ 100-fold between workflows; b takes 10% longer than a on
    every one (a tiny per-workflow jitter)."""
    rng = np.random.default_rng(1)
    ids = [f"wf-{i:03d}" for i in range(200)]
    a = rng.lognormal(3.0, 1.2, size=200)
    b = a * 1.10 * rng.normal(1.0, 0.01, size=200)
    prompt = rng.integers(1_000, 20_000, size=200)
    return ids, a, b, prompt


def test_the_bootstrap_pairs_workflows_by_id_and_separates_what_an_unpaired_one_cannot(spread):
    ids, a, b, prompt = spread
    ra, rb = workflow_row(ids, a, prompt // 2, prompt), workflow_row(ids, b, prompt // 2, prompt)
    paired = workflow_bootstrap(ra, rb, "speed_up")
    assert paired.value == pytest.approx(b.mean() / a.mean()) and paired.samples == 200
    assert 1.0 < paired.low < 1.10 < paired.high < 1.2  # the same workflows in both: a tight interval
    # b's results listed in another order: paired by id, the same estimate
    order = np.random.default_rng(2).permutation(200)
    shuffled = workflow_row([ids[i] for i in order], b[order], (prompt // 2)[order], prompt[order])
    assert workflow_bootstrap(ra, shuffled, "speed_up") == paired
    # b's values moved onto other workflows: the pairing is gone and the 10% vanishes in the spread
    broken = workflow_row(ids, b[order], (prompt // 2)[order], prompt[order])
    unpaired = workflow_bootstrap(ra, broken, "speed_up")
    assert unpaired.contains(1.0) and shown(unpaired, null=1.0, style="range").startswith("no difference (")


def test_the_recompute_difference_is_the_pooled_shares_difference(spread):
    ids, _, _, prompt = spread
    missed_a, missed_b = (prompt * 0.40).astype(int), (prompt * 0.50).astype(int)
    ra = workflow_row(ids, np.ones(200), missed_a, prompt)
    rb = workflow_row(ids, np.ones(200), missed_b, prompt)
    diff = workflow_bootstrap(ra, rb, "missed_difference")
    assert diff.value == pytest.approx(missed_a.sum() / prompt.sum() - missed_b.sum() / prompt.sum())
    assert diff.high < 0 and not diff.contains(0.0)
    same = workflow_bootstrap(ra, ra, "missed_difference")  # a policy against itself: no difference
    assert same.value == 0 and shown(same, null=0.0).startswith("no difference")


def test_without_per_workflow_results_there_is_no_bootstrap():
    assert workflow_bootstrap({"per_workflow": None}, workflow_row(["a", "b"], [1, 2], [0, 0], [1, 1]),
                              "speed_up") is None


def test_an_interval_containing_one_is_no_difference_never_a_win():
    assert shown(Estimate(1.04, 0.98, 1.10, 3), null=1.0) == "no difference (1.04 ± 0.06)"
    assert shown(Estimate(1.16, 1.12, 1.20, 3), null=1.0) == "1.16 ± 0.04"
    assert shown(Estimate(0.9, 0.8, 1.0, 3), null=1.0).startswith("no difference")  # a loss within it too
    straddling = over_seeds([0.95, 1.10, 1.02])  # Student t over 3 seeds: 1.02 ± 0.19
    assert straddling.contains(1.0) and shown(straddling, null=1.0).startswith("no difference")
    assert shown(over_seeds([1.05]), null=1.0) == "1.05"  # one seed: no interval, nothing to call


def test_ratios_are_paired_by_seed_not_by_position():
    a = {"seeds": [0, 1, 2], "hit_rate": 0.3, "hit_rate_per_seed": [0.2, 0.3, 0.4]}
    b = {"seeds": [2, 0], "hit_rate": 0.2, "hit_rate_per_seed": [0.4, 0.1]}
    assert paired_ratios(a, b, "hit_rate", True) == pytest.approx([2.0, 1.0])  # seed 0: 0.2/0.1, seed 2: 0.4/0.4
    assert paired_ratios(a, b, "hit_rate", False) == pytest.approx([0.5, 1.0])


def memory_rows():
    """A memory sweep over two seeds: on val, PBKV's hit-rate gain over LRU is largest at 200k and its
    latency gain largest at 100k (with conservative prefetch); the test split's numbers differ."""
    rows = []
    numbers = {  # (split, gpu, policy, prefetch) -> (hit rate, latency) per seed
        ("val", 100000, "lru", "none"): ([0.10, 0.12], [100, 110]),
        ("val", 100000, "pbkv", "none"): ([0.14, 0.16], [90, 100]),
        ("val", 100000, "pbkv", "conservative"): ([0.15, 0.17], [80, 88]),
        ("val", 200000, "lru", "none"): ([0.10, 0.10], [60, 66]),
        ("val", 200000, "pbkv", "none"): ([0.30, 0.30], [59, 65]),
        ("val", 200000, "pbkv", "conservative"): ([0.31, 0.31], [58, 64]),
        ("test", 100000, "lru", "none"): ([0.11, 0.13], [105, 100]),
        ("test", 100000, "pbkv", "none"): ([0.15, 0.17], [95, 90]),
        ("test", 100000, "pbkv", "conservative"): ([0.16, 0.18], [84, 80]),
        ("test", 200000, "lru", "none"): ([0.10, 0.10], [60, 60]),
        ("test", 200000, "pbkv", "none"): ([0.30, 0.30], [59, 59]),
        ("test", 200000, "pbkv", "conservative"): ([0.31, 0.31], [58, 58]),
    }
    for (split, gpu, policy, prefetch), (hits, latency) in numbers.items():
        labels = dict(workload="hover", policy=policy, prefetch=prefetch, gpu_tokens=gpu, concurrency=32,
                      split=split, horizon=3, gamma=0.5, cost_model="h100", workflows=2000, calls=20000)
        metrics = {"hit_rate": float(np.mean(hits)), "hit_rate_per_seed": hits,
                   "mean_workflow_latency_s": float(np.mean(latency)), "mean_workflow_latency_s_per_seed": latency}
        rows.append({**make_row(labels, metrics), "seeds": [0, 1], "sources": [f"/runs/{split}/{gpu}/summary.json"]})
    return rows


def test_the_operating_point_is_chosen_on_val_by_latency_and_every_claim_is_made_there():
    rows = memory_rows()
    point = report.operating_points(rows)["hover"]
    at = dict(zip(report.MATCH, point.match))
    # the latency gain is largest at 100k with conservative prefetch (hit rate would pick 200k)
    assert (at["gpu_tokens"], point.prefetch, point.how) == (100000, "conservative", "chosen on val")
    assert point.pbkv["split"] == point.lru["split"] == "test"
    table = report.claims_table(rows)
    assert "**hover** 100k GPU tokens, 32 live, prefetch conservative (chosen on val)" in table
    hit_claim = next(line for line in table.splitlines() if line.startswith("| PBKV GPU hit rate vs LRU |"))
    ratios = [0.16 / 0.11, 0.18 / 0.13]  # the test numbers at the val choice, paired by seed
    # two seeds (Student t with 1 degree of freedom): the interval holds 1, so no win is claimed
    assert f"**hover**: no difference ({np.mean(ratios):.2f} ± " in hit_claim
    assert "2 seeds x 1,000 test workflows; fewer than the 10 x 1,000 a claim needs" in hit_claim
    latency_claim = next(line for line in table.splitlines() if line.startswith("| PBKV latency vs LRU"))
    assert f"mean {np.mean([105 / 84, 100 / 80]):.2f} ± " in latency_claim
    headline = next(line for line in report.headline_table(rows).splitlines() if line.startswith("| hover |"))
    assert "100k GPU tokens, 32 live, prefetch conservative" in headline


def test_the_claims_prefer_the_run_with_most_seeds_at_the_chosen_point():
    rows = memory_rows()
    ten = [{**r, "seeds": list(range(10)), "workflows": 10_000,
            "hit_rate_per_seed": [r["hit_rate"] + 0.01] * 10,
            "mean_workflow_latency_s_per_seed": [r["mean_workflow_latency_s"]] * 10}
           for r in rows if r["split"] == "test" and r["gpu_tokens"] == 100000]
    point = report.operating_points(rows + ten)["hover"]
    assert report.seeds_of(point.pbkv) == list(range(10)) and point.pbkv["workflows"] == 10_000
    assert "fewer than" not in report.sample_text(point.pbkv)


def test_seed_rows_pool_their_per_workflow_results_keyed_by_seed():
    def seed_row(seed, latencies):
        labels = dict(workload="tau_bench", policy="lru", gpu_tokens=150000, concurrency=32, seed=seed,
                      workflows=len(latencies), calls=10)
        return make_row(labels, {"hit_rate": 0.5, "per_workflow": {
            "workflow": [f"w{i}" for i in range(len(latencies))], "latency_s": latencies,
            "missed_tokens": [1] * len(latencies), "prompt_tokens": [2] * len(latencies)}})

    (row,) = aggregate_seeds([seed_row(1, [3.0, 4.0]), seed_row(0, [1.0, 2.0])])
    assert row["per_workflow"]["workflow"] == ["0/w0", "0/w1", "1/w0", "1/w1"]
    assert row["per_workflow"]["latency_s"] == [1.0, 2.0, 3.0, 4.0]
    assert row["hit_rate"] == 0.5 and row["seeds"] == [1, 0]


def test_a_replay_writes_each_workflow_once_and_its_columns_add_up():
    from serving_integration.simulator.engine import simulate
    from tests.simulator.test_simulator import H100, SimConfig, small_workload

    workflows = small_workload("hover", 30, 3)
    result = simulate(workflows, SimConfig(gpu_tokens=90_000, concurrency=6), H100, policy="lru", bound=False)
    columns = result["per_workflow"]
    assert columns["workflow"] == sorted(w.id for w in workflows)
    assert sum(columns["missed_tokens"]) == result["miss_tokens"]
    assert sum(columns["prompt_tokens"]) == result["prompt_tokens"]
    assert np.mean(columns["latency_s"]) == pytest.approx(result["mean_workflow_latency_s"], rel=1e-6)
