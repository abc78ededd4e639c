"""python -m serving_integration.experiments.report RUN_DIR... --out DIR

Builds report.md and report.html with PNG plots from the summary.json files of evaluate.py runs
(a run directory, a multirun directory, or summary.json files): the paper's claims beside ours,
one table per setting with ratios against LRU and KVFlow, and plots of every sweep the runs
contain (GPU memory, concurrency, prediction noise with a linear fit of the regret, horizon K,
gamma, predictor backbone, KV-pruning layout). Every number in it is computed from the rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from data.atomic import atomic_dir, check_output, check_replaceable
from data.errors import run_reported
from serving_integration.cache.metrics import TIME_SPLIT
from serving_integration.experiments.presentation import row_label as label
from serving_integration.experiments.rows import ROW_LABELS, SETTING

DYNAMIC = ("hover", "swebench", "who_and_when")
STATIC = ("financebench",)

# The PBKV paper (arXiv 2605.06472): shape to compare against, not absolute values
PAPER = {
    "hit_vs_lru": "up to 2.55x (dynamic workloads)",
    "latency_vs_lru": "up to 1.85x (dynamic workloads)",
    "lae_hit_vs_lru": "up to 1.66x",
    "static_hit_vs_kvflow": "1.39x (FinanceBench)",
    "static_latency_vs_kvflow": "1.26x (FinanceBench)",
    "hit_rates_point": "LRU 27.09%, lifecycle-only 44.91%, PBKV 69.10% GPU hit rate (Qwen3-32B)",
    "noise": "at 20% noise conservative prefetch beats aggressive; at >= 30% aggressive is worse than none",
}


def load_rows(paths: list[str]) -> tuple[list[dict], list[Path]]:
    files = []
    for p in map(Path, paths):
        found = [p] if p.is_file() else sorted(p.rglob("summary.json"))
        if not found:
            raise FileNotFoundError(f"{p}: no summary.json there (run evaluate.py first)")
        files.extend(found)
    rows, seen = [], set()
    for f in files:
        try:
            summary_rows = json.loads(f.read_text())["rows"]
            if not isinstance(summary_rows, list) or not all(isinstance(r, dict) for r in summary_rows):
                raise TypeError("rows is not a list of rows")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{f}: not a summary.json of evaluate.py ({type(e).__name__}: {e})") from None
        for i, row in enumerate(summary_rows):
            missing = sorted({*ROW_LABELS, "hit_rate", "mean_workflow_latency_s"} - set(row))
            if missing:
                raise ValueError(f"{f}: row {i} lacks {', '.join(missing)} (not a summary.json of evaluate.py)")
            # a sweep over predictor settings repeats the rows that do not depend on them
            key = json.dumps(row, sort_keys=True)
            if key not in seen:
                seen.add(key)
                rows.append({**row, "source": str(f)})
    return rows, files


def setting_of(r: dict) -> tuple:
    return tuple(r.get(k) for k in SETTING)


def setting_title(key: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(SETTING, key))


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def is_main(r: dict) -> bool:
    """A plain row of the policy comparison: no noise, no pruning."""
    return r["comparison"] == "policies" and not r.get("noise")


# -------------------------------------------------------------------- tables

def fmt(x, spec="{:.2f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)


def md_table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def setting_tables(rows: list[dict]) -> str:
    """One table per setting: every metric as mean ± 95% CI over the seeds (the value alone for one
    seed); ratios against LRU and KVFlow (its own prefetch) paired by seed."""
    groups = defaultdict(list)
    for r in rows:
        if is_main(r):
            groups[setting_of(r)].append(r)
    parts = []
    for key, group in groups.items():
        lru = next((r for r in group if r["policy"] == "lru"), None)
        kvflow = next((r for r in group if r["policy"] == "kvflow" and r["prefetch"] == "aggressive"), None)

        def vs(base, r, field, higher):
            return pm(paired_ratios(r, base, field, higher)) if base else "n/a"

        body = []
        for r in group:
            body.append([label(r), cell(r, "hit_rate", "{:.1%}"), vs(lru, r, "hit_rate", True),
                         vs(kvflow, r, "hit_rate", True), cell(r, "mean_workflow_latency_s"),
                         vs(lru, r, "mean_workflow_latency_s", False), vs(kvflow, r, "mean_workflow_latency_s", False),
                         cell(r, "p99_workflow_latency_s"), cell(r, "mean_ttft_s", "{:.3f}"),
                         fmt(r["prefetch_precision"], "{:.0%}"),
                         cell(r, "reuse_rate", "{:.1%}"), cell(r, "recompute_rate", "{:.1%}"),
                         cell(r, "bound_hit_rate", "{:.1%}"), cell(r, "gap_closed"),
                         *(cell(r, f"time_{part}_s") for part in TIME_SPLIT)])
        head = ["policy", "GPU hit rate", "x LRU", "x KVFlow", "mean latency (s)", "speed-up vs LRU",
                "speed-up vs KVFlow", "p99 latency (s)", "mean TTFT (s)", "prefetch precision",
                "reuse (GPU + host)", "recomputed", "upper bound", "gap closed",
                *(f"{part} (s/wf)" for part in TIME_SPLIT)]
        seeds = group[0].get("seeds") or [group[0].get("seed")]
        parts.append(f"### {setting_title(key)}\n\n{group[0]['workflows']} workflows, {group[0]['calls']} calls, "
                     f"seed(s) {seeds} ({Path(group[0]['source']).parent})\n\n" + md_table(head, body))
    return "\n\n".join(parts)


SETTING_NOTE = (
    "GPU hit rate, reuse (GPU + host hits) and recomputed (missed) are shares of prompt tokens. Upper bound: "
    "no eviction policy can reach a higher GPU hit rate on the row's own request sequence with the same GPU "
    "capacity (an interval LP in the style of FOO, Berger et al. SIGMETRICS 2018; "
    "serving_integration/simulator/bound.py); gap closed = (hit rate - LRU's) / (upper bound - LRU's). "
    "The oracle is a heuristic (Belady by distance in calls), not a bound. The last five columns split the "
    "mean workflow latency: tool time, admission queue, prefill, decode and PCIe loads, seconds per workflow.")


# -------------------------------------------------------------------- claims: knobs chosen on val, numbers on test

# a configuration of a method: the knobs tuned on the validation split (memory point, K, gamma, prefetch)
MATCH = ("workload", "cost_model", "gpu_tokens", "concurrency", "horizon", "gamma", "end_signal_loss", "replicas", "routing")
OWN_PREFETCH = {"kvflow": "aggressive"}  # a baseline compared with its own prefetch; others without


def per_seed(r: dict, field: str) -> list[float]:
    return list(r.get(f"{field}_per_seed") or [r[field]])


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and 95% confidence half-width (Student t over the seeds; None for one value)."""
    from scipy import stats

    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan, None
    n = len(values)
    if n < 2:
        return float(values[0]), None
    return float(np.mean(values)), float(stats.t.ppf(0.975, n - 1) * np.std(values, ddof=1) / math.sqrt(n))


