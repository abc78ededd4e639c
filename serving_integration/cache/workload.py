"""The workload as the cache sees it, shared by the simulator and the SGLang plugin.

A call's prompt is a list of units (segment ids) with token counts; two prompts share a KV prefix
exactly as far as their units agree from the start. `prefix_keys` gives each prefix an identity
(its position in a radix tree), so the tree, the simulator and KV pruning name prefixes the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

ROOT_KEY = 0


def chain(key: int, unit: Hashable) -> int:
    """Identity of a prefix extended by one unit (the prefix's position in the tree)."""
    return hash((key, unit))


def first_and_last_key(units: Sequence, start: int = ROOT_KEY) -> tuple[int, int]:
    """`prefix_keys(units, start)[0]` and `[-1]` without building the tuple (`chain` inlined: the
    tree computes these for every node it creates, over every token in token-level trees)."""
    first = key = hash((start, units[0]))
    for unit in units[1:]:
        key = hash((key, unit))
    return first, key


def prefix_keys(units: Sequence, start: int = ROOT_KEY) -> tuple[int, ...]:
    """The identity of every prefix of `units` (after each unit), continuing from `start`."""
    keys, key = [], start
    for unit in units:
        key = chain(key, unit)
        keys.append(key)
    return tuple(keys)


def prefix_tokens_in(keys: Sequence, sizes: Sequence[int], present) -> int:
    """Tokens of the longest prefix of `keys` (prefix identities, in order) whose every key is in
    `present` (a set or dict): what a cache holding those keys would hit of the prompt."""
    tokens = 0
    for key, size in zip(keys, sizes):
        if key not in present:
            break
        tokens += size
    return tokens


@dataclass(frozen=True)
class SimCall:
    agent: str
    units: tuple  # prompt segment ids
    lens: tuple  # their token counts
    keys: tuple  # prefix identity after each unit (radix.chain), to find the tree node there
    output_unit: str
    output_tokens: int
    tool_time: float
    hidden: list | None

    @property
    def prompt_tokens(self) -> int:
        return sum(self.lens)


@dataclass(eq=False)
class SimWorkflow:
    id: str
    order: int
    task: str
    calls: list[SimCall]
    next_call: int = 0
    start_time: float = math.nan

    @property
    def agents(self) -> list[str]:
        """Agents called so far (the prefix a predictor sees)."""
        return [c.agent for c in self.calls[: self.next_call]]

    @property
    def future_agents(self) -> list[str]:
        return [c.agent for c in self.calls[self.next_call:]]

    @property
    def future_gaps(self) -> list[float]:
        """The tool time before each remaining call (only the perfect predictor reads these)."""
        return [c.tool_time for c in self.calls[self.next_call:]]

    @property
    def hidden(self) -> list | None:
        return self.calls[self.next_call - 1].hidden if self.next_call else None


def workflows_from_rows(rows: list[dict]) -> list[SimWorkflow]:
    """Dataset call rows (grouped by workflow, in step order) to replayable workflows."""
    workflows: dict[str, SimWorkflow] = {}
    for row in rows:
        wf = workflows.get(row["workflow_id"])
        if wf is None:
            wf = workflows[row["workflow_id"]] = SimWorkflow(row["workflow_id"], len(workflows), row["task"], [])
        units = tuple(row["prompt_ids"])
        wf.calls.append(SimCall(
            agent=row["agent"], units=units, lens=tuple(row["prompt_segment_tokens"]), keys=prefix_keys(units),
            output_unit=row["output_id"] or f"{row['workflow_id']}/output/{row['step']}",
            output_tokens=row["output_tokens"], tool_time=row["tool_time"] if wf.calls else 0.0,
            hidden=row["hidden"] or None))
    return list(workflows.values())


