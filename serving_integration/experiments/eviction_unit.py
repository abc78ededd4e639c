"""The report's "Eviction unit" section (experiment=time_aware): per setting, every policy with
whole-node eviction (SGLang's) and with partial eviction (sim.partial_eviction: the victim node gives
up only the tail it must), paired by seed; latency first, then recomputed work and GPU hits; then a
paragraph written from the numbers."""

from __future__ import annotations

import statistics
from collections import defaultdict

from serving_integration.cache.metrics import eviction_overshoot
from serving_integration.experiments.presentation import row_label
from serving_integration.experiments.rows import setting_but
from serving_integration.experiments.statistics import over_seeds, paired_differences, paired_ratios, per_seed, shown
from serving_integration.experiments.tables import md_table, sort_key, split_of

NOTE = ("Each policy with whole-node eviction (SGLang 0.5.23's: a victim node goes whole) and with partial "
        "eviction (sim.partial_eviction: the victim gives up only the fewest whole prompt units of its tail that "
        "free the tokens needed; simulator/radix.py), test split, no prefetch; mean ± 95% CI over seeds, "
        "differences paired by seed. Speed-up: the row's mean workflow latency with whole-node eviction over "
        "its latency with partial eviction; \"no difference\" where the interval holds 1 (0 for a difference). "
        "Each row's bound is proven on its own request sequence and counts keys, not nodes, so it holds for "
        "both. Freed per token needed: the GPU tokens the evicted nodes held over the tokens admissions asked "
        "eviction to free, pooled over seeds (1 at best: a whole victim frees more than was asked, and what it "
        "frees early was still cache).")


def eviction_unit_pairs(rows) -> dict[tuple, list[tuple[dict, dict]]]:
    """Settings (all but the eviction unit) replayed both ways: their (whole, partial) row pairs of
    one policy, without prefetch, on the test split."""
    found = defaultdict(dict)
    for r in rows:
        if r.get("comparison", "policies") == "policies" and r["prefetch"] == "none" and split_of(r) == "test":
            by_policy = found[tuple(setting_but(r, "partial_eviction").values())]
            by_policy.setdefault(row_label(r), {})[bool(r.get("partial_eviction"))] = r
    pairs = {key: [(by[False], by[True]) for _, by in sorted(labels.items()) if len(by) == 2]
             for key, labels in found.items()}
    return {key: p for key, p in pairs.items() if p}


def _size(r: dict) -> str:
    fraction = r.get("gpu_working_set_fraction")
    return f"{fraction:g}x the working set" if fraction is not None else f"{r['gpu_tokens']} GPU tokens"


def _host(r: dict) -> str:
    return "no host tier" if not r.get("hicache_ratio") else f"host tier {r['hicache_ratio']:g}x GPU"


def _speed_up(whole: dict, partial: dict):
    return over_seeds(paired_ratios(partial, whole, "mean_workflow_latency_s", higher=False))


def _points(whole: dict, partial: dict, field: str):
    return over_seeds([100 * d for d in paired_differences(partial, whole, field)])


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def eviction_unit_section(rows) -> str:
    """The tables and paragraph, or "" when no setting ran both ways."""
    pairs = eviction_unit_pairs(rows)
    if not pairs:
        return ""
    parts = [NOTE]
    for key in sorted(pairs, key=sort_key):
        whole0 = pairs[key][0][0]
        at = setting_but(whole0, "partial_eviction")
        parts.append(f"**{at['workload']}**, {_size(whole0)} ({at['gpu_tokens']:,} GPU tokens), {_host(whole0)}, "
                     f"{at['concurrency']} live workflows, {len(per_seed(whole0, 'hit_rate'))} seed(s)")
        head = ["policy", "mean latency (s): whole", "partial", "speed-up of partial", "recomputed: whole", "partial",
                "difference (points)", "GPU hits: whole", "partial", "difference (points)",
                "freed per token needed: whole", "partial"]
        body = [[row_label(whole), shown(over_seeds(per_seed(whole, "mean_workflow_latency_s"))),
                 shown(over_seeds(per_seed(partial, "mean_workflow_latency_s"))),
                 shown(_speed_up(whole, partial), "{:.3f}", null=1.0),
                 shown(over_seeds(per_seed(whole, "recompute_rate")), "{:.1%}"),
                 shown(over_seeds(per_seed(partial, "recompute_rate")), "{:.1%}"),
                 shown(_points(whole, partial, "recompute_rate"), "{:+.1f}", null=0.0),
                 shown(over_seeds(per_seed(whole, "hit_rate")), "{:.1%}"),
                 shown(over_seeds(per_seed(partial, "hit_rate")), "{:.1%}"),
                 shown(_points(whole, partial, "hit_rate"), "{:+.1f}", null=0.0),
                 _times(eviction_overshoot(whole)), _times(eviction_overshoot(partial))]
                for whole, partial in pairs[key]]
        parts.append(md_table(head, body))
    parts.append(paragraph(pairs))
    return "\n\n".join(parts)


def paragraph(pairs: dict[tuple, list[tuple[dict, dict]]]) -> str:
    """How often partial eviction is faster beyond its interval, slower, or neither; where it moves
    the recomputed work most; and how much each unit frees per token asked for."""
    faster = slower = same = 0
    freed: dict[bool, list[float]] = {False: [], True: []}
    largest = None  # (points of recomputed prompt tokens saved, whole row, partial row)
    for group in pairs.values():
        for whole, partial in group:
            gain = _speed_up(whole, partial)
            if gain.low is not None and gain.low > 1:
                faster += 1
            elif gain.high is not None and gain.high < 1:
                slower += 1
            else:
                same += 1
            for unit, r in ((False, whole), (True, partial)):
                value = eviction_overshoot(r)
                if value is not None:
                    freed[unit].append(value)
            saved = -_points(whole, partial, "recompute_rate").value
            if largest is None or saved > largest[0]:
                largest = (saved, whole, partial)
    text = (f"Of {faster + slower + same} policy rows, partial eviction is faster than whole-node eviction beyond "
            f"the interval in {faster}, slower in {slower}, and neither in {same}.")
    if largest is not None:
        _, whole, partial = largest
        where = f"{row_label(whole)} on {whole['workload']} at {_size(whole)}, {_host(whole)}"
        text += (f" It saves the most recomputed work for {where}: {whole['recompute_rate']:.1%} of prompt tokens "
                 f"recomputed whole, {partial['recompute_rate']:.1%} partial (GPU hits {whole['hit_rate']:.1%} "
                 f"and {partial['hit_rate']:.1%}; means over seeds), speed-up "
                 f"{shown(_speed_up(whole, partial), '{:.3f}', null=1.0)}.")
    if freed[False] and freed[True]:
        text += (f" Whole-node eviction frees {min(freed[False]):.2f} to {max(freed[False]):.2f} GPU tokens per "
                 f"token an admission asked for (median {statistics.median(freed[False]):.2f}), partial eviction "
                 f"{min(freed[True]):.2f} to {max(freed[True]):.2f} (median {statistics.median(freed[True]):.2f}): "
                 "a whole victim frees more than the admission needs, where partial eviction frees its tail and "
                 "keeps the rest matchable.")
    return text
