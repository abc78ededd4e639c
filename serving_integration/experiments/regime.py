"""The report's "Where prediction pays" section (experiment=regime): rows whose GPU size was given as
a fraction of the live working set (sim.gpu_working_set_fraction), one cell per (workload, host
tier, live workflows, fraction).

Per cell: the mean workflow latency of pbkv, of pbkv fed the true future (pbkv_perfect: the ceiling
of prediction), of the oracle and of KVFlow as a speed-up over LRU's (LRU's latency / the policy's,
paired by seed), and pbkv's gap closed on recomputed tokens: the share of the distance from LRU's
recompute share to the setting's proven bound on recomputed tokens that pbkv covers (the row's
`gap_closed_recompute`, experiments/rows.py). Heatmaps of the three, a table, and a paragraph written from the numbers: where gains exist,
how large, where they vanish, and what the paper's 1.85x would take in this simulator.

The latency ceiling of a cell is an estimate from LRU's own time split: no eviction or prefetch
policy changes tool time, decode time is taken as LRU's, and the admission queue is kept as LRU's;
with PCIe time gone and prefill cut to the recomputed tokens the floor leaves (prefill time taken
as proportional to recomputed tokens), LRU's latency / (tool + decode + queue + prefill x floor /
LRU's recompute share). It is not a bound: calls that finish sooner shorten the queue too, and the
table marks each setting where a row beats it. The same without the queue term is the looser
estimate had caching removed the queue too.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from serving_integration.experiments.statistics import per_seed
from serving_integration.experiments.tables import fmt, in_words, is_main, md_table, sort_key, split_of, tokens_text


FRACTION = "gpu_working_set_fraction"
CELL = ("workload", "split", "hicache_ratio", "concurrency", FRACTION)
GAIN = 1.02  # a speed-up at or above this counts as a gain (one seed: no interval to judge by)
PAPER_SPEEDUP = 1.85  # the PBKV paper's mean workflow latency over LRU
# the row each role of a cell is read from: its policy, then the prefetch and trust modes preferred
ROLES = {
    "lru": ("lru", ("none",), ("none",)),
    "pbkv": ("pbkv", ("conservative", "none", "aggressive"), ("outcome", "accuracy", "always")),
    "time": ("pbkv_time", ("conservative", "none", "aggressive"), ("outcome", "accuracy", "always")),
    "perfect": ("pbkv_perfect", ("conservative", "none", "aggressive"), ("always",)),
    "oracle": ("oracle", ("conservative", "none", "aggressive"), ("none",)),
    "kvflow": ("kvflow", ("kvflow", "none"), ("none",)),
}


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def cells(rows) -> dict[tuple, dict]:
    """{cell key: {"rows": the cell's rows, role: its row}} for the single-server policy rows sized
    as a fraction of the working set, under SGLang's default FCFS admission and whole-node eviction
    (the admission and eviction-unit sections compare the others); cells without an LRU row are left
    out."""
    grouped = defaultdict(list)
    for r in rows:
        if is_main(r) and r.get(FRACTION) is not None and (r.get("replicas") or 1) == 1 \
                and r.get("scheduling", "fcfs") == "fcfs" and not r.get("partial_eviction"):
            grouped[tuple(split_of(r) if k == "split" else r.get(k) for k in CELL)].append(r)
    out = {}
    for key, group in grouped.items():
        cell = {"rows": group}
        for role, (policy, prefetches, trusts) in ROLES.items():
            candidates = [r for r in group if r["policy"] == policy and r["prefetch"] in prefetches
                          and r.get("trust", "none") in trusts]
            candidates.sort(key=lambda r: (prefetches.index(r["prefetch"]), trusts.index(r.get("trust", "none"))))
            if candidates:
                cell[role] = candidates[0]
        if "lru" in cell:
            out[key] = cell
    return out


def speedup(cell: dict, role: str) -> float | None:
    """LRU's mean workflow latency over the role's, the mean of the per-seed ratios."""
    row = cell.get(role)
    if row is None:
        return None
    pairs = zip(per_seed(cell["lru"], "mean_workflow_latency_s"), per_seed(row, "mean_workflow_latency_s"))
    return float(np.mean([base / mine if mine else math.nan for base, mine in pairs]))


def recompute_floor(cell: dict) -> tuple[float | None, str]:
    """The lowest recompute share any policy of the cell can reach: the setting's proven bound on
    recomputed tokens (rows.py setting_bound_recompute_rate; simulator/bound.py). (value, which one)."""
    bounds = [r["setting_bound_recompute_rate"] for r in cell["rows"] if number(r.get("setting_bound_recompute_rate"))]
    return (min(bounds), "bound on recomputed tokens") if bounds else (None, "none")


def gap_closed_recompute(cell: dict, role: str = "pbkv") -> float | None:
    """The row's gap_closed_recompute (rows.py: against the setting's recompute bound), mean over seeds."""
    row = cell.get(role)
    return float(np.mean(per_seed(row, "gap_closed_recompute"))) if row and number(row.get("gap_closed_recompute")) else None


def time_part(row: dict, part: str) -> float:
    v = row.get(f"time_{part}_s")
    return float(v) if number(v) else 0.0


def latency_ceiling(cell: dict, floor: float | None, queue: bool = True) -> float | None:
    """LRU's latency over its tool + decode (+ queue) time plus the prefill the floor leaves (module
    docstring)."""
    lru = cell["lru"]
    latency, recompute = lru["mean_workflow_latency_s"], lru.get("recompute_rate")
    if floor is None or not number(recompute) or recompute <= 0 or latency <= 0:
        return None
    prefill = time_part(lru, "prefill") * min(1.0, max(0.0, floor) / recompute)
    rest = time_part(lru, "tool") + time_part(lru, "decode") + (time_part(lru, "queue") if queue else 0.0) + prefill
    return latency / rest if rest > 0 else None


def reuse_needed(cell: dict, target: float) -> float | None:
    """The reusable share at which the ceiling of the cell would reach `target` (with LRU's time split
    and recompute share as they are); None where no share can: tool and decode time alone are more
    than 1/target of LRU's latency (the queue kept, as in latency_ceiling)."""
    lru = cell["lru"]
    latency, recompute = lru["mean_workflow_latency_s"], lru.get("recompute_rate")
    prefill = time_part(lru, "prefill")
    if not number(recompute) or recompute <= 0 or prefill <= 0:
        return None
    # the ceiling is latency / (tool + decode + queue + prefill x (1 - u) / recompute): solve for u
    left = latency / target - time_part(lru, "tool") - time_part(lru, "decode") - time_part(lru, "queue")
    if left < 0:
        return None
    return max(0.0, 1 - recompute * left / prefill)


