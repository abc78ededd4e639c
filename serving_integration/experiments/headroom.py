"""The report's "Where the headroom lies" section (experiment=headroom): for each row that carries
the attribution of simulator/headroom.py (evaluate.py headroom=true, rows without prefetch), the
eviction bound's extra GPU hits over the row on reused intervals, split by reuse distance in time
and by what the reading workflow was doing, and how many workflows the bound and the row keep
cache for; then a paragraph written from the numbers."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from serving_integration.experiments.presentation import row_label
from serving_integration.experiments.tables import fmt, md_table, sort_key, split_of, tokens_text
from serving_integration.simulator.headroom import DISTANCE_BINS, PHASES

DISTANCE_WORDS = dict(zip(DISTANCE_BINS, ("under 1 s", "1-10 s", "10-60 s", "60 s and more")))
PHASE_WORDS = {"tool": "waiting on a tool", "queued": "queued for admission", "running": "running calls (of other agents)",
               "not_started": "not started"}
NOTE = ("Bound - row: the row's own eviction bound (bound_hit_rate) less its GPU hit rate. Headroom: the part of "
        "it on reused intervals: the eviction bound's GPU hits on reused intervals (a key left in the cache by one call's "
        "finish and read by a later admission, no running request holding it) less the row's own, in points of "
        "prompt tokens (simulator/headroom.py). The rest of bound - row is reads of keys that a running request held "
        "and an earlier finish had inserted, which the bound counts as hits and the row missed (the holder had "
        "prefilled its own copy and the inserted one was gone: an order that had kept it would have hit there "
        "too); with sim.page_size above 1, page rounding adds to it. A read of a key no finish had inserted yet "
        "is a miss in the bound as in every row (simulator/bound.py, point 3). "
        "Then the share of that headroom by the time between the finish and the read, and by what the reading "
        "workflow did meanwhile (each interval split by the share of its time in each phase); a negative share "
        "is where the row keeps more than the bound's solution. The solution split is prefix-closed (a key read "
        "below a missed one is a miss, as in a radix cache: simulator/bound.py, point 4a, which also shows that on "
        "reads of whole keys this leaves the bound's value as it is). Workflows keeping cache: at each gap between "
        "events, the workflows with a kept interval spanning it (the bound's LP: x >= 1/2), averaged over the "
        "gaps: fewer for the bound than for the row means the optimum keeps some workflows whole where the row "
        "spreads the cache over many.")


def headroom_rows(rows) -> list[dict]:
    """Rows with the attribution, validation rows left out (knobs are chosen there, not reported)."""
    return [r for r in rows if r.get("headroom_bound_hit_rate") is not None and split_of(r) != "val"]


def headroom_section(rows) -> str:
    """The table and paragraph, or "" when no row carries the attribution."""
    found = sorted(headroom_rows(rows), key=lambda r: sort_key((r["workload"], r.get("gpu_working_set_fraction"),
                                                                 r["gpu_tokens"], bool(r.get("partial_eviction")),
                                                                 row_label(r))))
    if not found:
        return ""
    head = ["workload", "GPU", "policy", "GPU hits", "bound - row (points)", "headroom (points)",
            *(f"reuse {DISTANCE_WORDS[b]}" for b in DISTANCE_BINS), *(PHASE_WORDS[p] for p in PHASES),
            "workflows keeping cache: bound / row"]
    body = []
    for r in found:
        delta = r["headroom_bound_hit_rate"] - r["headroom_run_hit_rate"]
        gap = None if r.get("bound_hit_rate") is None else 100 * (r["bound_hit_rate"] - r["hit_rate"])
        body.append([r["workload"], gpu_text(r), row_label(r), fmt(r["hit_rate"], "{:.1%}"), fmt(gap, "{:.1f}"),
                     fmt(100 * delta, "{:.1f}"),
                     *(share(r[f"headroom_reuse_{b}"], delta) for b in DISTANCE_BINS),
                     *(share(r[f"headroom_phase_{p}"], delta) for p in PHASES),
                     f"{r['kept_workflows_bound']:.1f} / {r['kept_workflows_run']:.1f}"])
    return "\n\n".join(part for part in (NOTE, md_table(head, body), paragraph(found), integer_part(found)) if part)


INTEGER_NOTE = ("How loose the bound is (rows of headroom_integer's policies): the bound's LP with every key kept "
                "whole through its interval or not at all (0/1), searched by HiGHS's branch and bound "
                "(simulator/headroom.py, INTEGER_NODES nodes). Integer bound: its proven bound on that integer "
                "optimum, itself a bound on every policy's GPU hits on the row's sequence; 0/1 plan: the best "
                "0/1 solution found (the integer optimum lies between the two). Fractions: the share of the "
                "LP's lead over the row that lies above the integer bound, i.e. that only fractional keeps "
                "reach. The model stays a relaxation of a radix cache (simulator/bound.py), so a plan's hits "
                "are not proven reachable by a policy.")


def integer_part(rows) -> str:
    """The table of the rows that searched their bound's integer optimum, and one sentence; "" when none did."""
    found = [r for r in rows
             if r.get("headroom_integer_bound_hit_rate") is not None and r.get("bound_hit_rate") is not None]
    if not found:
        return ""
    body, fractions = [], []
    for r in found:
        lead = r["bound_hit_rate"] - r["hit_rate"]
        fraction = (r["bound_hit_rate"] - r["headroom_integer_bound_hit_rate"]) / lead if lead > 1e-9 else None
        fractions.append(fraction)
        body.append([r["workload"], gpu_text(r), row_label(r), fmt(r["hit_rate"], "{:.1%}"),
                     fmt(r["bound_hit_rate"], "{:.1%}"), fmt(r["headroom_integer_bound_hit_rate"], "{:.1%}"),
                     fmt(r["headroom_integer_plan_hit_rate"], "{:.1%}"), fmt(fraction, "{:.0%}")])
    head = ["workload", "GPU", "policy", "GPU hits", "bound (LP)", "integer bound", "0/1 plan", "fractions"]
    known = [f for f in fractions if f is not None]
    sentence = (f"Over these {len(found)} rows, fractional keeps account for {min(known):.0%} to {max(known):.0%} of "
                f"the LP bound's lead over the row (median {float(np.median(known)):.0%}); the rest of the lead "
                "remains under the integer bound." if known else "")
    return "\n\n".join(part for part in (INTEGER_NOTE, md_table(head, body), sentence) if part)


