"""The tau-bench importer on the published airline trajectories shipped in data/traces/tau_bench (as
.json.gz; the importer also reads the published .json)."""

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import models.config  # noqa: F401  (registers the train config's schemas)
from data import store
from data.cli import CONF_DIR
from data.errors import TraceValidationError
from data.import_traces import import_traces, main as import_main
from data.published import located, read_bytes
from data.tau_bench import OPENER, read_tau_bench, user_simulator_system_prompt
from tests.conftest import REPO, TAU_BENCH


@pytest.fixture(scope="module")
def runs():
    return json.loads(read_bytes(TAU_BENCH))


@pytest.fixture(scope="module")
def traces(counter):
    return read_tau_bench(TAU_BENCH, counter)


def workflow(traces, task_id, trial):
    return [c for c in traces.calls if c["workflow_id"] == f"tau_bench-{task_id}-{trial}"]


def entry_text(entry):
    """An assistant entry's text as the README documents it: content, then one line per tool call."""
    calls = [f'<tool_call id="{c["id"]}" name="{c["function"]["name"]}">{c["function"]["arguments"]}</tool_call>'
             for c in entry.get("tool_calls") or []]
    return "\n".join(([entry["content"]] if entry.get("content") else []) + calls)


def messages(traces, call):
    return [(traces.segments[i]["kind"], traces.segments[i]["text"]) for i in call["prompt_ids"]]


def test_every_assistant_and_user_entry_is_one_call(traces, runs):
    in_file = Counter(m["role"] for run in runs for m in run["traj"])
    assert (in_file["assistant"], in_file["user"]) == (2454, 1490)  # the README's counts
    assert Counter(c["agent"] for c in traces.calls) == {"agent": 2454, "user_simulator": 1490}
    assert len(traces.calls) == 3944 and traces.n_workflows == 200
    assert {c["workload"] for c in traces.calls} == {"tau_bench"}
    assert traces.meta["format"] == "tau_bench" and "WordPiece" in traces.meta["tokenizer"]


def test_agent_prompt_is_the_trajectory_before_the_entry(traces, runs):
    for run in runs:
        calls = [c for c in workflow(traces, run["task_id"], run["trial"]) if c["agent"] == "agent"]
        at = [i for i, m in enumerate(run["traj"]) if m["role"] == "assistant"]
        assert len(calls) == len(at)
        for call, i in zip(calls, at):
            prompt = messages(traces, call)
            assert len(prompt) == i
            for (role, text), entry in zip(prompt, run["traj"][:i]):
                assert role == entry["role"]
                assert text == (entry_text(entry) if entry.get("tool_calls") else entry["content"])
            assert call["output_text"] == entry_text(run["traj"][i])
            assert call["task"] == run["info"]["task"]["instruction"]


def test_tool_calls_and_results_are_in_the_transcript(traces, runs):
    run = runs[0]  # books a flight: get_user_details, then searches
    i = next(i for i, m in enumerate(run["traj"]) if m.get("tool_calls"))
    call = run["traj"][i]["tool_calls"][0]
    result = run["traj"][i + 1]
    assert result["role"] == "tool" and result["tool_call_id"] == call["id"]
    after = workflow(traces, run["task_id"], run["trial"])
    after = next(c for c in after if c["agent"] == "agent" and len(c["prompt_ids"]) == i + 2)
    (role, text), (tool_role, tool_text) = messages(traces, after)[i:]
    assert role == "assistant" and call["id"] in text and call["function"]["name"] in text
    assert call["function"]["arguments"] in text
    assert (tool_role, tool_text) == ("tool", result["content"])


def test_user_simulator_prompt_is_its_own_role_flipped_view(traces, runs):
    for run in runs[:20]:
        traj = run["traj"]
        calls = [c for c in workflow(traces, run["task_id"], run["trial"]) if c["agent"] == "user_simulator"]
        user_lines = [m["content"] for m in traj if m["role"] == "user"]
        replies = [m["content"] for m in traj if m["role"] == "assistant" and not m.get("tool_calls")]
        assert [c["output_text"] for c in calls] == user_lines
        for k, call in enumerate(calls):
            prompt = messages(traces, call)
            system = user_simulator_system_prompt(run["info"]["task"]["instruction"])
            assert system.startswith("You are a user interacting with an agent.\n\nInstruction: "
                                     + run["info"]["task"]["instruction"] + "\n\nRules:\n- ")
            assert system.count("\n- ") == 6
            assert prompt[:2] == [("system", system), ("user", OPENER)]
            flipped = [m for j in range(k) for m in (("assistant", user_lines[j]), ("user", replies[j]))]
            assert prompt[2:] == flipped
        # each call's output is a prefix segment of the simulator's next call
        for prev, cur in zip(calls, calls[1:]):
            assert cur["prompt_ids"][:len(prev["prompt_ids"]) + 1] == prev["prompt_ids"] + [prev["output_id"]]
    first = workflow(traces, runs[0]["task_id"], runs[0]["trial"])[0]  # the simulator opens every run
    assert first["agent"] == "user_simulator" and first["step"] == 0
    assert "Instruction: " + runs[0]["info"]["task"]["instruction"] in messages(traces, first)[0][1]


