"""evaluate.py run as a user runs it, with small overrides."""

import json
import subprocess
import sys

import pytest

from serving_integration.experiments.presentation import row_label as label
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # every test runs evaluate.py in a subprocess (about 10 s to start)

ROW_FIELDS = {"workload", "policy", "prefetch", "gpu_tokens", "concurrency", "noise", "hit_rate", "gpu_hit_tokens",
              "host_hit_tokens", "miss_tokens", "prompt_tokens", "mean_workflow_latency_s", "p50_workflow_latency_s",
              "p99_workflow_latency_s", "mean_ttft_s", "throughput_calls_per_s", "prefetch_precision",
              "bound_hit_rate", "bound_prefetch_hit_rate", "bound_recompute_rate", "bound_method",
              "setting_bound_hit_rate", "setting_bound_recompute_rate", "gap_closed", "gap_closed_recompute",
              "reuse_rate", "recompute_rate", "time_tool_s",
              "time_queue_s", "time_prefill_s", "time_decode_s", "time_pcie_s"}


def evaluate(run_dir, *overrides, cache):
    done = subprocess.run([sys.executable, "evaluate.py", f"hydra.run.dir={run_dir}", f"data.cache_dir={cache}",
                           "debug=evaluate", *overrides], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text()), done.stdout


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def test_every_policy_one_table_and_plots(tmp_path, cache):
    summary, stdout = evaluate(tmp_path / "run", "prefetch=[none,conservative]", cache=cache)
    rows = summary["rows"]
    assert [(r["policy"], r["prefetch"], r["trust"]) for r in rows] == [
        ("lru", "none", "none"), ("lfu", "none", "none"), ("tlru", "none", "none"), ("kvflow", "kvflow", "none"),
        ("kvflow", "none", "none"), ("kvflow_ideal", "aggressive", "none"), ("kvflow_ideal", "none", "none"),
        ("continuum", "none", "none"), ("lru_prefetch", "last_call", "none"), ("pbkv_lae", "none", "none"), ("pbkv", "none", "outcome"), ("pbkv", "conservative", "outcome"),
        ("pbkv", "none", "always"), ("pbkv", "conservative", "always"), ("pbkv_perfect", "none", "always"),
        ("pbkv_perfect", "conservative", "always"), ("oracle", "none", "none"), ("oracle", "conservative", "none")]
    assert {r["trust"]: "trust_switches" in r for r in rows if r["policy"] == "pbkv"} == {"outcome": True, "always": False}
    for r in rows:
        assert ROW_FIELDS <= set(r)
        assert r["gpu_hit_tokens"] + r["host_hit_tokens"] + r["miss_tokens"] == r["prompt_tokens"]
        assert r["hit_rate"] == pytest.approx(r["gpu_hit_tokens"] / r["prompt_tokens"])
        assert r["hit_rate"] <= r["setting_bound_hit_rate"] <= 1  # no policy beats its setting's bound
        assert r["bound_method"] == "lp"
        parts = sum(r[f"time_{p}_s"] for p in ("tool", "queue", "prefill", "decode", "pcie", "predictor"))
        assert parts == pytest.approx(r["mean_workflow_latency_s"], rel=1e-9)
    assert by_gap(rows)
    by = {(r["policy"], r["prefetch"]): r for r in rows}
    assert {label(r) for r in rows if r["policy"] == "pbkv"} == {"pbkv", "pbkv+conservative", "pbkv [always]",
                                                                 "pbkv+conservative [always]"}
    assert by["pbkv", "conservative"]["prefetch_precision"] is not None and by["lru", "none"]["prefetch_precision"] is None
    assert by["tlru", "none"]["hit_rate"] == by["lru", "none"]["hit_rate"]  # threshold 0: T-LRU is LRU
    assert summary["predictor"]["family"].startswith("markov")
    for png in ("hit_rate.png", "latency.png"):
        assert (tmp_path / "run" / png).stat().st_size > 10_000
    assert "x_lru_hit" in stdout and "pbkv_perfect" in stdout
    assert summary["kvflow_graph"]["origin"] == "declared" and summary["kvflow_graph"]["kind"] == "transitions"
    assert by["kvflow", "none"]["prefetched_tokens"] == 0 < by["kvflow", "kvflow"]["prefetched_tokens"]
    assert by["kvflow_ideal", "none"]["prefetched_tokens"] == 0 < by["kvflow_ideal", "aggressive"]["prefetched_tokens"]
    assert summary["end_signal"]["delay_s"] > 0 and summary["end_signal"]["inactivity_timeout_s"] > 1