def measures(found: dict) -> dict[tuple, dict]:
    """Every cell's numbers: speed-ups, gap closed, floor, ceilings."""
    out = {}
    for key, cell in found.items():
        floor, floor_kind = recompute_floor(cell)
        share = cell["lru"].get("dataset_reusable_share")
        lru = cell["lru"]
        out[key] = {
            "cell": cell, "pbkv": speedup(cell, "pbkv"), "perfect": speedup(cell, "perfect"),
            "oracle": speedup(cell, "oracle"), "kvflow": speedup(cell, "kvflow"), "time": speedup(cell, "time"),
            "gap": gap_closed_recompute(cell), "time_gap": gap_closed_recompute(cell, "time"),
            "floor": floor, "floor_kind": floor_kind, "ceiling": latency_ceiling(cell, floor),
            "fastest": max((v for v in (speedup(cell, r) for r in ("pbkv", "perfect", "oracle", "kvflow", "time"))
                            if number(v)), default=None),
            "ceiling_unbounded": latency_ceiling(cell, 1 - share) if number(share) else None,
            "ceiling_no_queue": latency_ceiling(cell, 1 - share if number(share) else floor, queue=False),
            "fixed_share": (time_part(lru, "tool") + time_part(lru, "decode") + time_part(lru, "queue"))
            / lru["mean_workflow_latency_s"]
            if lru["mean_workflow_latency_s"] > 0 else None,
            "reuse_needed": reuse_needed(cell, PAPER_SPEEDUP), "reusable_share": share,
        }
    return out


def where(key: tuple) -> str:
    at = dict(zip(CELL, key))
    return (f"{in_words('hicache_ratio', at['hicache_ratio'])}, {at['concurrency']} live, "
            f"{at[FRACTION]:g}x the working set")


