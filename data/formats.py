"""Readers and writers of the two JSON Lines trace formats (docs/datasets.md, "Trace formats").

Records are validated with pydantic (strict types) line by line; then the cross-line rules
(steps strictly increasing, one token count per segment id, nothing after end_of_workflow,
every hidden vector of one size) are checked. Any invalid line fails the whole read with every
issue listed, unless `skip_bad_lines` is set, in which case the bad lines are dropped and
reported in `Traces.skipped`.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections import defaultdict
from pathlib import Path
from typing import Annotated, Iterable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data.atomic import atomic_file
from data.errors import Issue, TraceValidationError
from data.schema import SegmentTable, Traces, call_record
from data.tokenizer import TokenCounter

# Tokens a chat template adds around each message (ChatML: <|im_start|>, role, newline,
# <|im_end|>). Counted so that an empty message is still a non-empty KV segment.
MESSAGE_TEMPLATE_TOKENS = 4

NonEmpty = Annotated[str, Field(min_length=1)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# Bounds of the stored columns (data.schema: int64 steps, int64 token counts, float32 hidden
# vectors). A token count is bounded far below int64 so that a prompt's sum of segments fits too.
INT64_MAX = 2**63 - 1
MAX_TOKENS = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
Step = Annotated[int, Field(ge=0, le=INT64_MAX)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Hidden = list[Annotated[float, Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]]


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class NativeSegment(_Record):
    id: NonEmpty
    tokens: Annotated[int, Field(gt=0, le=MAX_TOKENS)]
    text: str | None = None
    kind: str | None = None


class NativeCall(_Record):
    workflow_id: NonEmpty
    step: Step
    agent: NonEmpty
    prompt: Annotated[list[NativeSegment], Field(min_length=1)]
    output_tokens: Tokens
    output_id: str | None = None
    output_text: str | None = None
    workload: str | None = None
    task: str | None = None
    tool_time: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    start_time: FiniteFloat | None = None
    end_time: FiniteFloat | None = None
    hidden: Hidden | None = None
    end_of_workflow: bool | None = None


class ChatMessage(_Record):
    role: NonEmpty
    content: str


class ChatCall(_Record):
    workflow_id: NonEmpty
    agent: NonEmpty
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    completion: str
    step: Step | None = None
    timestamp: FiniteFloat | None = None
    workload: str | None = None
    task: str | None = None
    prompt_tokens: Tokens | None = None
    completion_tokens: Tokens | None = None
    hidden: Hidden | None = None
    end_of_workflow: bool | None = None


# --------------------------------------------------------------------------- line parsing


def _field_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _issues_from(err: ValidationError, file: str, line: int) -> list[Issue]:
    issues = []
    for e in err.errors():
        reason = e["msg"]
        if e["type"] == "json_invalid":
            reason = f"malformed JSON ({e['ctx']['error']})"
        elif e["type"] == "missing":
            reason = "required field is missing"
        issues.append(Issue(file, line, _field_path(e["loc"]), reason))
    return issues


def read_source(path: str | os.PathLike) -> bytes:
    """A trace file's bytes. Only a regular file is read: a FIFO with no writer would block
    forever, a device never ends, a socket is not a file (opened without blocking, then checked);
    an unreadable file or a symlink loop is one issue naming the path."""
    file = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise TraceValidationError([Issue(file, None, "", f"cannot read: {e.strerror}")]) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                    "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a regular file")
            raise TraceValidationError([Issue(file, None, "", f"is {kind}, not a regular file; give a trace file")])
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as e:
        raise TraceValidationError([Issue(file, None, "", f"cannot read: {e.strerror}")]) from None
    finally:
        os.close(fd)


def parse_lines(path: str | os.PathLike, model: type[_Record], issues: list[Issue]):
    """Yield (line number, record) for each valid non-blank line; append issues for the rest."""
    file = str(path)
    raw = read_source(path)
    for number, chunk in enumerate(raw.split(b"\n"), start=1):
        if not chunk.strip():
            continue
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            issues.append(Issue(file, number, "", f"invalid UTF-8 (byte {e.start} of the line)"))
            continue
        try:
            yield number, model.model_validate_json(text)
        except ValidationError as e:
            issues.extend(_issues_from(e, file, number))


def _finish(issues: list[Issue], skip_bad_lines: bool) -> list[Issue]:
    if issues and not skip_bad_lines:
        raise TraceValidationError(issues)
    return issues


class HiddenSize:
    """The one size of a trace's hidden vectors: declared (`hidden_size`), else the first one's.
    Checked line by line; `meta()` is what meta.json records (model and size), {} without vectors."""

    def __init__(self, model: str | None = None, size: int | None = None):
        self.model, self.size, self.declared = model, size, size is not None
        self.first_line: int | None = None

    def problem(self, hidden: list | None, line: int) -> tuple[str, str] | None:
        if not hidden:
            return None
        if self.size is None:
            self.size, self.first_line = len(hidden), line
        if len(hidden) != self.size:
            given = "hidden_size" if self.declared else f"the first vector, line {self.first_line}"
            return "hidden", f"has {len(hidden)} values; the trace's hidden size is {self.size} ({given})"
        if self.first_line is None:
            self.first_line = line
        return None

    def meta(self) -> dict:
        if self.first_line is None:
            return {}
        return {"hidden": {"model": self.model or "", "size": self.size}}


def _group(records: Iterable[tuple[int, _Record]]) -> dict[str, list[tuple[int, _Record]]]:
    groups: dict[str, list] = defaultdict(list)
    for number, rec in records:
        groups[rec.workflow_id].append((number, rec))
    return groups


# --------------------------------------------------------------------------- native format


def read_native(path: str | os.PathLike, skip_bad_lines: bool = False, model: str | None = None,
                size: int | None = None) -> Traces:
    """`model`, `size`: the serving model of the calls' hidden vectors and their size (HiddenSize)."""
    file = str(path)
    issues: list[Issue] = []
    hidden = HiddenSize(model, size)
    groups = _group(_checked_hidden(parse_lines(path, NativeCall, issues), hidden, file, issues))
    segments = SegmentTable()
    calls = []
    for wid, lines in groups.items():
        accepted: list[NativeCall] = []
        last_line = None
        for number, rec in lines:
            problem = _native_line_problem(rec, accepted, last_line, segments)
            if problem:
                issues.append(Issue(file, number, *problem))
                continue
            accepted.append(rec)
            last_line = number
        calls.extend(_native_rows(accepted))
    skipped = _finish(issues, skip_bad_lines)
    return Traces(calls, segments, {"format": "native", "src": file, "tokenizer": "source counts", **hidden.meta()},
                  skipped)