def cell(r: dict, field: str, spec: str = "{:.2f}") -> str:
    """A row's metric as mean ± 95% CI over its seeds; n/a where the row has no such number."""
    return pm(per_seed(r, field), spec) if isinstance(r.get(field), (int, float)) else "n/a"


def pm(values: list[float], spec: str = "{:.2f}") -> str:
    """mean ± ci (one value: the value alone)."""
    mean, ci = mean_ci(values)
    if math.isnan(mean):
        return "n/a"
    return spec.format(mean) + ("" if ci is None else " ± " + spec.format(ci))


def split_of(r: dict) -> str:
    return r.get("split") or "test"


def paired_ratios(a: dict, b: dict, field: str, higher: bool) -> list[float]:
    """Per-seed ratios a/b (higher is better) or b/a (lower is better), paired by seed."""
    xs, ys = per_seed(a, field), per_seed(b, field)
    return [ratio(x, y) if higher else ratio(y, x) for x, y in zip(xs, ys)]


def index_rows(rows, workloads) -> dict:
    """(split, MATCH values, policy, prefetch) -> row, for the plain policy rows of `workloads`."""
    out = {}
    for r in rows:
        if is_main(r) and r["workload"].split("-")[0] in workloads:
            out.setdefault((split_of(r), tuple(r.get(k) for k in MATCH), r["policy"], r["prefetch"]), r)
    return out


def knobs_text(match: tuple, prefetch: str) -> str:
    at = dict(zip(MATCH, match))
    return (f"gpu_tokens={at['gpu_tokens']}, C={at['concurrency']}, K={at['horizon']}, gamma={at['gamma']}, "
            f"prefetch={prefetch}")


