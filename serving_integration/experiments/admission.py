"""The report's "Admission order" section (experiment=admission): per workload and GPU size, every
policy under each admission order (sim.scheduling: SGLang's FCFS, lpm, hrrn and spf), against LRU under
FCFS, SGLang's default; latency first, then recomputed work and hits; then a paragraph written from
the numbers. A row's bound is proven on its own request sequence, which the admission order changes,
so the bound column compares a row with the best eviction order for its own order, not across orders."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from serving_integration.experiments.presentation import row_label
from serving_integration.experiments.rows import setting_but
from serving_integration.experiments.statistics import over_seeds, paired_ratios, per_seed, shown
from serving_integration.experiments.tables import md_table, sort_key, split_of

ORDERS = ("fcfs", "program_fcfs", "lpm", "hrrn", "spf")  # table order: SGLang's default first
NOTE = ("Each admission order (sim.scheduling, simulator/engine.py) with each eviction policy, test split, no "
        "prefetch; mean ± 95% CI over seeds. Speed-up: the mean workflow latency of LRU under FCFS (SGLang's "
        "default) over the row's, per seed; \"no difference\" where the interval holds 1. lpm admits the waiting "
        "call with the longest cached prefix first; hrrn the one with the most prompt tokens prefilled by the "
        "server while it waited per token it must prefill itself; spf (shortest prefill first) the one with the fewest "
        "tokens to prefill, and it caps a chunked prefill for shorter ones. Own bound: the eviction bound on the row's own "
        "request sequence (no eviction order reaches more GPU hits with that admission order); the admission "
        "order changes the sequence, so a row under lpm can pass the bound of a row under FCFS.")


def admission_groups(rows) -> dict[tuple, list[dict]]:
    """Settings (all but the admission order) replayed under more than one order, with their rows
    without prefetch on the test split."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("comparison", "policies") == "policies" and r["prefetch"] == "none" and split_of(r) != "val":
            groups[tuple(setting_but(r, "scheduling").values())].append(r)
    return {k: g for k, g in groups.items() if len({r.get("scheduling", "fcfs") for r in g}) > 1}


def _fcfs_lru(group: list[dict]) -> dict | None:
    return next((r for r in group if r["policy"] == "lru" and r.get("scheduling", "fcfs") == "fcfs"), None)


def _speed_up(r: dict, base: dict | None):
    return None if base is None else over_seeds(paired_ratios(r, base, "mean_workflow_latency_s", higher=False))


PLOTTED = ("lru", "pbkv")  # the policies the figure draws under each order (pbkv: its learned predictor)


