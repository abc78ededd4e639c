"""The Who&When importer on the real files in ../shared/traces/who_and_when."""

import json
from collections import Counter

import pytest

from data import store
from data.errors import TraceValidationError
from data.who_and_when import read_who_and_when
from tests.conftest import WHO_AND_WHEN


@pytest.fixture(scope="module")
def traces(counter):
    return read_who_and_when(WHO_AND_WHEN, counter)


def test_all_184_runs_become_workflows(traces):
    per_subset = Counter()
    for wid in {c["workflow_id"] for c in traces.calls}:
        per_subset[wid.rsplit("-", 1)[0]] += 1
    assert per_subset == {"who_and_when-ag2": 126, "who_and_when-magentic": 58}
    assert traces.n_workflows == 184
    assert store.build(traces).workload == "who_and_when"  # evaluate's rows are labelled so, whatever the split


def test_tool_and_human_turns_are_context_not_calls(traces):
    agents = {c["agent"] for c in traces.calls}
    assert not agents & {"Computer_terminal", "ComputerTerminal", "human"}
    assert {"Orchestrator", "WebSurfer", "FileSurfer", "Assistant"} <= agents
    run = json.loads((WHO_AND_WHEN / "Algorithm-Generated" / "1.json").read_text())
    terminal_output = next(m["content"] for m in run["history"] if m["name"] == "Computer_terminal")
    calls = [c for c in traces.calls if c["workflow_id"] == "who_and_when-ag2-1"]
    later = calls[1]  # the turn right after the terminal's output
    texts = [traces.segments[i]["text"] for i in later["prompt_ids"]]
    assert terminal_output in texts
    assert traces.segments[later["prompt_ids"][0]]["kind"] == "system"  # AG2 agents have system prompts


def test_calls_follow_the_history(traces):
    run = json.loads((WHO_AND_WHEN / "Hand-Crafted" / "1.json").read_text())
    calls = [c for c in traces.calls if c["workflow_id"] == "who_and_when-magentic-1"]
    assert calls[0]["agent"] == "Orchestrator" and calls[0]["task"] == run["question"]
    # each call sees every earlier call's output (no system prompts in Magentic-One)
    for prev, cur in zip(calls, calls[1:]):
        assert prev["output_id"] in cur["prompt_ids"]
        assert cur["prompt_tokens"] > prev["prompt_tokens"]
    assert calls[-1]["end_of_workflow"]


def test_bad_run_file_is_reported(tmp_path, counter):
    (tmp_path / "Hand-Crafted").mkdir()
    (tmp_path / "Hand-Crafted" / "1.json").write_text(json.dumps({"question": "q", "history": [{"role": "human"}]}))
    with pytest.raises(TraceValidationError) as info:
        read_who_and_when(tmp_path, counter)
    issue = info.value.issues[0]
    assert issue.file.endswith("Hand-Crafted/1.json") and issue.field == "history[0].content"
