"""How the results pages write numbers and settings: the table and wording helpers shared by the
report (report.py) and its regime section (regime.py)."""

from __future__ import annotations

import math


def is_main(r: dict) -> bool:
    """A plain row of the policy comparison: no noise, no pruning."""
    return r["comparison"] == "policies" and not r.get("noise")


def fmt(x, spec="{:.2f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)


def md_table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def tokens_text(n) -> str:
    """300000 -> 300k, 1500000 -> 1.5M (GPU sizes as a reader says them)."""
    if not isinstance(n, (int, float)):
        return str(n)
    if n >= 1e6:
        return f"{n / 1e6:g}M"
    return f"{n / 1e3:g}k" if n >= 1e3 else f"{n:g}"


SETTING_WORDS = {  # how a heading says one setting key's value
    "gpu_tokens": lambda v: f"{tokens_text(v)} GPU tokens",
    "concurrency": lambda v: f"{v} live workflows",
    "horizon": lambda v: f"K={v}",
    "gamma": lambda v: f"gamma {v}",
    "end_signal_loss": lambda v: f"{float(v or 0):.0%} of end signals lost",
    "replicas": lambda v: f"{v} server{'s' if v != 1 else ''}",
    "routing": lambda v: f"{v} routing",
    "cost_model": lambda v: f"cost model {v}",
    "hicache_ratio": lambda v: "host tier n/a" if v is None else "no host tier" if not v else f"host tier {v:g}x GPU",
    "scheduling": lambda v: f"{v} admission",
    "partial_eviction": lambda v: "partial eviction" if v else "whole-node eviction",
}


def in_words(key: str, value) -> str:
    """One setting key and its value as a heading says it: `300k GPU tokens`, `32 live workflows`."""
    return SETTING_WORDS.get(key, str)(value)


def sort_key(values) -> tuple:
    """Settings in order: by workload name, then each size ascending (None first)."""
    return tuple((0, "") if v is None else (1, v) if isinstance(v, (int, float)) else (2, str(v)) for v in values)


ROBUST_TOLERANCE = 0.01  # a trust mode may lose at most 1 point of hit rate to the better of LRU and pbkv_lae


def robust_setting_cells(at: dict, others: tuple | list = ()) -> list[str]:
    """A robust table's setting columns for the setting `at` (SETTING key -> value): workload, GPU
    tokens, host tier, eviction unit, and `others` (keys varying beside those) in words, one cell."""
    cells = [at["workload"], str(at["gpu_tokens"]), in_words("hicache_ratio", at.get("hicache_ratio")),
             "partial" if at.get("partial_eviction") else "whole-node"]
    return cells + ([", ".join(in_words(k, at.get(k)) for k in others)] if others else [])


def split_of(r: dict) -> str:
    return r.get("split") or "test"
