"""The GPU size as a fraction of the live working set (sim.gpu_working_set_fraction) and the
report's regime section (experiments/regime.py) on hand-made rows."""

import numpy as np
import pytest
from omegaconf import OmegaConf

import evaluate as evaluate_py
from data import store
from data.cli import compose_config
from data.errors import ConfigError, run_reported
from data.stats import live_working_set_tokens
from serving_integration.experiments import regime
from serving_integration.experiments.config import settings
from serving_integration.experiments.evaluation import GpuSize
from serving_integration.experiments.rows import make_row
from serving_integration.simulator.config import SimConfig


@pytest.fixture(scope="module")
def dataset(hover_small):
    return store.build(hover_small)


def mean_largest_prompt(calls) -> float:
    largest = {}
    for c in calls:
        largest[c["workflow_id"]] = max(largest.get(c["workflow_id"], 0), c["prompt_tokens"])
    return float(np.mean(list(largest.values())))


def test_the_fraction_resolves_to_that_share_of_concurrency_times_the_mean_largest_prompt(dataset, hover_small):
    expected_set = 8 * mean_largest_prompt(hover_small.calls)
    size = GpuSize.of(SimConfig(concurrency=8, gpu_working_set_fraction=0.5), dataset)
    assert size.working_set_tokens == pytest.approx(expected_set, abs=0.1)  # stats round the mean to 0.01
    assert size.tokens == round(0.5 * size.working_set_tokens)
    assert size.fraction == 0.5 and size.reusable_share == dataset.meta["stats"]["reusable_share"]
    given = GpuSize.of(SimConfig(concurrency=8, gpu_tokens=12345), dataset)  # null fraction: gpu_tokens as given
    assert (given.tokens, given.fraction) == (12345, None)
    assert given.working_set_tokens == size.working_set_tokens


def test_a_dataset_written_before_the_statistic_gets_it_from_its_calls(dataset):
    old = store.TraceDataset(dataset.calls, dataset.segments,
                             {**dataset.meta, "stats": {k: v for k, v in dataset.meta["stats"].items()
                                                        if k != "largest_prompt_tokens_per_workflow"}})
    assert old.stats()["largest_prompt_tokens_per_workflow"] == dataset.meta["stats"]["largest_prompt_tokens_per_workflow"]
    assert live_working_set_tokens(old.stats(), 4) == live_working_set_tokens(dataset.stats(), 4)


def test_a_fraction_that_leaves_no_token_is_refused(dataset):
    with pytest.raises(ConfigError, match=r"^sim.gpu_working_set_fraction=1e-09: 0 GPU tokens for 1 server"):
        GpuSize.of(SimConfig(gpu_working_set_fraction=1e-9), dataset)


@pytest.mark.parametrize("overrides, message", [
    ({"sim.gpu_working_set_fraction": -0.5}, "sim.gpu_working_set_fraction=-0.5: Input should be greater than 0"),
    ({"sim.gpu_working_set_fraction": 0.5, "sim.gpu_tokens": 1000},
     "sim.gpu_working_set_fraction=0.5: sim.gpu_tokens=1000 is set too; give the GPU size one way"),
])
def test_a_bad_fraction_exits_2_before_any_work(overrides, message, tmp_path, capsys, monkeypatch):
    cfg = compose_config("evaluate", [])
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    with pytest.raises(ConfigError):
        settings(cfg)
    monkeypatch.setattr(evaluate_py, "evaluate", lambda *a: pytest.fail("evaluated a bad config"))
    assert run_reported(evaluate_py.run, cfg, tmp_path / "run") == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def row(workload, policy, host, conc, frac, latency, recompute, prefetch="none", trust="none", **extra):
    labels = dict(workload=workload, policy=policy, prefetch=prefetch, trust=trust, gpu_tokens=int((frac or 3) * 1e5),
                  concurrency=conc, split="test", horizon=3, gamma=0.5, cost_model="h100", workflows=100, calls=700,
                  hicache_ratio=host, gpu_working_set_fraction=frac)
    metrics = {"hit_rate": 1 - recompute if not host else 0.2, "recompute_rate": recompute,
               "mean_workflow_latency_s": latency, "time_tool_s": 1.0, "time_decode_s": 3.0,
               "time_prefill_s": latency - 4.0, "time_queue_s": 0.0, "time_pcie_s": 0.0,
               "dataset_reusable_share": 0.5, "bound_hit_rate": 0.5,
               # every setting's recompute bound 0.5 against LRU's 0.8 (rows.py add_setting_bounds)
               "setting_bound_recompute_rate": 0.5, "gap_closed_recompute": (0.8 - recompute) / (0.8 - 0.5), **extra}
    return make_row(labels, metrics)


