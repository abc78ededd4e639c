"""A real SGLang 0.5.23 server on the CPU, end to end: `launch --cpu` (the tiny random Llama,
HiCache on, the PBKV plugin loaded through its entry point), the bench client replaying generated
hover workflows under `lru` and under `pbkv` (a Markov checkpoint fitted here), and the simulator
replaying the same workflows with the same capacities (experiments.validate_sim).

Sized for CI (docs/serving.md, "SGLang on a CPU"): 4 short workflows (small passages and system
prompts, outputs scaled to a tenth), a 2,500-token device pool so that eviction and the host tier
are exercised, one fresh server per policy (about 40 s to start on a quiet 2-core machine).
"""

from __future__ import annotations

import time

import pytest

from data import store
from data.cli import compose_config
from data.generate import generate
from models import save_predictor
from models.base import vocabulary
from models.markov import MarkovPredictor
from serving_integration.experiments import bench, validate_sim

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore")]

GPU_TOKENS = 2500  # the longest prompt is about 1,100 tokens: two run together, a third evicts
SHORT_TOLERANCE = 0.08  # device hit-rate gap allowed in the short in-suite comparison (see below)
CONCURRENCY = 2
TOOL_TIME_SCALE = 0.1
SMALL_HOVER = ["workload=hover", "n_workflows=40", "seed=0", "workload.passage_tokens=24",
               "workload.output_scale=0.1",
               "workload.system_prompt_tokens={retriever:48,summarizer:64,query_generator:48,verifier:96}"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang-cpu") / "hover"
    generate(compose_config("generate", [*SMALL_HOVER, f"out={out}"]))
    return store.load(out)


@pytest.fixture(scope="module")
def checkpoint(dataset, tmp_path_factory):
    """pbkv's predictor: an order-2 Markov chain counted on the train split (models.markov)."""
    sequences = [[c.agent for c in wf] for wf in bench.replay_workflows(dataset.rows("train"))]
    names = vocabulary(a for s in sequences for a in s)
    index = {a: i for i, a in enumerate(names)}
    predictor = MarkovPredictor.from_sequences(names, 3, [[index[a] for a in s] for s in sequences], order=2)
    return save_predictor(predictor, tmp_path_factory.mktemp("ckpt") / "predictor.pt")


@pytest.fixture(scope="module")
def runs(dataset, checkpoint, tmp_path_factory):
    """One fresh server per policy, the test split replayed on each; stopped (process group) after."""
    logs = tmp_path_factory.mktemp("server-logs")
    workflows = bench.replay_workflows(dataset.rows("test"))
    out = {}
    for policy in ("lru", "pbkv"):
        began = time.monotonic()
        out[policy] = validate_sim.real_run(workflows, policy, gpu_tokens=GPU_TOKENS, concurrency=CONCURRENCY,
                                            tool_time_scale=TOOL_TIME_SCALE, checkpoint=checkpoint, log_dir=logs)
        out[policy]["wall_s"] = time.monotonic() - began
        print(f"{policy}: server ready in {out[policy]['ready_s']:.0f} s, replay {out[policy]['replay_s']:.0f} s, "
              f"total {out[policy]['wall_s']:.0f} s")
    return out


def test_replay_has_no_failed_call_and_reports_device_and_host_hits(runs, dataset):
    n_calls = len(dataset.rows("test"))
    for policy, run in runs.items():
        row, results = run["row"], run["results"]
        assert len(results) == n_calls
        assert row["failed_calls"] == 0, (policy, sorted({r.error for r in results if not r.ok}))
        assert all(r.completion_tokens >= 1 and r.prompt_tokens > 0 for r in results)
        # cached_tokens comes back split by tier, and the split adds up
        assert all(r.device_tokens + r.host_tokens == r.cached_tokens for r in results)
        assert row["gpu_hit_tokens"] > 0, policy  # system prompts and each workflow's growing transcript
        assert row["host_hit_tokens"] > 0, policy  # the device pool is small: evicted prefixes come back from host
        assert 0.0 < row["hit_rate"] < 1.0 and row["prompt_tokens"] == sum(r.prompt_tokens for r in results)
    assert runs["lru"]["plugin"] == {}  # lru is SGLang's own policy: the plugin stays out of the way


def test_plugin_counters_show_predictions_tags_ends_and_prefetch(runs, dataset):
    rows = dataset.rows("test")
    n_workflows = len({r["workflow_id"] for r in rows})
    plugin = runs["pbkv"]["plugin"]
    counters = plugin["counters"]
    assert plugin["policy"] == "pbkv" and plugin["has_predictor"] and not plugin["degraded"]
    assert counters.get("requests_tagged", 0) >= len(rows)  # every replayed call carried its tag
    assert counters.get("calls_finished", 0) == len(rows)
    assert counters.get("workflows_started", 0) == n_workflows
    assert counters.get("workflows_ended", 0) == n_workflows and plugin["live_workflows"] == 0
    assert counters.get("predictor_calls", 0) >= 1 and counters.get("predicted_workflows", 0) >= 1
    assert counters.get("predictor_timeout", 0) == 0 and counters.get("hook_errors", 0) == 0
    assert counters.get("prefetch_rounds", 0) >= 1


def test_workflow_metadata_reached_the_policy(runs, dataset):
    """The tags the runtime acted on are exactly the calls replayed (workflow id, agent, step), and
    each workflow's end came as its own signal after its last call, as a real orchestrator sends it."""
    rows = dataset.rows("test")
    sent = {(r["workflow_id"], r["agent"], int(r["step"])) for r in rows}
    seen = runs["pbkv"]["plugin"]["recent_tags"]
    assert len(seen) == len(sent)
    assert {(t["workflow_id"], t["agent"], t["step"]) for t in seen} == sent
    assert not any(t["workflow_end"] for t in seen)  # no call claims to be the last before it returns
    assert runs["pbkv"]["plugin"]["counters"].get("end_signals", 0) == len({w for w, _, _ in sent})
    assert all(t["nodes"] > 0 for t in seen)  # each call's path was recorded in the ledger under its workflow


def test_simulator_matches_the_server(runs, dataset, checkpoint):
    """The short version of `validate_sim`: same workflows, same capacities; device hit rates close."""
    from models import load_predictor

    rows = dataset.rows("test")
    config = validate_sim.sim_config(GPU_TOKENS, 2.0, CONCURRENCY)
    cost = validate_sim.cpu_cost_model()
    predictor = load_predictor(checkpoint)
    table = validate_sim.compare(
        {p: runs[p]["row"] for p in runs},
        {p: validate_sim.sim_run(rows, p, config, cost, predictor, TOOL_TIME_SCALE) for p in runs})
    print(validate_sim.format_comparison(table))
    # 4 workflows (34 calls) move a hit rate by points per call, and the server's interleaving of
    # calls depends on its timing: the gaps measured here were 0.7-6.3 points, the largest while
    # other jobs loaded both cores. The 5-point goal (validate_sim.TOLERANCE) is for the 10-workflow
    # command; this short version allows 8.
    for line in table["rows"]:
        assert abs(line["real_hit_rate"] - line["sim_hit_rate"]) <= SHORT_TOLERANCE, line


@pytest.fixture(scope="module")
def baseline_runs(dataset, tmp_path_factory):
    """kvflow (its step graph from the dataset) and lru_prefetch, each on a fresh server, the test split
    replayed on each: the plugin serves both with their own prefetch."""
    logs = tmp_path_factory.mktemp("baseline-logs")
    workflows = bench.replay_workflows(dataset.rows("test"))
    out = {}
    for policy in ("kvflow", "lru_prefetch"):
        extra = ["--step-graph-traces", str(dataset.path)] if policy == "kvflow" else []
        out[policy] = validate_sim.real_run(workflows, policy, gpu_tokens=GPU_TOKENS, concurrency=CONCURRENCY,
                                            tool_time_scale=TOOL_TIME_SCALE, log_dir=logs, extra_launch=extra)
        print(f"{policy}: server ready in {out[policy]['ready_s']:.0f} s, replay {out[policy]['replay_s']:.0f} s")
    return out


def test_kvflow_and_lru_prefetch_are_served_with_their_own_prefetch(baseline_runs, dataset):
    rows = dataset.rows("test")
    own = {"kvflow": "kvflow", "lru_prefetch": "last_call"}
    for policy, run in baseline_runs.items():
        row, plugin, results = run["row"], run["plugin"], run["results"]
        assert len(results) == len(rows) and row["failed_calls"] == 0, (policy, {r.error for r in results if not r.ok})
        assert plugin["policy"] == policy and plugin["prefetch"] == own[policy]
        counters = plugin["counters"]
        assert counters.get("calls_finished", 0) == len(rows) and counters.get("hook_errors", 0) == 0, counters
        assert counters.get("prefetched_tokens", 0) > 0 and counters.get("prefetch_rounds", 0) >= 1, (policy, counters)
        assert row["gpu_hit_tokens"] > 0 and plugin["live_workflows"] == 0
    kvflow = baseline_runs["kvflow"]["plugin"]
    assert kvflow["has_predictor"] and not kvflow["degraded"]  # the step graph drove its updates
    assert kvflow["counters"].get("predictor_calls", 0) >= 1
    assert not baseline_runs["lru_prefetch"]["plugin"]["has_predictor"]  # plain prefetch: no predictor


def test_pbkv_time_is_served_and_hears_of_every_queued_call(dataset, checkpoint, tmp_path):
    """pbkv_time in a real server: the plugin hears of each call as it enters SGLang's waiting queue
    (its cached path read without touching the tree), predicts after each finished call, and no hook
    fails."""
    rows = dataset.rows("test")
    run = validate_sim.real_run(bench.replay_workflows(rows), "pbkv_time", gpu_tokens=GPU_TOKENS,
                                concurrency=CONCURRENCY, tool_time_scale=TOOL_TIME_SCALE, checkpoint=checkpoint,
                                log_dir=tmp_path)
    row, plugin, results = run["row"], run["plugin"], run["results"]
    assert len(results) == len(rows) and row["failed_calls"] == 0, {r.error for r in results if not r.ok}
    assert plugin["policy"] == "pbkv_time" and plugin["has_predictor"] and not plugin["degraded"]
    counters = plugin["counters"]
    assert counters.get("hook_errors", 0) == 0 and counters.get("calls_finished", 0) == len(rows), counters
    assert counters.get("calls_queued", 0) >= len(rows) and counters.get("predictor_calls", 0) >= 1, counters
    assert counters.get("predictor_times_failed", 0) == 0 and row["gpu_hit_tokens"] > 0