def choose_on_val(rows, policy, base_policy, workloads, field, higher=True) -> dict[str, tuple]:
    """Per workload: the configuration of `policy` (memory point, K, gamma, prefetch mode) with the
    best mean ratio over `base_policy` on the validation split, and its test rows. Without val rows,
    a workload whose test rows hold a single configuration uses it (nothing to choose)."""
    index = index_rows(rows, workloads)
    base_prefetch = OWN_PREFETCH.get(base_policy, "none")
    chosen = {}
    for workload in sorted({key[1][0] for key in index}):
        def candidates(split):
            for (sp, match, pol, prefetch), r in index.items():
                base = index.get((sp, match, base_policy, base_prefetch))
                if sp == split and pol == policy and match[0] == workload and base is not None:
                    yield match, prefetch, r, base

        val = list(candidates("val"))
        test = list(candidates("test"))
        if val:
            match, prefetch, _, _ = max(val, key=lambda c: np.mean(paired_ratios(c[2], c[3], field, higher)))
            how = "chosen on val"
        elif len(test) == 1:
            match, prefetch, _, _ = test[0]
            how = "the only configuration run"
        else:
            chosen[workload] = None if not test else f"{len(test)} configurations on test, no val rows to choose"
            continue
        pick = index.get(("test", match, policy, prefetch)), index.get(("test", match, base_policy, base_prefetch))
        chosen[workload] = (match, prefetch, how, *pick) if all(pick) else "the val choice has no test rows"
    return chosen


def claim(rows, policy, base_policy, workloads, field, higher=True) -> str:
    parts = []
    for workload, pick in choose_on_val(rows, policy, base_policy, workloads, field, higher).items():
        if pick is None:
            continue
        if isinstance(pick, str):
            parts.append(f"{workload}: {pick}")
            continue
        match, prefetch, how, a, b = pick
        parts.append(f"{workload}: {pm(paired_ratios(a, b, field, higher))}x ({knobs_text(match, prefetch)}; {how}; "
                     f"{len(per_seed(a, field))} seed(s))")
    return "<br>".join(parts) or "not in these runs"


def hit_rates_point(rows) -> str:
    """LRU / lifecycle-only / PBKV hit rates (no prefetch) at the memory point where PBKV gains
    most over LRU on val, measured on test (dynamic workloads)."""
    index = index_rows(rows, DYNAMIC)
    parts = []
    for workload, pick in choose_on_val([r for r in rows if r["prefetch"] == "none"], "pbkv", "lru", DYNAMIC,
                                        "hit_rate").items():
        if not isinstance(pick, tuple):
            continue
        match = pick[0]
        lae = index.get(("test", match, "pbkv_lae", "none"))
        hits = [("LRU", pick[4]), ("lifecycle-only", lae), ("PBKV", pick[3])]
        parts.append(f"{workload}: " + ", ".join(f"{name} {pm(per_seed(r, 'hit_rate'), '{:.1%}')}"
                                                 for name, r in hits if r) + f" ({knobs_text(match, 'none')}; {pick[2]})")
    return "<br>".join(parts) or "not in these runs"


def noise_claim(rows) -> str:
    out = []
    test = [r for r in rows if split_of(r) == "test" and r["policy"] == "pbkv"]
    for eps in sorted({r["noise"] for r in test if r["noise"]}):
        modes = {r["prefetch"]: r for r in test if r["noise"] == eps}
        if {"none", "conservative", "aggressive"} <= set(modes):
            lat = {m: pm(per_seed(modes[m], "mean_workflow_latency_s")) for m in modes}
            out.append(f"eps={eps:g}: mean latency none {lat['none']} s, conservative "
                       f"{lat['conservative']} s, aggressive {lat['aggressive']} s")
    return "; ".join(out) or "not in these runs"


