"""Importer for the Who&When multi-agent traces (data/traces/who_and_when, MIT licence).

Each JSON file (`N.json`, or `N.json.gz` as the repository ships it) is one workflow: `question`, `history: [{name?, role, content}]` and, in the
Algorithm-Generated (CaptainAgent / AG2 group chat) subset, a per-agent `system_prompt` dict.

How a run becomes calls:
- the speaker is `name` (AG2) or `role` with its parenthetical dropped (Magentic-One:
  "Orchestrator (-> WebSurfer)" -> "Orchestrator");
- tool and human turns (Computer_terminal, ComputerTerminal, human) are not agent calls, but
  they enter the context of every later call;
- consecutive entries of the same agent form one turn, and each agent turn is one call;
- a call's messages are the agent's system prompt (when the source has one) followed by every
  earlier turn (agents' turns as `assistant`, tool and human turns as `user`); the first call,
  with no earlier turn, sees the question; its completion is the turn's text.
The calls then go through the chat-format path, so token counts and prefix segments are the
chat format's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data.errors import Issue, TraceValidationError
from data.published import published_name, read_bytes
from data.formats import ChatCall, ChatMessage, _issues_from, chat_to_traces
from data.schema import Traces
from data.tokenizer import TokenCounter

SUBSETS = {"Algorithm-Generated": "who_and_when-ag2", "Hand-Crafted": "who_and_when-magentic"}
NON_AGENT_SPEAKERS = {"Computer_terminal", "ComputerTerminal", "human"}


class _Entry(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    content: str
    role: str = Field(min_length=1)
    name: str | None = None


class _Run(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    question: str
    history: list[_Entry] = Field(min_length=1)
    system_prompt: dict[str, str] | None = None


def speaker(entry: _Entry) -> str:
    return entry.name or re.sub(r"\s*\(.*\)\s*$", "", entry.role)


def _turns(run: _Run) -> list[tuple[str, str]]:
    turns: list[tuple[str, str]] = []
    for entry in run.history:
        who = speaker(entry)
        if turns and turns[-1][0] == who and who not in NON_AGENT_SPEAKERS:
            turns[-1] = (who, turns[-1][1] + "\n\n" + entry.content)
        else:
            turns.append((who, entry.content))
    return turns


def run_to_chat_calls(run: _Run, workflow_id: str, workload: str) -> list[ChatCall]:
    calls, context = [], []
    for who, text in _turns(run):
        if who in NON_AGENT_SPEAKERS:
            context.append(ChatMessage(role="user", content=text))
            continue
        system = (run.system_prompt or {}).get(who)
        messages = ([ChatMessage(role="system", content=system)] if system else [])
        messages += list(context) or [ChatMessage(role="user", content=run.question)]
        calls.append(ChatCall(workflow_id=workflow_id, agent=who, messages=messages, completion=text,
                              step=len(calls), workload=workload, task=run.question))
        context.append(ChatMessage(role="assistant", content=text))
    return calls


def _numeric_order(name: str):
    stem = name.removesuffix(".json")
    return (0, int(stem)) if stem.isdigit() else (1, stem)


def subset_files(folder: Path) -> list[Path]:
    """The run files of one subset folder in numeric order, `N.json` or its compressed copy
    `N.json.gz` (the published file when both are there); all or none: a folder that cannot be
    listed (no permission, a symlink loop, not a folder) fails the whole import naming it."""
    try:
        folder.resolve(strict=True)  # a symlink to itself: ELOOP (RuntimeError before Python 3.13)
        with os.scandir(folder) as entries:
            names = [e.name for e in entries if e.name.endswith((".json", ".json.gz"))]
    except (OSError, RuntimeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise TraceValidationError([Issue(str(folder), None, "", f"cannot read this subset: {reason}")]) from None
    files = {published_name(Path(n)): folder / n for n in sorted(names, key=lambda n: not n.endswith(".gz"))}
    return [files[name] for name in sorted(files, key=_numeric_order)]


def read_who_and_when(src: str | Path, counter: TokenCounter | None = None,
                      skip_bad_lines: bool = False) -> Traces:
    """Every run of every subset present, or an error: an unreadable subset or run file fails the
    import with its path (skip_bad_lines skips invalid runs, never unreadable ones)."""
    src = Path(src)
    subsets = [d for d in SUBSETS if os.path.lexists(src / d)]
    if not subsets:
        raise TraceValidationError([Issue(str(src), None, "", f"no {' or '.join(SUBSETS)} folder here")])
    issues: list[Issue] = []
    records: list[tuple[int | None, ChatCall]] = []
    for subset in subsets:
        for path in subset_files(src / subset):
            try:  # pydantic's parser bounds the nesting itself (json_invalid: recursion limit exceeded)
                run = _Run.model_validate_json(read_bytes(path))
            except ValidationError as e:
                issues.extend(_issues_from(e, str(path), None))
                continue
            calls = run_to_chat_calls(run, f"{SUBSETS[subset]}-{published_name(path).removesuffix('.json')}", SUBSETS[subset])
            if not calls:
                issues.append(Issue(str(path), None, "history", "no agent turn (only tool or human turns)"))
            records.extend((None, c) for c in calls)
    traces = chat_to_traces(str(src), records, counter or TokenCounter.wordpiece(), issues, skip_bad_lines)
    traces.meta.update({"format": "who_and_when", "src": str(src), "subsets": subsets})
    return traces
