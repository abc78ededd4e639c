"""The Who&When importer on the real files shipped in data/traces/who_and_when (compressed), and on the
published layout (plain .json)."""

import gzip
import hashlib
import json
from collections import Counter

import pytest

from data import store
from data.errors import TraceValidationError
from data.published import read_bytes
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
    run = json.loads(read_bytes(WHO_AND_WHEN / "Algorithm-Generated" / "1.json"))
    terminal_output = next(m["content"] for m in run["history"] if m["name"] == "Computer_terminal")
    calls = [c for c in traces.calls if c["workflow_id"] == "who_and_when-ag2-1"]
    later = calls[1]  # the turn right after the terminal's output
    texts = [traces.segments[i]["text"] for i in later["prompt_ids"]]
    assert terminal_output in texts
    assert traces.segments[later["prompt_ids"][0]]["kind"] == "system"  # AG2 agents have system prompts


def test_calls_follow_the_history(traces):
    run = json.loads(read_bytes(WHO_AND_WHEN / "Hand-Crafted" / "1.json"))
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


def test_the_published_layout_reads_as_the_compressed_copy(tmp_path, counter):
    """Plain N.json files (as Who&When publishes them) give the same calls as the shipped N.json.gz."""
    for subset, names in (("Algorithm-Generated", ("1", "2")), ("Hand-Crafted", ("1",))):
        (tmp_path / "plain" / subset).mkdir(parents=True)
        (tmp_path / "packed" / subset).mkdir(parents=True)
        for name in names:
            raw = read_bytes(WHO_AND_WHEN / subset / f"{name}.json")
            (tmp_path / "plain" / subset / f"{name}.json").write_bytes(raw)
            (tmp_path / "packed" / subset / f"{name}.json.gz").write_bytes(gzip.compress(raw))
    plain, packed = (read_who_and_when(tmp_path / kind, counter) for kind in ("plain", "packed"))
    assert plain.calls == packed.calls and plain.n_workflows == 3


def test_the_shipped_files_are_the_published_ones():
    """Each file decompresses to the bytes whose sha256 PROVENANCE.md's SHA256SUMS records."""
    sums = dict(line.split()[::-1] for line in (WHO_AND_WHEN / "SHA256SUMS").read_text().splitlines())
    assert len(sums) == 184
    for name, digest in sums.items():
        assert hashlib.sha256(read_bytes(WHO_AND_WHEN / name)).hexdigest() == digest, name


def test_n_workflows_keeps_the_first_runs_and_only_their_segments(traces):
    from data.readers import first_workflows, read_traces

    kept = first_workflows(traces, 60, "who_and_when")
    order = list(dict.fromkeys(c["workflow_id"] for c in traces.calls))
    assert kept.n_workflows == 60 and list(dict.fromkeys(c["workflow_id"] for c in kept.calls)) == order[:60]
    assert kept.calls == [c for c in traces.calls if c["workflow_id"] in set(order[:60])]  # whole runs, in order
    read = {seg for c in kept.calls for seg in c["prompt_ids"]}
    assert set(kept.segments) == read < set(traces.segments)
    with pytest.raises(ValueError, match="n_workflows=185, but the source holds 184 workflows"):
        read_traces("who_and_when", str(WHO_AND_WHEN), n_workflows=185)