def heatmaps(numbers: dict[tuple, dict], out: Path) -> list[tuple[str, str]]:
    """Figures of pbkv's speed-up, perfect prediction's, pbkv's gap closed on recompute, and pbkv_time's
    speed-up and gap closed (where the runs have it), each a grid of workloads (rows) x host tiers
    (columns) of live workflows x GPU fraction heatmaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize, TwoSlopeNorm

    from serving_integration.experiments.presentation import save_figure

    splits = sorted({k[1] for k in numbers}, key=lambda s: (s != "test", s))
    split = splits[0]
    keys = [k for k in numbers if k[1] == split]
    workloads = sorted({k[0] for k in keys})
    hosts = sorted({k[2] for k in keys}, key=lambda v: sort_key([v]))
    concs = sorted({k[3] for k in keys})
    fracs = sorted({k[4] for k in keys})
    made = []
    for field, title, name in (("pbkv", "PBKV's speed-up over LRU (mean workflow latency)", "regime_pbkv_speedup.png"),
                               ("perfect", "perfect prediction's speed-up over LRU", "regime_perfect_speedup.png"),
                               ("gap", "PBKV's gap closed on recomputed tokens", "regime_gap_recompute.png"),
                               ("time", "pbkv_time's speed-up over LRU (mean workflow latency)",
                                "regime_pbkv_time_speedup.png"),
                               ("time_gap", "pbkv_time's gap closed on recomputed tokens",
                                "regime_pbkv_time_gap_recompute.png")):
        values = [numbers[k][field] for k in keys if number(numbers[k][field])]
        if not values:
            continue
        if field in ("gap", "time_gap"):
            # a setting whose LRU sits near the bound turns a small loss into a large negative share:
            # the colours stop at -100% (the cell still prints its number)
            norm = Normalize(vmin=max(-1.0, min(0.0, min(values))), vmax=max(1.0, max(values)), clip=True)
            cmap, spec = "viridis", "{:.0%}"
        else:
            spread = max(0.01, max(abs(v - 1) for v in values))
            norm, cmap, spec = TwoSlopeNorm(vcenter=1.0, vmin=1 - spread, vmax=1 + spread), "RdBu", "{:.2f}"
        fig, axes = plt.subplots(len(workloads), len(hosts), squeeze=False,
                                 figsize=(2.2 + 2.0 * len(hosts), 0.6 + 1.5 * len(workloads)))
        image = None
        for i, workload in enumerate(workloads):
            for j, host in enumerate(hosts):
                ax = axes[i][j]
                grid = np.full((len(concs), len(fracs)), np.nan)
                for a, conc in enumerate(concs):
                    for b, frac in enumerate(fracs):
                        v = numbers.get((workload, split, host, conc, frac), {}).get(field)
                        if number(v):
                            grid[a, b] = v
                            ink = "white" if abs(float(norm(v)) - 0.5) > 0.3 else "black"  # legible on dark cells
                            ax.text(b, a, spec.format(v), ha="center", va="center", fontsize=6, color=ink)
                image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto", origin="lower")
                ax.set_xticks(range(len(fracs)), [f"{f:g}" for f in fracs], fontsize=6)
                ax.set_yticks(range(len(concs)), [str(c) for c in concs], fontsize=6)
                if i == 0:
                    ax.set_title(in_words("hicache_ratio", host), fontsize=8)
                if j == 0:
                    ax.set_ylabel(f"{workload}\nlive workflows", fontsize=7)
                if i == len(workloads) - 1:
                    ax.set_xlabel("GPU / live working set", fontsize=7)
        fig.suptitle(f"{title}, {split} split", fontsize=9)
        fig.colorbar(image, ax=axes, shrink=0.6)
        save_figure(fig, out / name, dpi=110, metadata={"Software": None})
        plt.close(fig)
        made.append((name, f"{title}, {split} split"))
    return made


def table(numbers: dict[tuple, dict]) -> str:
    body = []
    for key in sorted(numbers, key=sort_key):
        n, lru = numbers[key], numbers[key]["cell"]["lru"]
        at = dict(zip(CELL, key))
        body.append([at["workload"], at["split"], in_words("hicache_ratio", at["hicache_ratio"]),
                     str(at["concurrency"]), f"{at[FRACTION]:g}", tokens_text(lru["gpu_tokens"]),
                     fmt(lru["hit_rate"], "{:.1%}"), fmt(lru.get("recompute_rate"), "{:.1%}"),
                     fmt(lru["mean_workflow_latency_s"]), fmt(n["pbkv"], "{:.3f}"), fmt(n["perfect"], "{:.3f}"),
                     fmt(n["oracle"], "{:.3f}"), fmt(n["kvflow"], "{:.3f}"), fmt(n["gap"], "{:.0%}"),
                     fmt(n["time"], "{:.3f}"), fmt(n["time_gap"], "{:.0%}"),
                     fmt(n["ceiling"], "{:.2f}") + (" (beaten)" if beaten(n) else "")])
    return md_table(["workload", "split", "host tier", "live", "GPU / working set", "GPU tokens", "LRU GPU hit",
                     "LRU recomputed", "LRU latency (s)", "pbkv x LRU", "perfect x LRU", "oracle x LRU",
                     "kvflow x LRU", "pbkv gap closed (recompute)", "pbkv_time x LRU",
                     "pbkv_time gap closed (recompute)", "latency ceiling (estimate)"], body)


def workload_sentence(workload: str, entries: dict[tuple, dict]) -> str:
    """Where pbkv's gains exist on one workload, how large, and where they vanish."""
    share = next((n["reusable_share"] for n in entries.values() if number(n["reusable_share"])), None)
    head = f"**{workload}**" + (f" (reusable share {share:.1%})" if share is not None else "")
    scored = {k: n for k, n in entries.items() if number(n["pbkv"])}
    if not scored:
        return f"{head}: no pbkv rows."
    best = max(scored, key=lambda k: scored[k]["pbkv"])
    gains = [k for k in scored if scored[k]["pbkv"] >= GAIN]
    perfect = [n["perfect"] for n in entries.values() if number(n["perfect"])]
    text = (f"{head}: pbkv is at least {GAIN:.2f}x faster than LRU in {len(gains)} of {len(scored)} settings; "
            f"its best is {scored[best]['pbkv']:.3f}x ({where(best)})")
    if perfect:
        text += f", perfect prediction's best {max(perfect):.3f}x"
    vanish = []
    for index, name in ((2, "hicache_ratio"), (4, FRACTION), (3, "concurrency")):
        for value in sorted({k[index] for k in scored}, key=lambda v: sort_key([v])):
            top = max(scored[k]["pbkv"] for k in scored if k[index] == value)
            if top < GAIN:
                vanish.append(in_words("hicache_ratio", value) if name == "hicache_ratio" else
                              f"{value:g}x the working set" if name == FRACTION else f"{value} live")
    if not gains:
        text += "; no setting reaches a gain"
    elif vanish:
        text += f"; gains vanish ({GAIN:.2f}x or less everywhere) with {', '.join(vanish)}"
    gaps = [n["gap"] for n in scored.values() if number(n["gap"])]
    if gaps:
        text += f"; pbkv closes a median {np.median(gaps):.0%} of the gap on recomputed tokens (best {max(gaps):.0%})"
    timed = {k: n for k, n in entries.items() if number(n["time"])}
    if timed:
        best = max(timed, key=lambda k: timed[k]["time"])
        text += (f"; pbkv_time is at least {GAIN:.2f}x faster than LRU in "
                 f"{sum(n['time'] >= GAIN for n in timed.values())} of {len(timed)} settings, its best "
                 f"{timed[best]['time']:.3f}x ({where(best)})")
        time_gaps = [n["time_gap"] for n in timed.values() if number(n["time_gap"])]
        if time_gaps:
            text += f", and closes a median {np.median(time_gaps):.0%} (best {max(time_gaps):.0%})"
    return text + "."


