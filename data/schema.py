"""The stored trace schema: one row per agent call, plus one table of prompt segments.

This is the stable, documented schema every later stage reads (README, "Trace dataset").
A prompt is a list of segment ids; a segment is a run of tokens with a stable id, so two
prompts share a KV prefix exactly as far as their segment-id lists agree from the start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import Features, List, Value

SCHEMA_VERSION = 1

CALL_FEATURES = Features(
    {
        "workflow_id": Value("string"),
        "step": Value("int64"),
        "agent": Value("string"),
        "workload": Value("string"),
        "task": Value("string"),
        # generator latent as JSON (e.g. {"hops": 3}); "" for imported traces
        "latent": Value("string"),
        "prompt_ids": List(Value("string")),
        "prompt_segment_tokens": List(Value("int64")),
        # sum of prompt_segment_tokens: our own count
        "prompt_tokens": Value("int64"),
        # counts the source reported (chat format), kept beside ours; null when absent
        "source_prompt_tokens": Value("int64"),
        "output_tokens": Value("int64"),
        "source_completion_tokens": Value("int64"),
        # segment id under which this call's output appears in later prompts ("" if none)
        "output_id": Value("string"),
        "output_text": Value("string"),
        # seconds between the previous call's end and this call's start (tool or user time)
        "tool_time": Value("float64"),
        "start_time": Value("float64"),
        "end_time": Value("float64"),
        # serving model's hidden state of the last prefill token; [] when absent
        "hidden": List(Value("float32")),
        "end_of_workflow": Value("bool"),
    }
)

SEGMENT_FEATURES = Features(
    {
        "id": Value("string"),
        "tokens": Value("int64"),
        # system | task | output | tool | turn (a hand-over, transcript memory) | a chat role
        # (system/user/assistant/tool) | ""
        "kind": Value("string"),
        "text": Value("string"),
    }
)

SPLITS = ("train", "val", "test")


def call_record(**fields) -> dict:
    """A call row with every column present, defaults filled in."""
    row = {
        "workload": "",
        "task": "",
        "latent": "",
        "source_prompt_tokens": None,
        "source_completion_tokens": None,
        "output_id": "",
        "output_text": "",
        "tool_time": 0.0,
        "start_time": None,
        "end_time": None,
        "hidden": [],
        "end_of_workflow": False,
    }
    row.update(fields)
    row["prompt_tokens"] = sum(row["prompt_segment_tokens"])
    missing = set(CALL_FEATURES) - set(row)
    if missing:
        raise KeyError(f"call record lacks {sorted(missing)}")
    return row


class SegmentTable(dict):
    """Segment id -> {"id", "tokens", "kind", "text"}; one token count per id."""

    def add(self, seg_id: str, tokens: int, kind: str = "", text: str = "") -> str | None:
        """Record a segment; return a reason string if it contradicts an earlier one."""
        known = self.get(seg_id)
        if known is None:
            self[seg_id] = {"id": seg_id, "tokens": tokens, "kind": kind, "text": text}
            return None
        if known["tokens"] != tokens:
            return f"segment '{seg_id}' has {tokens} tokens here but {known['tokens']} earlier"
        if text and not known["text"]:
            known["text"] = text
        if kind and not known["kind"]:
            known["kind"] = kind
        return None


@dataclass
class Traces:
    """Validated calls in memory, before they are split and stored."""

    calls: list[dict]  # rows of CALL_FEATURES, grouped by workflow, in step order
    segments: SegmentTable
    meta: dict
    skipped: list = field(default_factory=list)  # Issues of lines skipped on request

    @property
    def n_workflows(self) -> int:
        return len({c["workflow_id"] for c in self.calls})
