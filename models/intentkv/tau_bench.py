"""tau-bench's published airline trajectories as IntentKV sessions (docs/intentkv.md).

Each run of ``data/traces/tau_bench/gpt-4o-airline.json`` (read and validated by
:func:`data.tau_bench.load_runs`) becomes one :class:`~models.intentkv.sessions.Session`: the
agent's context in the order the serving model saw it, one message per entry of ``traj``:

* ``system: <the airline policy>`` (the system prefix, protected);
* ``user: <line>`` for each simulated-user line;
* ``assistant: <text>`` for a text reply (no tool call: not a decision point);
* ``assistant: <tool_call id=".." name="..">{JSON arguments}</tool_call>`` for each tool call, written
  as :func:`data.tau_bench.assistant_text` writes it (an entry with several calls gives one message
  per call, the first carrying the entry's text), with the parsed JSON arguments as ``args``;
* ``tool: <result>`` for each tool result.

:func:`models.intentkv.sessions.tokenize_session` then puts a decision point before every tool
call whose previous message is a user line or a tool result, protects the system prefix and that
latest span, and labels a history token positive when its word is a word of an argument *value*
(nested values flattened: a passenger list's names and dates count, its keys do not) of that call
or the next ``horizon - 1`` calls.

The split is by task (:func:`split_runs`): the trials of one task share the instruction, the
user and their reservations, so splitting the trials of a task would put near-copies of a test
trajectory into training.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data.tau_bench import _Entry, _Run, assistant_text, load_runs, workflow_id
from models.intentkv.sessions import Message, Session

SPLITS = ("train", "val", "test")


def entry_messages(entry: _Entry) -> list[Message]:
    """The messages one ``traj`` entry adds to the context."""
    if entry.role != "assistant" or not entry.tool_calls:
        return [Message(entry.role, f"{entry.role}: {entry.content or ''}")]
    out = []
    for i, call in enumerate(entry.tool_calls):
        single = _Entry(role="assistant", content=entry.content if i == 0 else None, tool_calls=[call])
        out.append(Message("assistant", f"assistant: {assistant_text(single)}", call.function.name,
                           _arguments(call.function.arguments)))
    return out


def _arguments(text: str) -> dict:
    """A call's JSON arguments; a call whose arguments do not parse keeps them as one string value
    (its words still count as literal argument text)."""
    try:
        args = json.loads(text)
    except json.JSONDecodeError:
        return {"arguments": text}
    return args if isinstance(args, dict) else {"arguments": args}


def run_session(run: _Run) -> Session:
    """One trajectory as a session (its id: ``tau_bench-TASK-TRIAL``)."""
    return Session(workflow_id(run), [m for entry in run.traj for m in entry_messages(entry)])


def tau_bench_sessions(src: str | Path, trials: list[int] | None = None) -> list[tuple[int, Session]]:
    """``(task_id, session)`` of every run of the file (only ``trials`` when given), in file order."""
    return [(run.task_id, run_session(run)) for run in load_runs(src)
            if trials is None or run.trial in trials]


def split_runs(task_ids: list[int], val: float, test: float, seed: int) -> list[str]:
    """The split (train / val / test) of each run: whole tasks, in a seeded order, ``round(test *
    n_tasks)`` of them held out for test (at least one), ``round(val * n_tasks)`` for validation."""
    tasks = sorted(set(task_ids))
    order = np.random.default_rng(seed).permutation(len(tasks))
    n_test = max(1, round(test * len(tasks)))
    n_val = round(val * len(tasks))
    if n_test + n_val >= len(tasks):
        raise ValueError(f"{len(tasks)} tasks cannot fill train, val ({val}) and test ({test})")
    split_of = {}
    for rank, i in enumerate(order):
        split_of[tasks[i]] = "test" if rank < n_test else "val" if rank < n_test + n_val else "train"
    return [split_of[t] for t in task_ids]