def claims_table(rows) -> str:
    ours = {
        "hit_vs_lru": claim(rows, "pbkv", "lru", DYNAMIC, "hit_rate"),
        "latency_vs_lru": claim(rows, "pbkv", "lru", DYNAMIC, "mean_workflow_latency_s", higher=False),
        "lae_hit_vs_lru": claim(rows, "pbkv_lae", "lru", DYNAMIC, "hit_rate"),
        "static_hit_vs_kvflow": claim(rows, "pbkv", "kvflow", STATIC, "hit_rate"),
        "static_latency_vs_kvflow": claim(rows, "pbkv", "kvflow", STATIC, "mean_workflow_latency_s", higher=False),
        "hit_rates_point": hit_rates_point(rows),
        "noise": noise_claim(rows),
    }
    names = {"hit_vs_lru": "PBKV GPU hit rate vs LRU", "latency_vs_lru": "PBKV latency vs LRU",
             "lae_hit_vs_lru": "lifecycle-only (pbkv_lae) hit rate vs LRU",
             "static_hit_vs_kvflow": "static workload: PBKV hit rate vs KVFlow (its own prefetch)",
             "static_latency_vs_kvflow": "static workload: PBKV latency vs KVFlow (its own prefetch)",
             "hit_rates_point": "LRU / lifecycle-only / PBKV hit rates at one memory point",
             "noise": "prediction noise and prefetch"}
    return md_table(["claim", "paper", "ours: test split, mean ± 95% CI over seeds, knobs chosen on val"],
                    [[names[k], PAPER[k], ours[k]] for k in PAPER])


CLAIMS_NOTE = ("Each of our numbers is measured on the test split with the configuration (GPU memory point, "
               "horizon K, gamma, prefetch mode) that did best on the validation split of the same runs "
               "(`split=val`); ratios are taken per seed (paired) and shown as mean ± the 95% confidence "
               "half-width of Student's t over the seeds (`seeds=[...]`; a single seed shows no interval).")


def regret_fit(rows) -> tuple[str, list]:
    """Regret(eps) = hit rate at eps=0 minus hit rate at eps, per (setting, policy, prefetch); linear fit."""
    series = defaultdict(dict)
    for r in rows:
        if r["policy"] in ("pbkv", "pbkv_perfect") and r["comparison"] == "policies":
            series[(setting_of(r), label(r))][r["noise"]] = r
    body, fits = [], []
    for (key, name), by_eps in series.items():
        if 0.0 not in by_eps or len(by_eps) < 3:
            continue
        eps = np.array(sorted(by_eps))
        regret = np.array([by_eps[0.0]["hit_rate"] - by_eps[e]["hit_rate"] for e in eps])
        slope, intercept = np.polyfit(eps, regret, 1)
        fitted = slope * eps + intercept
        ss = float(((regret - regret.mean()) ** 2).sum())
        r2 = 1 - float(((regret - fitted) ** 2).sum()) / ss if ss else 1.0
        lae = [r for r in rows if is_main(r) and setting_of(r) == key and r["policy"] == "pbkv_lae"]
        floor = min(by_eps[e]["hit_rate"] for e in eps) - lae[0]["hit_rate"] if lae else None
        body.append([setting_title(key), name, ", ".join(f"{e:g}" for e in eps), f"{slope:.3f}", f"{intercept:.3f}",
                     f"{r2:.2f}", fmt(floor, "{:+.1%}")])
        fits.append((key, name, eps, regret, slope, intercept))
    head = ["setting", "policy", "noise levels", "regret slope", "intercept", "R^2",
            "lowest hit rate minus pbkv_lae's"]
    return (md_table(head, body) if body else ""), fits


# -------------------------------------------------------------------- robust PBKV: adaptive trust, per seed

ROBUST_TOLERANCE = 0.01  # adaptive may lose at most 1 point of hit rate to the better of LRU and pbkv_lae
ROBUST_KEEP = 0.95  # and keep this share of always's gain over LRU where predictions help (KEEP_WORKLOADS)
KEEP_WORKLOADS = ("hover", "swebench")


def robustness_rows(rows) -> list[tuple]:
    """(setting, predictor, noise, noise kind, lru, pbkv_lae, adaptive, always) for every test setting
    with plain lru and pbkv_lae rows and pbkv under both trust modes, no prefetch."""
    groups = defaultdict(dict)
    for r in rows:
        if r["comparison"] != "policies" or split_of(r) != "test" or r["prefetch"] != "none":
            continue
        if r["policy"] in ("lru", "pbkv_lae") and not r.get("noise"):
            groups[setting_of(r)].setdefault(r["policy"], r)
        elif r["policy"] == "pbkv" and r.get("trust") in ("adaptive", "always"):
            kind = r.get("noise_kind") if r.get("noise") else "none"
            groups[setting_of(r)].setdefault((r["predictor"], r.get("noise") or 0.0, kind, r["trust"]), r)
    out = []
    for key, group in groups.items():
        if "lru" not in group or "pbkv_lae" not in group:
            continue
        for pred, noise, kind, trust in sorted(k for k in group if isinstance(k, tuple)):
            always = group.get((pred, noise, kind, "always"))
            if trust == "adaptive" and always is not None:
                out.append((key, pred, noise, kind, group["lru"], group["pbkv_lae"], group[(pred, noise, kind, trust)],
                            always))
    return out