def test_sglangs_strategies_and_the_other_baselines_under_program_fcfs(tmp_path, cache):
    """The policies the default list leaves out, under Continuum's program-level FCFS admission."""
    summary, _ = evaluate(tmp_path / "baselines", "policies=[lru,fifo,mru,filo,slru,priority,kvflow_nolae,continuum]",
                          "sim.scheduling=program_fcfs", cache=cache)
    rows = summary["rows"]
    assert [(r["policy"], r["prefetch"]) for r in rows] == [
        ("lru", "none"), ("fifo", "none"), ("mru", "none"), ("filo", "none"), ("slru", "none"), ("priority", "none"),
        ("kvflow_nolae", "aggressive"), ("kvflow_nolae", "none"), ("continuum", "none")]
    by = {(r["policy"], r["prefetch"]): r for r in rows}
    assert by["priority", "none"]["hit_rate"] == by["lru", "none"]["hit_rate"]  # no request priorities: LRU
    assert by["mru", "none"]["hit_rate"] != by["lru", "none"]["hit_rate"]
    assert summary["config"]["sim"]["scheduling"] == "program_fcfs"
    for r in rows:
        assert r["hit_rate"] <= r["setting_bound_hit_rate"] <= 1


SHIPPED_DATA = sorted(p.stem for p in (REPO / "conf" / "data").glob("*.yaml") if p.stem != "collected")  # none ship


