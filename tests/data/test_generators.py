"""Generated workloads: determinism, latent-driven paths, growing context, realistic sizes."""

import json
import re
from collections import defaultdict

import numpy as np
import pytest

from data.generators import WORKLOADS, FinanceBench, Hover, SweBench


def by_workflow(traces):
    groups = defaultdict(list)
    for c in traces.calls:
        groups[c["workflow_id"]].append(c)
    return list(groups.values())


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_traces(name):
    make = WORKLOADS[name]
    a, b, c = make().generate(30, seed=7), make().generate(30, seed=7), make().generate(30, seed=8)
    assert a.calls == b.calls and a.segments == b.segments
    assert a.calls != c.calls
    # workflow i does not depend on how many are generated
    assert make().generate(10, seed=7).calls == [x for x in a.calls if int(x["workflow_id"][-6:]) < 10]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_context_grows_like_an_agent_transcript(name):
    for calls in by_workflow(WORKLOADS[name]().generate(25, seed=0)):
        assert [c["step"] for c in calls] == list(range(len(calls)))
        assert calls[-1]["end_of_workflow"] and not any(c["end_of_workflow"] for c in calls[:-1])
        for prev, cur in zip(calls, calls[1:]):
            assert cur["prompt_ids"][0] == f"sys:{name}:{cur['agent']}"
            assert cur["prompt_ids"][1] == f"task:{cur['workflow_id']}"
            # everything the previous call saw after its system prompt, then its output
            assert cur["prompt_ids"][1:len(prev["prompt_ids"]) + 1] == prev["prompt_ids"][1:] + [prev["output_id"]]
            assert sum(cur["prompt_segment_tokens"][1:]) > sum(prev["prompt_segment_tokens"][1:])


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_realistic_sizes(name):
    traces = WORKLOADS[name]().generate(200, seed=0)
    sys_tokens = [s["tokens"] for s in traces.segments.values() if s["kind"] == "system"]
    tool_tokens = [s["tokens"] for s in traces.segments.values() if s["kind"] == "tool"]
    assert 500 <= min(sys_tokens) and max(sys_tokens) <= 3000
    assert max(tool_tokens) >= 5000
    assert any(c["tool_time"] > 0 for c in traces.calls)


def test_hover_loops_follow_the_hops_the_claim_reveals():
    traces = Hover(cue_noise=0.0).generate(400, seed=0)
    retrievals = defaultdict(list)
    for calls in by_workflow(traces):
        latent = json.loads(calls[0]["latent"])
        assert latent["cue"] == latent["hops"]  # without cue noise the claim is written for its hop count
        assert latent["template"].split("-")[0] == str(latent["hops"])
        n_retrievals = sum(c["agent"] == "retriever" for c in calls)
        assert n_retrievals == latent["hops"] + latent["extra_hops"]
        retrievals[latent["hops"]].append(n_retrievals)
    means = [np.mean(retrievals[h]) for h in sorted(retrievals)]
    assert sorted(retrievals) == [1, 2, 3, 4] and means == sorted(means)


@pytest.mark.parametrize("name,key", [("hover", "hops"), ("swebench", "difficulty"), ("financebench", "question_type")])
def test_cue_noise_weakens_the_text_and_tasks_do_not_repeat(name, key):
    latents = [json.loads(calls[0]["latent"]) for calls in by_workflow(WORKLOADS[name](cue_noise=0.3).generate(400, 0))]
    wrong = np.mean([lat["cue"] != lat[key] for lat in latents])
    assert 0.2 < wrong < 0.4
    tasks = [calls[0]["task"] for calls in by_workflow(WORKLOADS[name]().generate(300, 0))]
    assert len(set(tasks)) >= 0.95 * len(tasks)  # paraphrases, fillers and distractors: no two alike


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_val_and_test_templates_are_unseen_in_train(name):
    from data.store import build

    ds = build(WORKLOADS[name]().generate(400, 0), val=0.1, test=0.1, seed=0)
    templates = {s: {json.loads(r["latent"])["template"] for r in ds.rows(s)} for s in ("train", "val", "test")}
    assert not templates["test"] & templates["train"] and not templates["val"] & templates["train"]
    assert ds.meta["split"]["by"] == "template"
    assert 30 <= ds.meta["splits"]["test"]["workflows"] <= 40 and 30 <= ds.meta["splits"]["val"]["workflows"] <= 40
    plain = build(WORKLOADS[name](template_holdout=False).generate(400, 0), val=0.1, test=0.1, seed=0)
    assert plain.meta["split"]["by"] == "workflow"
    assert {json.loads(r["latent"])["template"] for r in plain.rows("test")} & {
        json.loads(r["latent"])["template"] for r in plain.rows("train")}  # without holdout they overlap


def test_swebench_retries_follow_difficulty():
    traces = SweBench(cue_noise=0.0).generate(600, seed=0)
    retries = defaultdict(list)
    for calls in by_workflow(traces):
        latent = json.loads(calls[0]["latent"])
        n_tests = sum(c["agent"] == "tester" for c in calls)
        assert n_tests == latent["failed_test_runs"] + 1
        assert [c["agent"] for c in calls][:3] == ["planner", "coder", "tester"] and calls[-1]["agent"] == "reviewer"
        assert re.search({"easy": r"typo|misleading|deprecation|dead page|wrong default",
                          "medium": r"None|keyword|off by one|non-ASCII|dtype",
                          "hard": r"deadlock|leaks|inconsistent|quadratic|pickle"}[latent["difficulty"]],
                         calls[0]["task"])
        retries[latent["difficulty"]].append(n_tests - 1)
    assert np.mean(retries["easy"]) < np.mean(retries["medium"]) < np.mean(retries["hard"])
    assert max(retries["hard"]) >= 3  # long loops, with replanning, do occur