def robustness_check(rows) -> str:
    """Per seed: adaptive - max(lru, pbkv_lae) in points, and the share of always's gain over LRU
    that adaptive keeps; each against its criterion."""
    body = []
    for key, pred, noise, kind, lru, lae, adaptive, always in robustness_rows(rows):
        at = dict(zip(SETTING, key))
        l, e, a, w = (per_seed(r, "hit_rate") for r in (lru, lae, adaptive, always))
        margin = [ai - max(li, ei) for li, ei, ai in zip(l, e, a)]
        # where always gains nothing over LRU there is no gain to keep: met when adaptive is no worse than always
        keep = [(ai - li) / (wi - li) if wi - li > 1e-9 else math.nan for li, ai, wi in zip(l, a, w)]
        kept = [k >= ROBUST_KEEP if not math.isnan(k) else ai >= wi - 1e-12 for k, ai, wi in zip(keep, a, w)]
        keep_applies = at["workload"].split("-")[0] in KEEP_WORKLOADS and not noise
        ok = all(m >= -ROBUST_TOLERANCE - 1e-12 for m in margin) and (not keep_applies or all(kept))
        seeds = adaptive.get("seeds") or [adaptive.get("seed")]
        body.append([at["workload"], str(at["gpu_tokens"]), pred, "none" if not noise else f"{kind} eps={noise:g}",
                     ", ".join(str(s) for s in seeds),
                     " / ".join(f"{x:.1%}" for x in l), " / ".join(f"{x:.1%}" for x in e),
                     " / ".join(f"{x:.1%}" for x in a), " / ".join(f"{x:.1%}" for x in w),
                     " / ".join(f"{100 * m:+.1f}" for m in margin),
                     " / ".join("no gain" if math.isnan(k) else f"{k:.0%}" for k in keep) + ("" if keep_applies else " (not checked)"),
                     "yes" if ok else "**no**"])
    if not body:
        return "No setting with lru, pbkv_lae and pbkv under both trust modes in these runs."
    head = ["workload", "GPU tokens", "predictor", "noise", "seeds", "lru", "pbkv_lae", "pbkv adaptive",
            "pbkv always", "adaptive - max(lru, pbkv_lae) (points)", "adaptive's share of always's gain", "criteria met"]
    return md_table(head, body)


def predictor_check(rows) -> str:
    """Per workload and seed: the test top-1 at k=1 of each predictor behind pbkv (train.py's, on the
    replayed dataset's test split), the default family against Markov."""
    top1 = defaultdict(dict)  # workload -> predictor -> (seeds, values)
    for r in rows:
        if r["policy"] == "pbkv" and split_of(r) == "test" and r.get("predictor_top1_k1") is not None:
            seeds = r.get("seeds") or [r.get("seed")]
            top1[r["workload"]].setdefault(r["predictor"], (seeds, per_seed(r, "predictor_top1_k1")))
    body = []
    for workload, by_pred in sorted(top1.items()):
        markov = by_pred.get("markov")
        for pred, (seeds, values) in sorted(by_pred.items()):
            if pred == "markov":
                continue
            diff = ([v - m for v, m in zip(values, markov[1])] if markov and markov[0] == seeds else None)
            body.append([workload, pred, ", ".join(map(str, seeds)), " / ".join(f"{v:.3f}" for v in values),
                         " / ".join(f"{v:.3f}" for v in markov[1]) if markov else "n/a",
                         " / ".join(f"{d:+.3f}" for d in diff) if diff else "n/a",
                         "n/a" if not diff else ("yes" if all(d >= -1e-12 for d in diff) else "**no**")])
    if not body:
        return "No predictor test metrics in these runs."
    return md_table(["workload", "predictor", "seeds", "test top-1 k=1", "Markov", "difference", ">= Markov"], body)


