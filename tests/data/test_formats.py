"""Both trace formats: round trips, prefix structure, and every validation error."""

import json

import pytest

from data.errors import TraceValidationError
from data.tokenizer import TokenCounter
from data.formats import (MESSAGE_TEMPLATE_TOKENS, chat_records, message_segment_id, native_records,
                          read_chat, read_native, write_jsonl_atomic)


def write_lines(path, lines):
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return path


def native_line(**over):
    rec = {"workflow_id": "w1", "step": 0, "agent": "planner",
           "prompt": [{"id": "sys:planner", "tokens": 800}, {"id": "task:w1", "tokens": 40}],
           "output_tokens": 120, "output_id": "out:w1:0"}
    rec.update(over)
    return json.dumps(rec)


def chat_line(**over):
    rec = {"workflow_id": "t1", "agent": "coder",
           "messages": [{"role": "system", "content": "You write code."}, {"role": "user", "content": "Fix bug 7."}],
           "completion": "def f(): return 1"}
    rec.update(over)
    return json.dumps(rec)


def test_native_round_trip(tmp_path, hover_small):
    first = tmp_path / "a.jsonl"
    write_jsonl_atomic(first, native_records(hover_small.calls, hover_small.segments))
    again = read_native(first)
    second = tmp_path / "b.jsonl"
    write_jsonl_atomic(second, native_records(again.calls, again.segments))
    assert again.calls == [dict(c, latent="") for c in hover_small.calls]  # latent is not in the format
    assert first.read_bytes() == second.read_bytes()
    assert again.segments == hover_small.segments


def test_chat_round_trip_and_prefix_sharing(tmp_path, counter):
    sys_msg = {"role": "system", "content": "You are the coder."}
    task = {"role": "user", "content": "Fix the failing test in utils.py"}
    lines = [
        chat_line(workflow_id="t1", messages=[sys_msg, task], completion="patch v1", prompt_tokens=30,
                  timestamp=10.0),
        chat_line(workflow_id="t1", agent="tester", messages=[sys_msg, task, {"role": "assistant", "content": "patch v1"},
                                                              {"role": "tool", "content": "1 failed"}],
                  completion="still failing", timestamp=12.5),
    ]
    src = write_lines(tmp_path / "chat.jsonl", lines)
    traces = read_chat(src, counter)
    first, second = traces.calls
    assert second["prompt_ids"][: len(first["prompt_ids"]) + 1] == first["prompt_ids"] + [first["output_id"]]
    assert first["source_prompt_tokens"] == 30 and second["source_prompt_tokens"] is None
    assert first["prompt_segment_tokens"][1] == counter.count(task["content"]) + MESSAGE_TEMPLATE_TOKENS
    assert [c["step"] for c in traces.calls] == [0, 1]
    assert first["task"] == task["content"] and second["end_of_workflow"]
    assert traces.meta["tokenizer"] == counter.name

    out = tmp_path / "again.jsonl"
    write_jsonl_atomic(out, chat_records(traces.calls, traces.segments))
    assert read_chat(out, counter).calls == traces.calls


def test_chat_orders_by_step_then_timestamp(tmp_path, counter):
    by_step = write_lines(tmp_path / "s.jsonl", [chat_line(step=5, completion="b"), chat_line(step=2, completion="a")])
    assert [c["output_text"] for c in read_chat(by_step, counter).calls] == ["a", "b"]
    by_time = write_lines(tmp_path / "t.jsonl", [chat_line(timestamp=9.0, completion="b"),
                                                 chat_line(timestamp=1.0, completion="a")])
    calls = read_chat(by_time, counter).calls
    assert [c["output_text"] for c in calls] == ["a", "b"] and [c["step"] for c in calls] == [0, 1]


def test_tokens_counted_by_real_tokenizer(counter):
    assert counter.count("hello world") == 2
    assert counter.count("tokenization") > 1  # WordPiece splits it
    assert counter.count_many(["", "a b c"]) == [0, 3]


def error_of(read, path):
    with pytest.raises(TraceValidationError) as info:
        read(path)
    return info.value


@pytest.mark.parametrize("bad_line, field, reason", [
    (b'{"workflow_id": "w1", "step": 0,', "", "malformed JSON"),
    (native_line(agent=None).replace('"agent": null, ', ""), "agent", "required field is missing"),
    (native_line(step="3"), "step", "valid integer"),
    (native_line(step=True), "step", "valid integer"),
    (native_line(prompt=[{"id": "x", "tokens": 0}]), "prompt[0].tokens", "greater than 0"),
    (native_line(prompt=[{"id": "x", "tokens": 5}, {"id": "y", "tokens": -2}]), "prompt[1].tokens", "greater than 0"),
    (native_line(output_tokens=-1), "output_tokens", "greater than or equal to 0"),
    (native_line(prompt=[]), "prompt", "at least 1 item"),
    (native_line(prompt="sys"), "prompt", "valid array"),
    (b'{"workflow_id": "w1", "agent": "caf\xe9"}', "", "invalid UTF-8"),
])
def test_native_line_errors_name_file_line_field(tmp_path, bad_line, field, reason):
    src = write_lines(tmp_path / "n.jsonl", [native_line(workflow_id="ok"), bad_line])
    err = error_of(read_native, src)
    issue = err.issues[0]
    assert (issue.file, issue.line, issue.field) == (str(src), 2, field)
    assert reason in issue.reason
    assert f"{src}:2:" in str(err)


