"""IntentKV in the simulator: prune every request of a workflow to a KV budget, in one of two
layouts, and replay the result through the same simulator (docs/intentkv.md; arXiv 2606.09916).

The pruning unit is a chunk of `chunk_tokens` tokens of a prompt segment. For each call the
method scores the chunks, keeps the protected ones (the system prefix: the first segment; the
latest span: the last segment) and the best others up to the budget. The simulator has no model,
so keys and queries are deterministic pseudo-embeddings of the chunk ids (the same scoring code
as on a real model's KV, models/intentkv/pruning.py, on stand-in vectors). What this measures does not
depend on which chunks a method keeps, only on how the kept set changes from call to call.

How each layout reaches the prefix cache:
- compaction: the KV holds the kept chunks only, renumbered; the cache key is the sequence of
  kept chunks, so a later call reuses cache only as far as its kept sequence agrees with an
  earlier one from the start. Dropping one more old chunk breaks every prefix after it.
- sentinel: every position keeps its slot and a dropped one points at the sentinel (no KV); the
  cache key is the full token sequence, so a later call matches everything an earlier one saw,
  whatever it keeps. Dropping a cached chunk later only remaps its slot; a chunk dropped when it
  was computed has no KV, so it stays dropped for the rest of the workflow.

Each pruned call becomes a `SimCall` whose units carry the tokens the call keeps (a dropped
chunk carries 0), so the simulator's hit counts, memory and prefill cost are those of the
pruned request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch

from models.intentkv import pruning as intentkv
from serving_integration.cache.workload import SimCall, SimWorkflow, prefix_keys

LAYOUTS = intentkv.LAYOUTS
PSEUDO_HEADS, PSEUDO_DIM = 4, 16


@dataclass(frozen=True)
class Chunk:
    id: str
    tokens: int


def chunks_of(call: SimCall, chunk_tokens: int, outputs: set[str]) -> list[list[Chunk]]:
    """The call's prompt segments cut into chunks, segment by segment, and its output as one
    chunk (earlier calls' outputs stay one chunk in later prompts too, so they match)."""
    segments = list(zip(call.units, call.lens)) + [(call.output_unit, call.output_tokens)]
    return [[Chunk(f"{unit}#0", n)] if unit in outputs else
            [Chunk(f"{unit}#{i}", min(chunk_tokens, n - start)) for i, start in enumerate(range(0, n, chunk_tokens))]
            for unit, n in segments]


def pseudo_vector(chunk_id: str, salt: str) -> torch.Tensor:
    """A fixed [1, H, D] vector per chunk id (stable across runs and processes)."""
    seed = int.from_bytes(hashlib.blake2b(f"{salt}:{chunk_id}".encode(), digest_size=8).digest(), "little")
    return torch.randn(1, PSEUDO_HEADS, PSEUDO_DIM, generator=torch.Generator().manual_seed(seed % 2**63))


class WorkflowPruner:
    """Keeps one workflow's state across its calls: intent memory and the dropped chunks."""

    def __init__(self, method: str, budget: int, layout: str, lam: float):
        if method not in intentkv.METHODS:
            raise ValueError(f"kv.method must be one of {', '.join(intentkv.METHODS)}; got '{method}'")
        if layout not in LAYOUTS:
            raise ValueError(f"kv.layouts entries must be in {', '.join(LAYOUTS)}; got '{layout}'")
        self.method, self.budget, self.layout, self.lam = method, budget, layout, lam
        self.memory = None
        self.dropped: set[str] = set()
        self._keys: dict[str, torch.Tensor] = {}

    def key(self, chunk_id: str) -> torch.Tensor:
        if chunk_id not in self._keys:
            self._keys[chunk_id] = pseudo_vector(chunk_id, "key")
        return self._keys[chunk_id]

    def keep_mask(self, prompt: list[list[Chunk]]) -> list[bool]:
        flat = [c for segment in prompt for c in segment]
        protected = torch.zeros(len(flat), dtype=torch.bool)
        protected[: len(prompt[0])] = True  # system prefix
        protected[len(flat) - len(prompt[-1]):] = True  # latest span
        span_queries = torch.stack([pseudo_vector(c.id, "query") for c in prompt[-1]], dim=2)  # [1, H, S, D]
        keys = torch.stack([self.key(c.id) for c in flat], dim=2)  # [1, H, T, D]
        self.memory = intentkv.update_memory(self.memory, intentkv.encode_span(span_queries), self.lam)
        scores = self.scores(keys, span_queries)
        sizes = torch.tensor([c.tokens for c in flat], dtype=torch.float64)
        if self.layout == "sentinel":  # what has no KV left cannot be kept again
            gone = torch.tensor([c.id in self.dropped for c in flat])
            scores = scores.masked_fill(gone, float("-inf"))
            protected &= ~gone
        keep = keep_within_tokens(scores, sizes, self.budget, protected)
        if self.layout == "sentinel":
            self.dropped.update(c.id for c, k in zip(flat, keep.tolist()) if not k)
        return keep.tolist()

    def scores(self, keys: torch.Tensor, span_queries: torch.Tensor) -> torch.Tensor:
        # the latest span is the prompt's last segment, so its queries sit at the last positions
        return intentkv.scores_for(self.method, keys, memory=self.memory, span_queries=span_queries,
                                   queries=span_queries)


def keep_within_tokens(scores: torch.Tensor, sizes: torch.Tensor, budget: int, protected: torch.Tensor) -> torch.Tensor:
    """select_keep with a budget in tokens over chunks of different sizes: the largest chunk count
    whose selection fits (selections grow with the count, so a binary search finds it)."""
    if sizes.sum() <= budget:
        return torch.ones_like(protected)
    lo, hi = int(protected.sum()), len(scores)  # lo always fits: protected chunks are kept anyway
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sizes[intentkv.select_keep(scores, mid, protected)].sum() <= budget:
            lo = mid
        else:
            hi = mid - 1
    return intentkv.select_keep(scores, lo, protected)


def prune_workflows(workflows: list[SimWorkflow], method: str, budget: int, layout: str,
                    chunk_tokens: int = 64, lam: float = 0.5) -> list[SimWorkflow]:
    """Each call replaced by its pruned form in the given layout (see the module docstring)."""
    out = []
    for w in workflows:
        pruner = WorkflowPruner(method, budget, layout, lam)
        outputs = {c.output_unit for c in w.calls}
        calls = []
        for call in w.calls:
            *prompt, output = chunks_of(call, chunk_tokens, outputs)
            keep = pruner.keep_mask(prompt)
            flat = [c for segment in prompt for c in segment]
            if layout == "compaction":  # the key is the kept sequence
                kept = [c for c, k in zip(flat, keep) if k]
                units, lens = tuple(c.id for c in kept), tuple(c.tokens for c in kept)
            else:  # the key is the full sequence; dropped positions hold no KV
                units = tuple(c.id for c in flat)
                lens = tuple(c.tokens if k else 0 for c, k in zip(flat, keep))
            calls.append(replace(call, units=units, lens=lens, keys=prefix_keys(units), output_unit=output[0].id))
        out.append(SimWorkflow(w.id, w.order, w.task, calls))
    return out