def test_data_group_resolves_the_published_file(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=tau_bench"]).data
    assert cfg.name == "tau_bench" and cfg.source.format == "tau_bench"
    src = Path(cfg.source.src)
    assert (src if src.is_absolute() else (REPO / src)).resolve() == TAU_BENCH.resolve()
    cfg.source.src, cfg.cache_dir = str(TAU_BENCH), str(tmp_path)
    ds = store.resolve(cfg)
    assert ds.n_workflows == 200 and ds.meta["stats"]["calls"] == 3944


def test_corrupted_slice_is_reported_and_nothing_is_written(tmp_path, runs, capsys):
    bad = json.loads(json.dumps(runs[:3]))
    bad[1]["traj"][4]["role"] = "robot"
    bad[2]["trial"] = "0"
    src, out = tmp_path / "slice.json", tmp_path / "out"
    src.write_text(json.dumps(bad, indent=2))
    with pytest.raises(TraceValidationError) as info:
        read_tau_bench(src)
    shown = {str(issue) for issue in info.value.issues}
    assert any(s.startswith(f"{src}: run 1: field 'traj[4].role':") for s in shown), shown
    assert any(s.startswith(f"{src}: run 2: field 'trial':") for s in shown), shown
    assert not any(": run 0:" in s for s in shown)

    argv = ["format=tau_bench", f"src={src}", f"out={out}"]
    assert import_main(argv) == 1
    err = capsys.readouterr().err
    assert f"{src}: run 1: field 'traj[4].role'" in err and "nothing was written" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["slice.json"]

    # a broken structure (a user line right after a tool result, a user line without content)
    # and broken JSON are named too
    bad = json.loads(json.dumps(runs[:1]))
    i = next(i for i, m in enumerate(bad[0]["traj"]) if m["role"] == "tool")
    bad[0]["traj"].insert(i + 1, {"role": "user", "content": "hello?"})
    del bad[0]["traj"][1]["content"]
    src.write_text(json.dumps(bad))
    with pytest.raises(TraceValidationError) as info:
        read_tau_bench(src)
    assert [str(issue) for issue in info.value.issues] == [
        f"{src}: run 0: field 'traj[1].content': a user entry needs a string content",
        f"{src}: run 0: field 'traj[{i + 1}].role': a user line must answer the agent's text reply, "
        f"but traj[{i}] is a tool entry"]
    src.write_text(json.dumps(runs[:1], indent=2)[:-40])
    with pytest.raises(TraceValidationError, match=rf"{src}:\d+: malformed JSON"):
        read_tau_bench(src)

    # skip_bad_lines keeps the good runs and lists the bad one
    bad = json.loads(json.dumps(runs[:2]))
    bad[1]["traj"][4]["role"] = "robot"
    src.write_text(json.dumps(bad))
    kept = read_tau_bench(src, skip_bad_lines=True)
    assert {c["workflow_id"] for c in kept.calls} == {f"tau_bench-{runs[0]['task_id']}-{runs[0]['trial']}"}
    assert [str(i) for i in kept.skipped] and all(": run 1:" in str(i) for i in kept.skipped)


def test_the_published_json_and_a_damaged_copy(tmp_path, runs, counter):
    """The published .json reads like the shipped .json.gz found in its place; a truncated .gz is one issue."""
    assert located(TAU_BENCH).suffix == ".gz" or TAU_BENCH.is_file()
    plain = tmp_path / "gpt-4o-airline.json"
    plain.write_text(json.dumps(runs[:2]))
    packed = tmp_path / "packed" / "gpt-4o-airline.json"
    packed.parent.mkdir()
    packed.with_name(packed.name + ".gz").write_bytes(gzip.compress(plain.read_bytes()))
    assert read_tau_bench(plain, counter).calls == read_tau_bench(packed, counter).calls
    packed.with_name(packed.name + ".gz").write_bytes(gzip.compress(plain.read_bytes())[:200])
    with pytest.raises(TraceValidationError) as info:
        read_tau_bench(packed, counter)
    assert info.value.issues[0].file.endswith("gpt-4o-airline.json.gz") and "cannot read" in info.value.issues[0].reason