def test_financebench_is_static():
    paths = {tuple(c["agent"] for c in calls) for calls in by_workflow(FinanceBench().generate(100, seed=0))}
    assert paths == {("retriever",) * 3 + ("analyst",) + ("calculator",) * 2 + ("writer",)}


def test_system_prompts_are_shared_across_workflows():
    traces = Hover().generate(20, seed=0)
    sys_ids = {c["prompt_ids"][0] for c in traces.calls}
    assert sys_ids == {f"sys:hover:{a}" for a in ("retriever", "summarizer", "query_generator", "verifier")}


def test_output_scale_shrinks_outputs_and_keeps_the_paths():
    full, small = Hover().generate(20, seed=3), Hover(output_scale=0.1).generate(20, seed=3)
    assert [c["agent"] for c in full.calls] == [c["agent"] for c in small.calls]  # same random stream
    for a, b in zip(full.calls, small.calls):
        assert b["output_tokens"] == max(1, round(a["output_tokens"] * 0.1))
    assert sum(c["output_tokens"] for c in small.calls) < sum(c["output_tokens"] for c in full.calls) / 5
    with pytest.raises(ValueError, match="output_scale"):
        Hover(output_scale=0)


def test_declared_agent_graph_and_bayes_ceiling():
    from data.generators import generate

    for name, make in WORKLOADS.items():
        graph = make().generate(5, seed=0).meta["agent_graph"]
        paths = [[c["agent"] for c in calls] for calls in by_workflow(make().generate(60, seed=1))]
        if graph["kind"] == "pipeline":  # every workflow walks the declared pipeline
            assert all(p == graph["steps"] for p in paths)
        else:  # every transition a workflow takes is declared
            assert all(p[0] in graph["start"] for p in paths)
            assert all(b in graph["next"][a] for p in paths for a, b in zip(p, p[1:] + ["END"]))
    static = FinanceBench().bayes_ceiling(horizon=3, n_workflows=200)
    assert set(static.values()) == {1.0}  # a fixed pipeline: nothing to guess
    hover = generate(Hover(), 30, seed=0).meta["bayes_ceiling"]
    assert hover["knows"] == ["hops"] and 0.9 < hover["top1_k1"] < 1.0  # the extra hop is hidden from the text
    assert hover["top1_k3"] < hover["top1_k1"] and hover["top1_alive_k1"] == hover["top1_k1"]


# sha256 of generate(30, seed=0)'s calls, segments and meta (json, sorted keys), taken before the
# transcript memory existed: a default-config dataset must stay exactly as it was
DEFAULT_DIGESTS = {"financebench": "9bf8b8586f62cb4c03c79f189497a599924974fadd407288e4ed4c91ff9a2808",
                   "hover": "32a44c4931172b161cc73fa7a08ad9202af02f85c96c741d7e4d2505af8f2d72",
                   "swebench": "1a9e2d9da5ca82236fb81813c4c491cda01f5e9ba27f8c8e73055eb9a9a1b220"}


def digest(traces) -> str:
    import hashlib

    return hashlib.sha256(json.dumps([traces.calls, traces.segments, traces.meta], sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_default_datasets_are_unchanged(name):
    assert digest(WORKLOADS[name]().generate(30, seed=0)) == DEFAULT_DIGESTS[name]
    assert digest(WORKLOADS[name](memory="per_agent").generate(30, seed=0)) == DEFAULT_DIGESTS[name]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_transcript_memory_resends_the_whole_conversation(name):
    make = WORKLOADS[name]
    plain, full = make().generate(25, seed=0), make(memory="transcript", turn_tokens=33).generate(25, seed=0)
    assert full.meta["memory"] == "transcript" and "memory" not in plain.meta
    same = ("workflow_id", "step", "agent", "task", "latent", "output_tokens", "tool_time", "end_of_workflow")
    assert [[c[k] for k in same] for c in full.calls] == [[c[k] for k in same] for c in plain.calls]
    team = sum(make().config.system_prompt_tokens.values())
    for calls in by_workflow(full):
        for prev, cur in zip([None] + calls, calls):
            assert cur["prompt_ids"][:2] == [f"sys:{name}:team", f"task:{cur['workflow_id']}"]
            assert cur["prompt_segment_tokens"][0] == team
            assert cur["prompt_ids"][-1] == f"turn:{cur['workflow_id']}:{cur['step']}"
            assert cur["prompt_segment_tokens"][-1] == 33
            if prev is not None:  # the previous call's prompt and output, then what came since
                assert cur["prompt_ids"][:len(prev["prompt_ids"]) + 1] == prev["prompt_ids"] + [prev["output_id"]]
    assert {s["kind"] for s in full.segments.values()} == {"system", "task", "output", "tool", "turn"}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_transcript_memory_raises_the_reusable_share(name):
    from data.stats import trace_stats

    plain = trace_stats(WORKLOADS[name]().generate(100, seed=0).calls)["reusable_share"]
    full = trace_stats(WORKLOADS[name](memory="transcript").generate(100, seed=0).calls)["reusable_share"]
    assert plain < 0.55 and full > 0.85 and full > plain + 0.3


def test_memory_is_checked():
    with pytest.raises(ValueError, match="memory='shared'|memory=shared"):
        Hover(memory="shared")
    with pytest.raises(ValueError, match="turn_tokens"):
        Hover(memory="transcript", turn_tokens=0)