def _checked_hidden(records, hidden: HiddenSize, file: str, issues: list[Issue]):
    """The records whose hidden vector has the trace's size; an issue for each other one."""
    for number, rec in records:
        problem = hidden.problem(rec.hidden, number)
        if problem:
            issues.append(Issue(file, number, *problem))
        else:
            yield number, rec


def _native_line_problem(rec, accepted, last_line, segments) -> tuple[str, str] | None:
    if accepted and accepted[-1].end_of_workflow:
        return "workflow_id", f"workflow '{rec.workflow_id}' already ended (end_of_workflow at line {last_line})"
    if accepted and rec.step <= accepted[-1].step:
        return "step", (f"step {rec.step} does not increase within workflow '{rec.workflow_id}' "
                        f"(line {last_line} has step {accepted[-1].step})")
    probe = SegmentTable(segments)  # check all segments before recording any of this line's
    for i, seg in enumerate(rec.prompt):
        reason = probe.add(seg.id, seg.tokens, seg.kind or "", seg.text or "")
        if reason:
            return f"prompt[{i}].tokens", reason
    if rec.output_id:
        reason = probe.add(rec.output_id, rec.output_tokens, "output", rec.output_text or "")
        if reason:
            return "output_tokens", reason
    segments.update(probe)
    return None


def _native_rows(recs: list[NativeCall]) -> list[dict]:
    rows = []
    for i, rec in enumerate(recs):
        rows.append(call_record(
            workflow_id=rec.workflow_id, step=rec.step, agent=rec.agent,
            workload=rec.workload or "", task=rec.task or "",
            prompt_ids=[s.id for s in rec.prompt],
            prompt_segment_tokens=[s.tokens for s in rec.prompt],
            output_tokens=rec.output_tokens, output_id=rec.output_id or "",
            output_text=rec.output_text or "", tool_time=rec.tool_time or 0.0,
            start_time=rec.start_time, end_time=rec.end_time, hidden=rec.hidden or [],
            end_of_workflow=i == len(recs) - 1,
        ))
    return rows


# --------------------------------------------------------------------------- chat format


def message_segment_id(role: str, content: str) -> str:
    digest = hashlib.blake2b(f"{role}\0{content}".encode(), digest_size=8).hexdigest()
    return f"msg:{digest}"


def read_chat(path: str | os.PathLike, counter: TokenCounter, skip_bad_lines: bool = False,
              model: str | None = None, size: int | None = None) -> Traces:
    issues: list[Issue] = []
    hidden = HiddenSize(model, size)
    records = list(_checked_hidden(parse_lines(path, ChatCall, issues), hidden, str(path), issues))
    traces = chat_to_traces(str(path), records, counter, issues, skip_bad_lines)
    traces.meta.update({"format": "chat", "src": str(path), **hidden.meta()})
    return traces