def beaten(n: dict) -> bool:
    """A row of the cell is faster than the cell's estimated ceiling (the estimate keeps LRU's queue,
    but calls that finish sooner shorten it: the ceiling is an estimate, not a bound)."""
    return number(n["fastest"]) and number(n["ceiling"]) and n["fastest"] > n["ceiling"] + 1e-9


def paper_paragraph(numbers: dict[tuple, dict]) -> str:
    """What the paper's 1.85x would take here, from the perfect/oracle rows and the time split."""
    observed = {k: max(v for v in (n["perfect"], n["oracle"]) if number(v))
                for k, n in numbers.items() if number(n["perfect"]) or number(n["oracle"])}
    ceilings = {k: n["ceiling_unbounded"] if number(n["ceiling_unbounded"]) else n["ceiling"]
                for k, n in numbers.items()}
    ceilings = {k: v for k, v in ceilings.items() if number(v)}
    need = 1 - 1 / PAPER_SPEEDUP
    parts = [f"**The paper's {PAPER_SPEEDUP}x.** A {PAPER_SPEEDUP}x speed-up removes {need:.0%} of LRU's "
             "mean workflow latency."]
    if observed:
        k = max(observed, key=observed.get)
        parts.append(f"The fastest perfect-prediction or oracle row here is {observed[k]:.3f}x LRU "
                     f"({k[0]}, {where(k)}).")
    if not ceilings:
        return " ".join(parts)
    k = max(ceilings, key=ceilings.get)
    n = numbers[k]
    parts.append(f"With every reusable token a GPU hit and no PCIe time, LRU's own time split puts an "
                 f"estimated ceiling on the speed-up of {ceilings[k]:.2f}x at best ({k[0]}, {where(k)}), where tool, decode and queueing "
                 f"time (which the estimate keeps as LRU's) are {n['fixed_share']:.0%} of LRU's "
                 "latency.")
    loose = {key: m["ceiling_no_queue"] for key, m in numbers.items() if number(m["ceiling_no_queue"])}
    if loose:
        q = max(loose, key=loose.get)
        text = f"Had caching removed the queue too, the estimate would be {loose[q]:.2f}x ({q[0]}, {where(q)})"
        oracle, lru = numbers[q]["cell"].get("oracle"), numbers[q]["cell"]["lru"]
        if oracle and time_part(lru, "queue") > 0:
            text += f"; the oracle's queueing there is {time_part(oracle, 'queue') / time_part(lru, 'queue'):.0%} of LRU's"
        parts.append(text + ".")
    over = sorted((key for key, m in numbers.items() if beaten(m)), key=sort_key)  # the example: first in order, not as loaded
    if over:
        parts.append(f"The ceiling is an estimate, not a bound: in {len(over)} of {len(numbers)} settings a row is "
                     f"faster than it (e.g. {over[0][0]}, {where(over[0])}), where calls that finish sooner also "
                     "shorten the queue that the estimate keeps.")
    per_workload = {}
    for key, m in numbers.items():
        if number(ceilings.get(key)):
            per_workload.setdefault(key[0], []).append(ceilings[key])
    parts.append("Best ceiling per workload: " + ", ".join(
        f"{w} {max(v):.2f}x" for w, v in sorted(per_workload.items())) + ".")
    reachable = {key: m["reuse_needed"] for key, m in numbers.items() if number(m["reuse_needed"])}
    if ceilings[k] >= PAPER_SPEEDUP:
        hits = sorted(key for key, v in ceilings.items() if v >= PAPER_SPEEDUP)
        parts.append(f"{len(hits)} settings allow {PAPER_SPEEDUP}x in principle, e.g. {hits[0][0]}, {where(hits[0])}.")
    elif reachable:
        key = min(reachable, key=reachable.get)
        m = numbers[key]
        parts.append(f"So by this estimate the simulator does not produce {PAPER_SPEEDUP}x on these workloads. The nearest setting "
                     f"is {key[0]}, {where(key)}: there it would take a reusable share of "
                     f"{reachable[key]:.0%} (the workload has {fmt(m['reusable_share'], '{:.0%}')}) with "
                     "every reusable token kept on the GPU; elsewhere tool, decode and queueing time leave no room.")
    else:
        parts.append(f"So by this estimate the simulator does not produce {PAPER_SPEEDUP}x on these workloads, at any reusable share: "
                     f"tool, decode and queueing time, which the estimate keeps as LRU's, are more than "
                     f"{1 / PAPER_SPEEDUP:.0%} of LRU's latency in every setting.")
    return " ".join(parts)