def speed_up_figure(groups: dict[tuple, list[dict]], out: Path) -> str:
    """Bars of the speed-up over FCFS LRU (mean ± 95% CI over seeds) per setting, for lru and pbkv
    under each admission order; the figure's Markdown line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from serving_integration.experiments.presentation import section_figure

    keys = sorted(groups, key=sort_key)
    orders = [o for o in ORDERS if any(r.get("scheduling", "fcfs") == o for g in groups.values() for r in g)]
    series = [(o, p) for o in orders for p in PLOTTED]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(keys), 3.6))
    for i, (order, policy) in enumerate(series):
        values, errors = [], []
        for key in keys:
            base = _fcfs_lru(groups[key])
            row = next((r for r in groups[key] if r["policy"] == policy and r.get("scheduling", "fcfs") == order), None)
            gain = _speed_up(row, base) if row is not None else None
            values.append(gain.value if gain is not None else float("nan"))
            errors.append(0.0 if gain is None or gain.low is None else (gain.high - gain.low) / 2)
        ax.bar([k + (i - (len(series) - 1) / 2) * width for k in range(len(keys))], values, width, yerr=errors,
               label=f"{policy}, {order}", capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{g[0]['workload']}\n{g[0].get('gpu_working_set_fraction') or g[0]['gpu_tokens']:g}x"
                        for g in (groups[k] for k in keys)], fontsize=8)
    ax.set_ylabel("speed-up vs FCFS LRU (mean latency)")
    ax.set_title("Admission order and eviction order, test split, mean ± 95% CI over seeds", fontsize=9)
    ax.legend(fontsize=7, ncol=len(orders))
    return section_figure(fig, out, "admission_speedup.png",
                          "speed-up over FCFS LRU of lru and pbkv under each admission order, test split")


def admission_section(rows, out: Path) -> str:
    """The figure (written into `out`), tables and paragraph, or "" when no setting ran under two
    admission orders."""
    groups = admission_groups(rows)
    if not groups:
        return ""
    parts = [NOTE, speed_up_figure(groups, out)]
    for key in sorted(groups, key=sort_key):
        group = groups[key]
        at = setting_but(group[0], "scheduling")
        base = _fcfs_lru(group)
        fraction = group[0].get("gpu_working_set_fraction")
        size = f"{fraction:g}x the working set" if fraction is not None else f"{at['gpu_tokens']} GPU tokens"
        parts.append(f"**{at['workload']}**, {size} ({at['gpu_tokens']:,} GPU tokens), {at['concurrency']} live "
                     f"workflows, {len(per_seed(group[0], 'hit_rate'))} seed(s)")
        group = sorted(group, key=lambda r: (ORDERS.index(r.get("scheduling", "fcfs")), row_label(r)))
        head = ["admission", "policy", "mean latency (s)", "speed-up vs FCFS LRU", "p50 latency (s)",
                "p99 latency (s)", "mean TTFT (s)", "recomputed", "GPU hits", "own bound", "calls/s"]
        body = [[r.get("scheduling", "fcfs"), row_label(r),
                 shown(over_seeds(per_seed(r, "mean_workflow_latency_s"))), shown(_speed_up(r, base), null=1.0),
                 shown(over_seeds(per_seed(r, "p50_workflow_latency_s")), "{:.1f}"),
                 shown(over_seeds(per_seed(r, "p99_workflow_latency_s")), "{:.1f}"),
                 shown(over_seeds(per_seed(r, "mean_ttft_s")), "{:.3f}"),
                 shown(over_seeds(per_seed(r, "recompute_rate")), "{:.1%}"),
                 shown(over_seeds(per_seed(r, "hit_rate")), "{:.1%}"),
                 shown(over_seeds(per_seed(r, "bound_hit_rate")), "{:.1%}") if r.get("bound_hit_rate") is not None
                 else "n/a",
                 shown(over_seeds(per_seed(r, "throughput_calls_per_s")), "{:.2f}")] for r in group]
        parts.append(md_table(head, body))
    parts.append(paragraph(groups))
    return "\n\n".join(parts)


def paragraph(groups: dict[tuple, list[dict]]) -> str:
    """Per setting: the fastest row against FCFS LRU, and what the cache-aware orders do to LRU's
    recomputed work and latency."""
    sentences = []
    for key in sorted(groups, key=sort_key):
        group, base = groups[key], _fcfs_lru(groups[key])
        if base is None:
            continue
        fraction = group[0].get("gpu_working_set_fraction")
        where = f"{group[0]['workload']} at {fraction:g}x" if fraction is not None else group[0]["workload"]
        best = max(group, key=lambda r: _speed_up(r, base).value)
        gain = _speed_up(best, base)
        if gain.low is not None and gain.low > 1:
            text = (f"{where}: the fastest row is {row_label(best)} under {best.get('scheduling', 'fcfs')} "
                    f"({shown(gain)}x FCFS LRU's speed)")
        else:
            text = f"{where}: no row is faster than FCFS LRU beyond its interval"
        for order in ("lpm", "hrrn", "spf"):
            lru = next((r for r in group if r["policy"] == "lru" and r.get("scheduling") == order), None)
            if lru is not None:
                text += (f"; lru under {order} recomputes {lru['recompute_rate']:.1%} of prompt tokens against "
                         f"{base['recompute_rate']:.1%} under FCFS, at {shown(_speed_up(lru, base), null=1.0)}x "
                         f"its speed (p99 {lru['p99_workflow_latency_s']:.0f} s against "
                         f"{base['p99_workflow_latency_s']:.0f} s)")
        sentences.append(text + ".")
    return " ".join(sentences)
