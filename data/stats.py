"""Workload statistics: calls per workflow, loops, tokens per call, the share of prompt tokens that
a perfect (unbounded) prefix cache could reuse, and the largest prompt of a workflow (what one live
workflow holds at its peak: the live working set's unit)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def reusable_prompt_tokens(calls: list[dict]) -> int:
    """Prompt tokens whose prefix was seen before, with an unbounded cache.

    Prefixes are matched at segment boundaries, as the radix tree matches them. Each
    finished call inserts prompt + output (as SGLang does). With no eviction the total is
    the same for any interleaving of workflows that keeps each workflow's calls in order,
    so calls are taken workflow by workflow.
    """
    node_of: dict[tuple[int, str], int] = {}  # (parent node, segment id) -> node

    def child(parent: int, seg: str, create: bool) -> int | None:
        node = node_of.get((parent, seg))
        if node is None and create:
            node = node_of[(parent, seg)] = len(node_of) + 1
        return node

    reused = 0
    for c in calls:
        node, hit = 0, True
        for seg, n in zip(c["prompt_ids"], c["prompt_segment_tokens"]):
            nxt = child(node, seg, create=False) if hit else None
            if nxt is None:
                hit = False
                nxt = child(node, seg, create=True)
            else:
                reused += n
            node = nxt
        if c["output_id"]:
            child(node, c["output_id"], create=True)
    return reused


def summary(values) -> dict:
    a = np.asarray(values, dtype=float)
    return {"mean": round(float(a.mean()), 2), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def largest_prompt_per_workflow(calls) -> list[int]:
    """Each workflow's largest prompt in tokens: a workflow's prompts share its earlier prefixes, so
    its largest prompt is about what the cache must hold for it at its peak."""
    largest: dict[str, int] = {}
    for c in calls:
        largest[c["workflow_id"]] = max(largest.get(c["workflow_id"], 0), int(c["prompt_tokens"]))
    return list(largest.values())


def live_working_set_tokens(stats: dict, concurrency: int) -> float:
    """The live working set of a dataset at `concurrency` live workflows: concurrency x the mean
    largest prompt of a workflow (`stats`: trace_stats of the dataset, meta.json's `stats`). GPU
    sizes are given as a fraction of it (sim.gpu_working_set_fraction) and shown as a share of it."""
    return float(concurrency * stats["largest_prompt_tokens_per_workflow"]["mean"])


def trace_stats(calls: list[dict]) -> dict:
    per_workflow: dict[str, list[dict]] = defaultdict(list)
    for c in calls:
        per_workflow[c["workflow_id"]].append(c)
    prompt_tokens = [c["prompt_tokens"] for c in calls]
    total = int(sum(prompt_tokens))
    reusable = reusable_prompt_tokens(calls)
    return {
        "workflows": len(per_workflow),
        "calls": len(calls),
        "agents": len({c["agent"] for c in calls}),
        "calls_per_workflow": summary([len(w) for w in per_workflow.values()]),
        # a loop is a call to an agent the workflow has called before
        "loops_per_workflow": summary([len(w) - len({c["agent"] for c in w}) for w in per_workflow.values()]),
        "prompt_tokens_per_call": summary(prompt_tokens),
        "largest_prompt_tokens_per_workflow": summary(largest_prompt_per_workflow(calls)),
        "output_tokens_per_call": summary([c["output_tokens"] for c in calls]),
        "tool_time_s": summary([c["tool_time"] for c in calls]),
        "prompt_tokens": total,
        "reusable_prompt_tokens": reusable,
        "reusable_share": round(reusable / total, 4) if total else 0.0,
    }


def format_stats(name: str, s: dict) -> str:
    cpw, loops, ptok = s["calls_per_workflow"], s["loops_per_workflow"], s["prompt_tokens_per_call"]
    return (f"{name}: {s['workflows']} workflows, {s['calls']} calls, {s['agents']} agents | "
            f"calls/workflow mean {cpw['mean']} (max {cpw['max']:.0f}) | loops/workflow mean {loops['mean']} "
            f"(max {loops['max']:.0f}) | prompt tokens/call mean {ptok['mean']:.0f}, p50 {ptok['p50']:.0f}, "
            f"p99 {ptok['p99']:.0f} | largest prompt/workflow mean "
            f"{s['largest_prompt_tokens_per_workflow']['mean']:.0f} | output tokens/call mean {s['output_tokens_per_call']['mean']:.0f} | "
            f"reusable share (unbounded cache) {s['reusable_share']:.1%}")