def test_every_registered_policy_runs_on_every_shipped_workload(tmp_path, cache):
    """The whole policy registry on each dataset the repository ships (generated, transcript variants,
    Who&When and tau-bench), one multirun at debug sizes: a row per policy, within the bounds."""
    from serving_integration.cache.policies import POLICIES

    done = subprocess.run([sys.executable, "evaluate.py", "-m", f"data={','.join(SHIPPED_DATA)}",
                           f"policies=[{','.join(POLICIES)}]", "prefetch=[none]", "debug=evaluate",
                           f"hydra.sweep.dir={tmp_path}", f"data.cache_dir={cache}"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/summary.json"))]
    assert sorted(s["config"]["data"]["name"] for s in summaries) == SHIPPED_DATA
    for summary in summaries:
        rows = summary["rows"]
        assert {r["policy"] for r in rows} == set(POLICIES), rows[0]["workload"]
        for r in rows:
            assert r["gpu_hit_tokens"] + r["host_hit_tokens"] + r["miss_tokens"] == r["prompt_tokens"] > 0
            assert r["hit_rate"] <= r["setting_bound_hit_rate"] <= 1


def test_headroom_rows_split_the_bounds_extra_hits(tmp_path, cache):
    """headroom=true: rows without prefetch carry the attribution (simulator/headroom.py), each split
    adding up to the bound's extra hits; prefetch rows do not (their hits are not what they kept)."""
    summary, _ = evaluate(tmp_path / "headroom", "headroom=true", "headroom_integer=[lru]",
                          "policies=[lru,pbkv_perfect]", "prefetch=[none,conservative]", cache=cache)
    by = {(r["policy"], r["prefetch"]): r for r in summary["rows"]}
    assert "headroom_bound_hit_rate" not in by["pbkv_perfect", "conservative"]
    # headroom_integer: lru's row alone searches its bound's integer optimum, which lies below the LP bound
    lru = by["lru", "none"]
    assert "headroom_integer_bound_hit_rate" not in by["pbkv_perfect", "none"]
    assert lru["hit_rate"] <= lru["headroom_integer_bound_hit_rate"] <= lru["bound_hit_rate"] + 1e-9
    for key in (("lru", "none"), ("pbkv_perfect", "none")):
        r = by[key]
        delta = r["headroom_bound_hit_rate"] - r["headroom_run_hit_rate"]
        assert delta >= -1e-9 and r["headroom_run_hit_rate"] <= r["hit_rate"]
        assert sum(v for k, v in r.items() if k.startswith("headroom_reuse_")) == pytest.approx(delta, abs=1e-9)
        assert sum(v for k, v in r.items() if k.startswith("headroom_phase_")) == pytest.approx(delta, abs=1e-9)
    assert by["lru", "none"]["headroom_bound_hit_rate"] - by["lru", "none"]["headroom_run_hit_rate"] > 0.01


def test_seeds_give_means_and_confidence_intervals(tmp_path, cache):
    summary, _ = evaluate(tmp_path / "seeds", "policies=[lru,pbkv_lae]", "seeds=[0,1,2]",
                          "sim.end_signal_loss=0.5", cache=cache)
    assert len(summary["seed_rows"]) == 6 and len(summary["rows"]) == 2
    for r in summary["rows"]:
        assert r["seeds"] == [0, 1, 2] and r["end_signal_loss"] == 0.5
        values = r["hit_rate_per_seed"]
        assert len(set(values)) == 3  # a different workload per seed
        assert r["hit_rate"] == pytest.approx(sum(values) / 3)
        assert 0 < r["hit_rate_ci95"] and r["mean_workflow_latency_s_ci95"] > 0
        assert min(values) < r["hit_rate"] + r["hit_rate_ci95"] and max(values) > r["hit_rate"] - r["hit_rate_ci95"]
    lae = [r for r in summary["seed_rows"] if r["policy"] == "pbkv_lae"]
    assert all(r["ended_by_timeout"] + r["ended_by_signal"] <= r["workflows"] for r in lae)
    assert sum(r["ended_by_timeout"] for r in lae) > 0
    # the same seeds split over two jobs (as experiment=claims runs them) report as that one run
    from serving_integration.experiments.report import load_rows

    for name, seeds in (("first", "seeds=[0]"), ("rest", "seeds=[1,2]")):
        evaluate(tmp_path / "split" / name, "policies=[lru,pbkv_lae]", seeds, "sim.end_signal_loss=0.5", cache=cache)
    merged, _ = load_rows([str(tmp_path / "split")])
    assert [{k: v for k, v in r.items() if k != "sources"} for r in merged] == summary["rows"]


def by_gap(rows):
    """gap_closed: 0 for LRU, (hit - LRU) / (setting's bound - LRU) for the others."""
    lru = next(r for r in rows if r["policy"] == "lru")
    for r in rows:
        expected = (r["hit_rate"] - lru["hit_rate"]) / (r["setting_bound_hit_rate"] - lru["hit_rate"])
        assert r["gap_closed"] == pytest.approx(expected)
    return lru["gap_closed"] == 0


def test_same_config_same_summary_and_wandb_offline(tmp_path, cache):
    args = ("policies=[lru,pbkv]", "predictor.noise=0.2", "prefetch=[conservative]")
    first, _ = evaluate(tmp_path / "a", *args, cache=cache)
    second, _ = evaluate(tmp_path / "b", "wandb=default", *args, cache=cache)
    assert first["rows"] == second["rows"]
    assert list((tmp_path / "b" / "wandb").glob("offline-run-*"))
    third, _ = evaluate(tmp_path / "c", *args, "seed=1", cache=cache)
    assert third["rows"][1]["hit_rate"] != first["rows"][1]["hit_rate"]


def test_unknown_policy_is_a_clear_error(tmp_path, cache):
    done = subprocess.run([sys.executable, "evaluate.py", f"hydra.run.dir={tmp_path}", f"data.cache_dir={cache}",
                           "debug=evaluate", "policies=[lru,arc]"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "policies[1]=arc: should be one of" in done.stderr


def test_kv_pruning_rows(tmp_path, cache):
    summary, stdout = evaluate(tmp_path / "kv", "policies=[lru]", "kv.budget=3000",
                               "kv.method=intent", "kv.layouts=[compaction,sentinel]", cache=cache)
    kv = {r["layout"]: r for r in summary["rows"] if r["comparison"] == "kv"}
    assert set(kv) == {"none", "compaction", "sentinel"}
    assert kv["none"]["kv_budget"] is None and kv["sentinel"]["kv_budget"] == 3000
    # pruning reads less KV; the sentinel layout keeps the prefix cache matching, compaction does not
    assert kv["sentinel"]["kv_tokens_read"] < kv["none"]["kv_tokens_read"]
    assert kv["sentinel"]["reuse_rate"] > kv["compaction"]["reuse_rate"]
    assert all(r["hit_rate"] <= r["setting_bound_hit_rate"] for r in summary["rows"])
    assert "reuse_rate" in stdout and "prefix_hit_rate" not in summary["rows"][0]  # one name for one value


def test_rows_carry_the_datasets_own_workload_name(tmp_path):
    from data import store
    from data.generators import SweBench

    data = store.save(store.build(SweBench().generate(12, seed=0), val=0.2, test=0.2, seed=0), tmp_path / "mine")
    # data=hover is the config's default; the dataset given by path is swebench
    summary, _ = evaluate(tmp_path / "run", f"data.path={data}", "policies=[lru]", cache=tmp_path)
    assert {r["workload"] for r in summary["rows"]} == {"swebench"}


def test_evaluate_runs_a_cluster(tmp_path, cache):
    summary, stdout = evaluate(tmp_path / "run", "sim.replicas=2", "sim.routing=pbkv", "policies=[lru,pbkv]",
                               "pbkv.trust=outcome", "prefetch=[none]", cache=cache)
    rows = summary["rows"]
    assert [(r["policy"], r["replicas"], r["routing"]) for r in rows] == [("lru", 2, "pbkv"), ("pbkv", 2, "pbkv")]
    for r in rows:
        assert r["gpu_hit_tokens"] + r["host_hit_tokens"] + r["miss_tokens"] == r["prompt_tokens"]
        assert sum(r["replica_calls"]) == r["calls"] and r["load_imbalance"] >= 1.0
        assert r["predictor"] == "markov"  # the pbkv router reads the learned predictor, whatever evicts
    assert "2 replicas (gpu_tokens in total), routing=pbkv" in stdout