def chat_to_traces(file: str, records: list[tuple[int | None, ChatCall]], counter: TokenCounter,
                   issues: list[Issue], skip_bad_lines: bool) -> Traces:
    """Order each workflow's chat calls, check them, and turn messages into counted segments."""
    ordered = []
    for wid, lines in _group(records).items():
        ordered.append(_order_chat_workflow(file, lines, issues))
    skipped = _finish(issues, skip_bad_lines)

    texts = {}
    for workflow in ordered:
        for _, rec in workflow:
            for m in rec.messages:
                texts.setdefault(message_segment_id(m.role, m.content), (m.role, m.content))
            texts.setdefault(message_segment_id("assistant", rec.completion), ("assistant", rec.completion))
    ids = list(texts)
    counts = counter.count_many([texts[i][1] for i in ids])
    segments = SegmentTable()
    for seg_id, n in zip(ids, counts):
        role, content = texts[seg_id]
        segments.add(seg_id, n + MESSAGE_TEMPLATE_TOKENS, role, content)

    calls = []
    for workflow in ordered:
        for step, (_, rec) in enumerate(workflow):
            calls.append(_chat_row(rec, step, segments, last=step == len(workflow) - 1))
    meta = {"tokenizer": counter.name, "message_template_tokens": MESSAGE_TEMPLATE_TOKENS}
    return Traces(calls, segments, meta, skipped)


def _order_chat_workflow(file, lines, issues) -> list[tuple[int | None, ChatCall]]:
    recs = [rec for _, rec in lines]
    with_step = [r.step is not None for r in recs]
    if any(with_step) and not all(with_step):  # file order and given steps could disagree: refuse
        number = next(n for (n, _), given in zip(lines, with_step) if given != with_step[0])
        issues.append(Issue(file, number, "step", f"workflow '{recs[0].workflow_id}' gives a step on some lines "
                                                  "and not on others; give it on every line or on none"))
        return []
    if all(with_step):
        lines = sorted(lines, key=lambda item: item[1].step)
    elif all(r.timestamp is not None for r in recs):
        lines = sorted(lines, key=lambda item: item[1].timestamp)
    kept = []
    for number, rec in lines:
        if kept and rec.step is not None and rec.step == kept[-1][1].step:
            issues.append(Issue(file, number, "step", f"step {rec.step} repeats line {kept[-1][0]} "
                                                      f"of workflow '{rec.workflow_id}'"))
        elif kept and kept[-1][1].end_of_workflow:
            issues.append(Issue(file, number, "workflow_id", f"workflow '{rec.workflow_id}' already "
                                                             f"ended (end_of_workflow at line {kept[-1][0]})"))
        else:
            kept.append((number, rec))
    return kept


def _chat_row(rec: ChatCall, rank: int, segments: SegmentTable, last: bool) -> dict:
    prompt_ids = [message_segment_id(m.role, m.content) for m in rec.messages]
    output_id = message_segment_id("assistant", rec.completion)
    task = rec.task if rec.task is not None else next(
        (m.content for m in rec.messages if m.role == "user"), "")
    return call_record(
        workflow_id=rec.workflow_id, step=rec.step if rec.step is not None else rank,
        agent=rec.agent, workload=rec.workload or "", task=task,
        prompt_ids=prompt_ids, prompt_segment_tokens=[segments[i]["tokens"] for i in prompt_ids],
        source_prompt_tokens=rec.prompt_tokens, source_completion_tokens=rec.completion_tokens,
        output_tokens=segments[output_id]["tokens"], output_id=output_id,
        output_text=rec.completion, start_time=rec.timestamp, hidden=rec.hidden or [],
        end_of_workflow=last,
    )


# --------------------------------------------------------------------------- writers


def write_jsonl_atomic(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Write JSON Lines all at once (data.atomic)."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def _optional(out: dict, **fields) -> dict:
    out.update({k: v for k, v in fields.items() if v not in (None, "", [])})
    return out


def native_records(calls: Iterable[dict], segments: dict) -> Iterable[dict]:
    for c in calls:
        prompt = []
        for seg_id, n in zip(c["prompt_ids"], c["prompt_segment_tokens"]):
            seg = segments.get(seg_id, {})
            prompt.append(_optional({"id": seg_id, "tokens": n}, text=seg.get("text"), kind=seg.get("kind")))
        yield _optional(
            {"workflow_id": c["workflow_id"], "step": c["step"], "agent": c["agent"],
             "prompt": prompt, "output_tokens": c["output_tokens"]},
            output_id=c["output_id"], output_text=c["output_text"], workload=c["workload"],
            task=c["task"], tool_time=c["tool_time"] or None, start_time=c["start_time"],
            end_time=c["end_time"], hidden=c["hidden"],
        )


def chat_records(calls: Iterable[dict], segments: dict) -> Iterable[dict]:
    for c in calls:
        messages = [{"role": segments[i]["kind"], "content": segments[i]["text"]} for i in c["prompt_ids"]]
        yield _optional(
            {"workflow_id": c["workflow_id"], "agent": c["agent"], "messages": messages,
             "completion": c["output_text"], "step": c["step"]},
            timestamp=c["start_time"], workload=c["workload"], task=c["task"],
            prompt_tokens=c["source_prompt_tokens"], completion_tokens=c["source_completion_tokens"],
            hidden=c["hidden"],
        )