def test_native_cross_line_errors(tmp_path):
    src = write_lines(tmp_path / "n.jsonl", [
        native_line(step=1), native_line(step=1, output_id="out:w1:1"),              # step does not increase
        native_line(workflow_id="w2", prompt=[{"id": "sys:planner", "tokens": 9}]),  # token count conflict
        native_line(workflow_id="w3", end_of_workflow=True),
        native_line(workflow_id="w3", step=1, output_id="o3"),                       # after the end
    ])
    issues = error_of(read_native, src).issues
    assert [(i.line, i.field) for i in issues] == [(2, "step"), (3, "prompt[0].tokens"), (5, "workflow_id")]
    assert "does not increase" in issues[0].reason and "800" in issues[1].reason


@pytest.mark.parametrize("declared", [None, 3])
def test_hidden_vectors_have_one_size_and_go_to_the_meta(tmp_path, declared):
    """Every call's hidden vector has the trace's size (declared, else the first one's); a wrong size
    or type is FILE:LINE: field 'hidden'; model and size are what the dataset's meta records."""
    good = [native_line(step=0, output_id="o0", hidden=[0.5, -1.0, 2.0]),
            native_line(step=1, output_id="o1", hidden=[0.0, 0.0, 1.0]),
            native_line(step=2, output_id="o2")]  # a call without one is allowed
    traces = read_native(write_lines(tmp_path / "good.jsonl", good), model="org/m", size=declared)
    assert traces.meta["hidden"] == {"model": "org/m", "size": 3}
    assert [c["hidden"] for c in traces.calls] == [[0.5, -1.0, 2.0], [0.0, 0.0, 1.0], []]
    assert "hidden" not in read_native(write_lines(tmp_path / "none.jsonl", good[2:])).meta
    src = write_lines(tmp_path / "bad.jsonl", [*good, native_line(step=3, output_id="o3", hidden=[1.0, 2.0]),
                                               native_line(step=4, output_id="o4", hidden=[1.0, "x", 2.0])])
    issues = error_of(lambda p: read_native(p, size=declared), src).issues
    assert [(i.file, i.line, i.field) for i in issues] == [(str(src), 4, "hidden"), (str(src), 5, "hidden[1]")]
    assert "has 2 values; the trace's hidden size is 3" in issues[0].reason
    assert ("hidden_size" if declared else "the first vector, line 1") in issues[0].reason
    wrong = error_of(lambda p: read_chat(p, TokenCounter.wordpiece(), size=4),
                     write_lines(tmp_path / "c.jsonl", [chat_line(hidden=[1.0, 2.0, 3.0])])).issues[0]
    assert (wrong.line, wrong.field) == (1, "hidden") and "hidden size is 4 (hidden_size)" in wrong.reason


@pytest.mark.parametrize("bad_line, field, reason", [
    (chat_line(messages=[]), "messages", "at least 1 item"),
    (chat_line(messages=[{"role": "user"}]), "messages[0].content", "required field is missing"),
    (chat_line(messages=[{"role": "user", "content": 5}]), "messages[0].content", "valid string"),
    (chat_line(completion=None), "completion", "valid string"),
    (chat_line(prompt_tokens=-4), "prompt_tokens", "greater than or equal to 0"),
    (b'{"workflow_id": "t1", "agent": "\xff"}', "", "invalid UTF-8"),
    (b"not json", "", "malformed JSON"),
])
def test_chat_line_errors(tmp_path, counter, bad_line, field, reason):
    src = write_lines(tmp_path / "c.jsonl", [chat_line(), bad_line])
    issue = error_of(lambda p: read_chat(p, counter), src).issues[0]
    assert (issue.line, issue.field) == (2, field) and reason in issue.reason


def test_chat_repeated_step(tmp_path, counter):
    src = write_lines(tmp_path / "c.jsonl", [chat_line(step=1), chat_line(step=1, completion="x")])
    issue = error_of(lambda p: read_chat(p, counter), src).issues[0]
    assert (issue.line, issue.field) == (2, "step") and "repeats line 1" in issue.reason


def test_skip_bad_lines_reports_them(tmp_path, counter):
    src = write_lines(tmp_path / "c.jsonl", [chat_line(), b"{oops", chat_line(workflow_id="t2")])
    traces = read_chat(src, counter, skip_bad_lines=True)
    assert {c["workflow_id"] for c in traces.calls} == {"t1", "t2"}
    assert [i.line for i in traces.skipped] == [2]


def test_message_ids_depend_on_role_and_content():
    assert message_segment_id("user", "x") == message_segment_id("user", "x")
    assert message_segment_id("user", "x") != message_segment_id("assistant", "x")