def robust_section(rows) -> str:
    """The per-seed robustness check and the predictors' top-1 beside Markov; "" without such rows."""
    if not robustness_rows(rows) and not any(r.get("predictor_top1_k1") is not None for r in rows):
        return ""
    return "\n\n".join([ROBUST_NOTE, robustness_check(rows), predictor_check(rows)])


ROBUST_NOTE = (
    "Per seed (values separated by /, in the order of the seeds column), test split, no prefetch: pbkv under "
    "adaptive trust (it falls back to lifecycle-aware LRU while the predictions it measures online are poor) "
    "against the better of lru and pbkv_lae, in points of GPU hit rate (criterion: >= -1 in every seed), and "
    "the share of the gain of pbkv under always trust (the paper's policy) over LRU that adaptive keeps "
    "(criterion on hover and swebench without noise: >= 95% in every seed; where always gains nothing over LRU, \"no gain\", met when adaptive is no worse than always). "
    "The predictor table gives the test top-1 at k=1 of the predictor behind pbkv beside Markov's, per seed.")


# -------------------------------------------------------------------- plots

def sweep_plots(rows, out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def line_plot(name, title, xlabel, series, ylabel):
        fig, ax = plt.subplots(figsize=(7, 4))
        colors = plt.cm.tab20.colors
        for i, (lab, points) in enumerate(sorted(series.items())):
            xs, ys = zip(*sorted(points, key=lambda p: p[0]))
            ax.plot(xs, ys, marker="os^v"[i // 5 % 4], color=colors[i % 20], label=lab)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append((name, title))

    for axis, xlabel in (("gpu_tokens", "GPU KV capacity (tokens)"), ("concurrency", "live workflows")):
        others = [k for k in SETTING if k != axis]
        groups = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if is_main(r):
                groups[tuple(r.get(k) for k in others)][label(r)].append((r[axis], r))
        for key, series in groups.items():
            if len({x for pts in series.values() for x, _ in pts}) < 2:
                continue
            series = {k: v for k, v in series.items() if len(v) > 1}
            workload = key[0]
            for field, ylabel, tag in (("hit_rate", "GPU hit rate", "hit"),
                                       ("mean_workflow_latency_s", "mean workflow latency (s)", "latency")):
                line_plot(f"{workload}_{axis}_{tag}_{len(made)}.png", f"{workload}: {ylabel} vs {axis}", xlabel,
                          {lab: [(x, r[field]) for x, r in pts] for lab, pts in series.items()}, ylabel)
    lookahead = defaultdict(list)  # horizon x gamma, one line per gamma
    for r in rows:
        if is_main(r) and r["policy"] == "pbkv" and r["prefetch"] == "none":
            lookahead[(r["workload"], r["gpu_tokens"], r["concurrency"], r["predictor"])].append(r)
    for (workload, gpu, conc, predictor), group in lookahead.items():
        if len({r["horizon"] for r in group}) > 1:
            line_plot(f"{workload}_horizon_gamma_{len(made)}.png",
                      f"{workload} (gpu_tokens={gpu}, C={conc}, {predictor}): PBKV hit rate vs K", "horizon K",
                      {f"gamma={g}": [(r["horizon"], r["hit_rate"]) for r in group if r["gamma"] == g]
                       for g in sorted({r["gamma"] for r in group})}, "GPU hit rate")
    return made


def noise_plot(fits, out: Path) -> list[tuple[str, str]]:
    if not fits:
        return []
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, name, eps, regret, slope, intercept in fits:
        line = ax.plot(eps, regret, marker="o", label=f"{key[0]} {name}")[0]
        ax.plot(eps, slope * eps + intercept, linestyle="--", color=line.get_color())
    ax.set_xlabel("prediction noise eps")
    ax.set_ylabel("hit-rate regret vs eps = 0")
    ax.set_title("Regret against prediction noise (dashed: linear fit)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "noise_regret.png", dpi=110)
    plt.close(fig)
    return [("noise_regret.png", "Regret against prediction noise")]


def backbone_and_kv_plots(rows, out: Path) -> list[tuple[str, str]]:
    import matplotlib.pyplot as plt

    made = []
    by_setting = defaultdict(dict)  # setting -> predictor -> pbkv hit rate (no prefetch)
    for r in rows:
        if is_main(r) and r["policy"] in ("pbkv", "pbkv_perfect") and r["prefetch"] == "none":
            by_setting[setting_of(r)].setdefault(r["predictor"], r["hit_rate"])
    for key, hits in by_setting.items():
        if len(hits) < 3:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(list(hits), list(hits.values()))
        ax.set_ylabel("GPU hit rate (pbkv)")
        at = dict(zip(SETTING, key))
        ax.set_title(f"PBKV by predictor backbone ({at['workload']}, gpu_tokens={at['gpu_tokens']}, "
                     f"C={at['concurrency']})", fontsize=10)
        fig.tight_layout()
        name = f"backbones_{key[0]}_{len(made)}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append((name, "PBKV by predictor backbone"))
    kv = [r for r in rows if r["comparison"] == "kv"]
    if kv:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([f"{r['workload']}\n{r['layout']}" for r in kv], [r["reuse_rate"] for r in kv])
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylabel("prefix hit rate")
        ax.set_title("KV pruning: prefix-cache hits by layout")
        fig.tight_layout()
        fig.savefig(out / "kv_layouts.png", dpi=110)
        plt.close(fig)
        made.append(("kv_layouts.png", "KV pruning: prefix-cache hits by layout"))
    return made


def kv_table(rows) -> str:
    kv = [r for r in rows if r["comparison"] == "kv"]
    if not kv:
        return ""
    body = [[r["workload"], r["layout"], r["kv_method"], str(r["kv_budget"]), fmt(r["reuse_rate"], "{:.1%}"),
             fmt(r["hit_rate"], "{:.1%}"), f"{r['kv_tokens_read']:.3g}", fmt(r["mean_workflow_latency_s"])] for r in kv]
    return md_table(["workload", "layout", "method", "budget", "prefix hit rate", "GPU hit rate", "KV tokens read",
                     "mean latency (s)"], body)


# -------------------------------------------------------------------- cluster

CLUSTER_BASES = (("round_robin", "lru"), ("cache_aware", "lru"))
CLUSTER_BEST_AT = (("hover", "swebench"), 4)  # workloads and replica count whose best combination is named


def cluster_rows(rows) -> dict:
    """Rows of cluster runs (evaluate.py experiment=cluster) by (workload, workflows, gpu_tokens,
    concurrency): {(replicas, routing, eviction): row}. With one replica the routing policy cannot
    matter (its runs are the single server), so one of them stands for all, as routing 'none'."""
    if not any(r.get("replicas", 1) > 1 for r in rows):
        return {}
    groups = defaultdict(dict)
    for r in rows:
        if not is_main(r) or "replicas" not in r:
            continue
        key = (r["workload"], r["workflows"], r["gpu_tokens"], r["concurrency"], r["cost_model"])
        routing = r["routing"] if r["replicas"] > 1 else "none"
        groups[key].setdefault((r["replicas"], routing, label(dict(r, replicas=1))), r)
    return {k: v for k, v in groups.items() if any(rep > 1 for rep, _, _ in v)}


def cluster_best(combos: dict, replicas: int):
    """The combination with the highest mean GPU hit rate (then the lowest mean latency) at `replicas`,
    and its hit-rate ratio and latency speed-up over each base combination present, paired by seed."""
    at = {(routing, ev): r for (rep, routing, ev), r in combos.items() if rep == replicas}
    if not at:
        return None
    (routing, ev), top = max(at.items(), key=lambda item: (item[1]["hit_rate"], -item[1]["mean_workflow_latency_s"]))
    ratios = {}
    for base in CLUSTER_BASES:
        b = at.get(base)
        if b is not None:
            ratios[base] = (paired_ratios(top, b, "hit_rate", True),
                            paired_ratios(top, b, "mean_workflow_latency_s", False))
    return routing, ev, top, ratios


def cluster_section(rows) -> str:
    groups = cluster_rows(rows)
    if not groups:
        return ""
    parts, named = [], []
    workloads, at = CLUSTER_BEST_AT
    for (workload, n_wf, gpu, conc, cost), combos in groups.items():
        body = []
        for (rep, routing, ev), r in sorted(combos.items(), key=lambda item: item[0]):
            body.append([str(rep), routing, ev, cell(r, "hit_rate", "{:.1%}"), cell(r, "recompute_rate", "{:.1%}"),
                         cell(r, "mean_workflow_latency_s"), cell(r, "p99_workflow_latency_s"),
                         cell(r, "load_imbalance"), cell(r, "migrations", "{:.0f}")])
        head = ["replicas", "routing", "eviction", "GPU hit rate", "recompute rate", "mean latency (s)",
                "p99 latency (s)", "load imbalance", "migrations"]
        seeds = next(iter(combos.values())).get("seeds") or [next(iter(combos.values())).get("seed")]
        parts.append(f"### {workload}: {n_wf} workflows, total gpu_tokens={gpu}, concurrency={conc}, {cost}, "
                     f"seed(s) {seeds}\n\n" + md_table(head, body))
        found = cluster_best(combos, at) if workload.split("-")[0] in workloads else None
        if found:
            routing, ev, top, ratios = found
            vs = "; ".join(f"x{pm(h)} hit rate, x{pm(l)} latency speed-up over {b[0]} + {b[1]}"
                           for b, (h, l) in ratios.items()) or "no base combination in these runs"
            named.append(f"- **{workload}** ({at} replicas): best **{routing} + {ev}** at "
                         f"{pm(per_seed(top, 'hit_rate'), '{:.1%}')} GPU hit rate, mean latency "
                         f"{pm(per_seed(top, 'mean_workflow_latency_s'))} s; {vs}")
    intro = ("Mean ± 95% CI over the seeds; ratios paired by seed. "
             "Recompute rate: missed prompt tokens over prompt tokens (prefilled again). Load imbalance: the most "
             "calls served by one replica over the mean. Migrations: calls routed away from their workflow's "
             "previous replica. The total GPU KV capacity is the same at every replica count (split evenly).")
    best = "\n".join(named) or f"No runs at {at} replicas on {', '.join(workloads)}."
    return "\n\n".join([intro, f"Best combination at {at} replicas (highest GPU hit rate):\n\n{best}", *parts])


# -------------------------------------------------------------------- main

def sources(files: list[Path]) -> str:
    """The run folders read: one line per sweep (parent folder), with its count of runs."""
    folders = defaultdict(int)
    for f in files:
        parent = f.parent.parent if f.parent.name.isdigit() else f.parent
        folders[parent] += 1
    return "\n".join(f"- `{folder}` ({n} run{'s' if n > 1 else ''})" for folder, n in folders.items())


COMMAND = "serving_integration.experiments.report"


def build(paths: list[str], out: Path) -> Path:
    """The report folder `out`, replaced all at once (data.atomic): never one of the runs read, a
    folder holding them, nor a folder this command did not make."""
    check_output(out, paths)
    check_replaceable(out, (COMMAND,))
    rows, files = load_rows(paths)
    if not rows:
        raise ValueError(f"no rows in {', '.join(map(str, files))}: nothing to report")
    with atomic_dir(out, COMMAND, inputs=paths) as tmp:
        regret_md, fits = regret_fit(rows)
        plots = sweep_plots(rows, tmp) + noise_plot(fits, tmp) + backbone_and_kv_plots(rows, tmp)
        optional = [("## Prediction noise: regret and its linear fit", regret_md),
                    ("## Robust PBKV: adaptive trust per seed", robust_section(rows)),
                    ("## KV pruning (IntentKV)", kv_table(rows)),
                    ("## A cluster: replicas x routing x eviction", cluster_section(rows))]
        md = "\n\n".join([
            "# PBKV report",
            f"Built from {len(files)} summary.json file(s), {len(rows)} rows:\n\n" + sources(files),
            "## The paper's claims beside ours", CLAIMS_NOTE, claims_table(rows),
            *(part for heading, body in optional if body for part in (heading, body)),  # sections these runs have
            "## Plots", "\n\n".join(f"![{title}]({name})" for name, title in plots) or "No sweep in these runs.",
            "## Results by setting", SETTING_NOTE, setting_tables(rows),
        ]) + "\n"
        (tmp / "report.md").write_text(md)
        import markdown

        html = markdown.markdown(md, extensions=["tables"])
        (tmp / "report.html").write_text(
            "<!doctype html><meta charset='utf-8'><title>PBKV report</title><style>body{font-family:sans-serif;"
            "max-width:1100px;margin:auto}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
            "padding:3px 6px}img{max-width:100%}</style>\n" + html)
    return out / "report.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories, multirun directories or summary.json files")
    parser.add_argument("--out", required=True, type=Path, help="report directory (replaced)")
    args = parser.parse_args(argv)

    def body():
        path = build(args.runs, args.out)
        print(f"report: {path} and {path.with_suffix('.html')}")
    return run_reported(body)


if __name__ == "__main__":
    sys.exit(main())