def hand_made_rows():
    rows = []
    for host in (0.0, 2.0):
        for frac in (0.25, 1.0):
            tight = frac < 1 and not host  # the only setting where prediction pays
            rows += [row("hover", "lru", host, 32, frac, 10.0, 0.8),
                     row("hover", "pbkv", host, 32, frac, 8.0 if tight else 10.0, 0.6 if tight else 0.8,
                         prefetch="conservative", trust="outcome"),
                     row("hover", "pbkv", host, 32, frac, 12.0, 0.9, trust="always"),  # not the row read
                     row("hover", "pbkv_perfect", host, 32, frac, 8.0 if tight else 10.0, 0.55, prefetch="conservative",
                         trust="always"),
                     row("hover", "oracle", host, 32, frac, 7.9 if tight else 9.9, 0.5, prefetch="conservative")]
    rows.append(row("hover", "lru", 0.0, 32, None, 10.0, 0.8))  # a row sized in tokens: not a regime cell
    return rows


def test_the_regime_section_renders_from_rows(tmp_path):
    md = regime.regime_section(hand_made_rows(), tmp_path)
    # pbkv's outcome row with conservative prefetch is read: 10 / 8 = 1.25x at the one tight setting
    assert "pbkv is at least 1.02x faster than LRU in 1 of 4 settings; its best is 1.250x (no host tier, 32 live, " \
           "0.25x the working set)" in md
    assert "perfect prediction's best 1.250x" in md and "The fastest perfect-prediction or oracle row here is 1.266x" in md
    assert "gains vanish (1.02x or less everywhere) with host tier 2x GPU, 1x the working set" in md
    # the recompute bound 0.5: pbkv closes (0.8 - 0.6) / (0.8 - 0.5)
    assert "pbkv closes a median" in md and "| 67% |" in md
    # the ceiling: at the tight cell 10 / (1 + 3 + 6 x 0.5 / 0.8) = 1.29x; 1.85x needs 46% of LRU's latency removed
    assert "estimated ceiling on the speed-up of 1.29x at best" in md and "removes 46% of LRU's mean workflow latency" in md
    assert "the simulator does not produce 1.85x" in md and "not a bound: in" not in md
    # to reach 1.85x there: 10 / 1.85 - 4 = 1.405 s of prefill left of 6 s at 80% recomputed -> 81% reusable
    assert "it would take a reusable share of 81% (the workload has 50%)" in md
    for name in ("regime_pbkv_speedup.png", "regime_perfect_speedup.png", "regime_gap_recompute.png"):
        assert (tmp_path / name).stat().st_size > 0 and f"]({name})" in md
    assert md.count("\n| hover |") == 4  # one table line per cell


def test_pbkv_time_gets_its_own_speed_up_and_gap_closed(tmp_path):
    rows = hand_made_rows() + [row("hover", "pbkv_time", host, 32, frac, 8.0 if frac < 1 and not host else 10.0,
                                   0.56 if frac < 1 and not host else 0.8, prefetch="conservative", trust="outcome")
                               for host in (0.0, 2.0) for frac in (0.25, 1.0)]
    md = regime.regime_section(rows, tmp_path)
    # (0.8 - 0.56) / (0.8 - 0.5) = 80% at the tight cell, 0% elsewhere: median 0%
    assert "pbkv_time is at least 1.02x faster than LRU in 1 of 4 settings, its best 1.250x (no host tier, 32 live, " \
           "0.25x the working set), and closes a median 0% (best 80%)" in md
    assert "| 1.250 | 80% |" in md
    for name in ("regime_pbkv_time_speedup.png", "regime_pbkv_time_gap_recompute.png"):
        assert (tmp_path / name).stat().st_size > 0 and f"]({name})" in md


def test_a_row_s_own_gap_closed_on_recompute_is_used_when_present(tmp_path):
    rows = hand_made_rows()
    for r in rows:
        if r["policy"] == "pbkv" and r["trust"] == "outcome":
            r["gap_closed_recompute"] = 0.123
    assert "| 12% |" in regime.regime_section(rows, tmp_path)


def test_no_regime_rows_no_section(tmp_path):
    assert regime.regime_section([row("hover", "lru", 0.0, 32, None, 10.0, 0.8)], tmp_path) == ""