def gpu_text(r: dict) -> str:
    """The GPU size, its share of the working set, and the eviction unit where it is partial."""
    fraction = r.get("gpu_working_set_fraction")
    words = ([f"{fraction:g} of the working set"] if fraction is not None else []) + \
        (["partial eviction"] if r.get("partial_eviction") else [])
    return tokens_text(r["gpu_tokens"]) + (f" ({', '.join(words)})" if words else "")


def policy_and_unit(r: dict) -> str:
    """The row's label, with partial eviction named (whole-node, SGLang's, is the default)."""
    return row_label(r) + (" with partial eviction" if r.get("partial_eviction") else "")


def share(part: float, whole: float) -> str:
    return fmt(part / whole, "{:.0%}") if whole > 1e-9 else "n/a"


def paragraph(rows) -> str:
    """Per policy, over its rows: the headroom's mean, where most of it lies, and the workflows kept."""
    by_policy = defaultdict(list)
    for r in rows:
        by_policy[policy_and_unit(r)].append(r)
    sentences = []
    for policy, group in sorted(by_policy.items()):
        total = sum(r["headroom_bound_hit_rate"] - r["headroom_run_hit_rate"] for r in group)
        if total <= 1e-9:
            sentences.append(f"Over the {len(group)} rows of {policy}, the bound has no headroom on reused intervals.")
            continue
        distance = {b: sum(r[f"headroom_reuse_{b}"] for r in group) / total for b in DISTANCE_BINS}
        phase = {p: sum(r[f"headroom_phase_{p}"] for r in group) / total for p in PHASES}
        top_distance, top_phase = max(distance, key=distance.get), max(phase, key=phase.get)
        kept_bound = sum(r["kept_workflows_bound"] for r in group) / len(group)
        kept_run = sum(r["kept_workflows_run"] for r in group) / len(group)
        sentences.append(
            f"Over the {len(group)} rows of {policy}, the bound's headroom averages "
            f"{100 * total / len(group):.1f} points "
            f"of prompt tokens; {distance[top_distance]:.0%} of it lies in reuses {DISTANCE_WORDS[top_distance]} "
            f"apart and {phase[top_phase]:.0%} in time the reading workflow spent {PHASE_WORDS[top_phase]}; the "
            f"bound keeps cache for {kept_bound:.1f} workflows at a time, {policy} for {kept_run:.1f}.")
    return " ".join(sentences)
