"""Importer for tau-bench's published airline trajectories (data/traces/tau_bench, MIT licence).

tau-bench (Yao et al., 2024, "tau-bench: A Benchmark for Tool-Agent-User Interaction in
Real-World Domains") runs a tool-using service agent against an LLM-simulated user. The
published file is one JSON list of runs (read as published, or from its gzip copy `NAME.json.gz`); each run has `task_id`, `trial`, `info.task.instruction`
(the simulated user's hidden instruction) and `traj`, the agent's message list in OpenAI chat
format: one `system` message (the airline policy), then `user`, `assistant` (with `tool_calls`
when it calls a tool) and `tool` entries.

How a run becomes calls (in the order they were made):
- agent call, at each `assistant` entry i: the prompt is `traj[:i]` message by message, the
  completion is entry i (tool schemas were also sent but are not in the file);
- user-simulator call, at each `user` entry: the simulator's own prompt, rebuilt as tau-bench
  builds it: a system prompt made from the instruction (`user_simulator_system_prompt`), the
  opener "Hi! How can I help you today?" as a user message, then the conversation role-flipped:
  the simulator's earlier lines as `assistant`, the agent's text replies (assistant entries
  without tool calls) as `user`; the completion is the user entry's text.
An assistant entry's text is its content followed by one `<tool_call ...>` line per tool call
(`assistant_text`), the same in the completion and in every later prompt, so the output is a
reusable prefix segment; tool results are `tool` messages. The calls then go through the
chat-format path, so token counts and prefix segments are the chat format's.

Validation is all-or-nothing: every problem is listed as `FILE: run K: field 'PATH': reason`
(K the 0-based index of the run in the file's list) and nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data.errors import Issue, TraceValidationError
from data.formats import ChatCall, ChatMessage, _issues_from, chat_to_traces
from data.published import located, read_bytes
from data.schema import Traces
from data.tokenizer import TokenCounter

WORKLOAD = "tau_bench"
AGENT, USER_SIMULATOR = "agent", "user_simulator"
OPENER = "Hi! How can I help you today?"

# The simulator's six rules, one per line, as the README beside the published file lists them
# (tau-bench's `build_system_prompt`). The file came from an earlier tau-bench version whose rule
# text is not recorded; these lines follow the README's description in our own words, so the
# simulator's system prompt (and its token count) is approximate, while its shape (instruction
# inside the system prompt, one rule a line) is tau-bench's.
USER_SIMULATOR_RULES = (
    "Write only one line at a time, as the user's next message.",
    "Do not reveal the whole instruction at once; give only what the current step needs.",
    "Do not invent information the instruction does not give: if the agent asks for something "
    "the instruction does not mention, say that you do not remember it or do not have it.",
    "Once the goal of the instruction is met, reply with '###STOP###' alone, and nothing else, "
    "to end the conversation.",
    "Do not repeat the instruction word for word; say the same things in your own words.",
    "Keep the conversation natural and stay in the persona the instruction describes.",
)

NonEmpty = Annotated[str, Field(min_length=1)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Function(_Model):
    name: NonEmpty
    arguments: str


class _ToolCall(_Model):
    id: NonEmpty
    function: _Function


class _Entry(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class _Task(_Model):
    instruction: str


class _Info(_Model):
    task: _Task


class _Run(_Model):
    task_id: int
    trial: int
    info: _Info
    traj: Annotated[list[_Entry], Field(min_length=2)]


def user_simulator_system_prompt(instruction: str) -> str:
    rules = "".join(f"\n- {rule}" for rule in USER_SIMULATOR_RULES)
    return f"You are a user interacting with an agent.\n\nInstruction: {instruction}\n\nRules:{rules}"


def assistant_text(entry: _Entry) -> str:
    """An assistant entry as one message text: its content, then one line per tool call."""
    parts = [entry.content] if entry.content else []
    parts += [f'<tool_call id="{call.id}" name="{call.function.name}">{call.function.arguments}</tool_call>'
              for call in entry.tool_calls or []]
    return "\n".join(parts)


def _structure_problems(run: _Run) -> list[tuple[str, str]]:
    """(field path, reason) for each entry that breaks the shape the prompts are rebuilt from."""
    problems = []
    if run.traj[0].role != "system":
        problems.append(("traj[0].role", f"the first entry must be the agent's system message, not '{run.traj[0].role}'"))
    if run.traj[1].role != "user":
        problems.append(("traj[1].role", f"the second entry must be the simulated user's first line, not "
                                         f"'{run.traj[1].role}'"))
    open_calls: set[str] = set()
    for i, entry in enumerate(run.traj):
        where = f"traj[{i}]"
        if entry.role == "system" and i > 0:
            problems.append((f"{where}.role", "only traj[0] may be a system message"))
        if entry.role != "assistant":
            if entry.content is None:
                problems.append((f"{where}.content", f"a {entry.role} entry needs a string content"))
            if entry.tool_calls:
                problems.append((f"{where}.tool_calls", f"only assistant entries call tools, not {entry.role}"))
        if entry.role == "assistant":
            if entry.content is None and not entry.tool_calls:
                problems.append((where, "assistant entry has neither content nor tool_calls"))
            open_calls = {call.id for call in entry.tool_calls or []}
        elif entry.role == "tool":
            if entry.tool_call_id not in open_calls:
                problems.append((f"{where}.tool_call_id", f"'{entry.tool_call_id}' answers no tool call of the "
                                                          "assistant entry before it"))
            open_calls.discard(entry.tool_call_id)
        elif entry.role == "user" and i > 1:
            prev = run.traj[i - 1]
            if prev.role != "assistant" or prev.tool_calls:
                problems.append((f"{where}.role", f"a user line must answer the agent's text reply, but traj[{i - 1}] "
                                                  f"is a {prev.role} entry" + (" with tool_calls" if prev.tool_calls else "")))
    return problems


def workflow_id(run: _Run) -> str:
    return f"{WORKLOAD}-{run.task_id}-{run.trial}"


def run_to_chat_calls(run: _Run) -> list[ChatCall]:
    wid, instruction = workflow_id(run), run.info.task.instruction
    transcript: list[ChatMessage] = []  # the agent's messages so far (traj[:i])
    simulator = [ChatMessage(role="system", content=user_simulator_system_prompt(instruction)),
                 ChatMessage(role="user", content=OPENER)]  # the simulator's messages so far
    calls: list[ChatCall] = []

    def call(agent: str, messages: list[ChatMessage], completion: str) -> None:
        calls.append(ChatCall(workflow_id=wid, agent=agent, messages=list(messages), completion=completion,
                              step=len(calls), workload=WORKLOAD, task=instruction))

    for entry in run.traj:
        if entry.role == "assistant":
            text = assistant_text(entry)
            call(AGENT, transcript, text)
            if not entry.tool_calls:  # a reply to the user: the simulator's next input
                simulator.append(ChatMessage(role="user", content=text))
        elif entry.role == "user":
            call(USER_SIMULATOR, simulator, entry.content)
            simulator.append(ChatMessage(role="assistant", content=entry.content))
            text = entry.content
        else:
            text = entry.content
        transcript.append(ChatMessage(role=entry.role, content=text))
    return calls


def _load_list(src: Path) -> list:
    file = str(located(src))
    raw = read_bytes(src)  # regular files only (data.formats.read_source), decompressed when .gz
    try:
        runs = json.loads(raw)
    except RecursionError:
        raise TraceValidationError([Issue(file, None, "", "JSON nested deeper than Python's recursion "
                                                         "limit; not a trajectories file")]) from None
    except UnicodeDecodeError as e:
        raise TraceValidationError([Issue(file, None, "", f"invalid UTF-8 (byte {e.start})")]) from e
    except json.JSONDecodeError as e:
        raise TraceValidationError([Issue(file, e.lineno, "", f"malformed JSON ({e.msg}, column {e.colno})")]) from e
    if not isinstance(runs, list) or not runs:
        raise TraceValidationError([Issue(file, None, "", "expected a non-empty JSON list of runs")])
    return runs


def validated_runs(src: str | Path) -> tuple[list[_Run], list[Issue]]:
    """Every run of the file that passes validation, and an issue for each problem of the others."""
    src = Path(src)
    issues: list[Issue] = []
    runs: list[_Run] = []
    seen: dict[str, int] = {}
    for k, obj in enumerate(_load_list(src)):
        where = f"{src}: run {k}"
        try:
            run = _Run.model_validate(obj)
        except ValidationError as e:
            issues.extend(_issues_from(e, where, None))
            continue
        problems = _structure_problems(run)
        wid = workflow_id(run)
        if wid in seen:
            problems.append(("trial", f"task_id {run.task_id} trial {run.trial} repeats run {seen[wid]}"))
        if problems:
            issues.extend(Issue(where, None, field, reason) for field, reason in problems)
            continue
        seen[wid] = k
        runs.append(run)
    return runs, issues


def load_runs(src: str | Path) -> list[_Run]:
    """The file's runs, all valid, or TraceValidationError listing every problem (IntentKV's sessions,
    models/intentkv/tau_bench.py, read them this way)."""
    runs, issues = validated_runs(src)
    if issues:
        raise TraceValidationError(issues)
    return runs


def read_tau_bench(src: str | Path, counter: TokenCounter | None = None, skip_bad_lines: bool = False) -> Traces:
    """Read the published trajectories file; `skip_bad_lines` drops invalid runs (listed in `skipped`)."""
    runs, issues = validated_runs(src)
    records: list[tuple[int | None, ChatCall]] = [(None, c) for run in runs for c in run_to_chat_calls(run)]
    traces = chat_to_traces(str(src), records, counter or TokenCounter.wordpiece(), issues, skip_bad_lines)
    traces.meta.update({"format": "tau_bench", "src": str(src)})
    return traces