def regime_section(rows, out: Path) -> str:
    """The section's Markdown (its heatmaps written into `out`); "" without rows sized as a fraction
    of the working set."""
    found = cells(rows)
    if not found:
        return ""
    numbers = measures(found)
    by_workload = defaultdict(dict)
    for key, n in numbers.items():
        by_workload[key[0]][key] = n
    floors = sorted({n["floor_kind"] for n in numbers.values()})
    parts = [f"One row per setting (workload, host tier, live workflows, GPU memory as a fraction of the live "
             f"working set: concurrency x the mean largest prompt of a workflow). Speed-up: LRU's mean workflow "
             f"latency over the policy's (pbkv and pbkv_time under outcome trust, and pbkv, pbkv_time, perfect and "
             f"oracle with conservative prefetch, where the runs have them); a gain is {GAIN:.2f}x or more. "
             f"Gap closed on "
             f"recompute is measured against the setting's floor on recomputed tokens ({'; '.join(floors)}). The "
             "latency ceiling (an estimate: the table marks a setting where a row beats it) is LRU's latency over its tool + decode + queueing time plus the prefill the floor leaves "
             "(serving_integration/experiments/regime.py).",
             "\n\n".join(workload_sentence(w, by_workload[w]) for w in sorted(by_workload)),
             paper_paragraph(numbers)]
    parts += [f"![{title}]({name})" for name, title in heatmaps(numbers, out)]
    parts.append(table(numbers))
    return "\n\n".join(parts)
