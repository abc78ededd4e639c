"""python -m serving_integration.experiments.report runs=[RUN_OR_SWEEP_DIR,...] out=DIR

Builds report.md and report.html with PNG plots from the summary.json files of evaluate.py runs
(a run directory, a multirun directory, or summary.json files; Hydra-style overrides, conf/report.yaml):
the paper's claims beside ours, the experiment's own checks, then per split (test first, validation
in an appendix) plots of every sweep the runs contain (GPU memory with the live working set, concurrency,
prediction noise with a linear fit of the regret, horizon K, gamma, predictor backbone, KV-pruning
layout; at most six series each, the 95% interval as a band) and one table per setting, settings
sorted and headed by what differs between them. Every number in it is computed from the rows; the
results page (experiments.results) builds its detail pages and its headline table from the same code.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic import atomic_dir, check_output, check_replaceable
from data.cli import compose_config
from data.errors import ConfigError, run_reported
from data.knobs import build as build_knobs, check, knob, register, shown as shown_knob
from serving_integration.cache.metrics import TIME_SPLIT
from serving_integration.experiments.presentation import OWN_PREFETCH, row_label as label
from serving_integration.experiments.rows import ROW_LABELS, SETTING, merge_seed_splits, setting_of
from serving_integration.experiments.shadow_fidelity import shadow_fidelity
from serving_integration.experiments.tables import (ROBUST_TOLERANCE, SETTING_WORDS, fmt, in_words, is_main, md_table,
                                                     robust_setting_cells, sort_key, split_of, tokens_text)
from serving_integration.experiments.statistics import (Estimate, mean_ci, over_seeds, paired_differences, paired_ratios,
                                                     per_seed, seeds_of, shown, workflow_bootstrap)

DYNAMIC = ("hover", "swebench", "who_and_when")
STATIC = ("financebench",)
GENERATED = ("hover", "swebench", "financebench")  # data.generate's workloads; the others are imported traces

# The PBKV paper (arXiv 2605.06472): shape to compare against, not absolute values
PAPER = {
    "hit_vs_lru": "up to 2.55x (dynamic workloads)",
    "latency_vs_lru": "up to 1.85x (dynamic workloads)",
    "lae_hit_vs_lru": "up to 1.66x",
    "static_hit_vs_kvflow": "1.39x (FinanceBench)",
    "static_latency_vs_kvflow": "1.26x (FinanceBench)",
    "static_hit_vs_kvflow_ideal": "1.39x (FinanceBench; one KVFlow, which variant is not said)",
    "static_latency_vs_kvflow_ideal": "1.26x (FinanceBench; one KVFlow, which variant is not said)",
    "hit_rates_point": "LRU 27.09%, lifecycle-only 44.91%, PBKV 69.10% GPU hit rate (Qwen3-32B)",
    "noise": "at 20% noise conservative prefetch beats aggressive; at >= 30% aggressive is worse than none",
}


# what every row of every summary.json has had; newer labels take their ROW_LABELS default in older runs
REQUIRED = ("workload", "policy", "prefetch", "gpu_tokens", "split", "hit_rate", "mean_workflow_latency_s")


def load_rows(paths: list[str]) -> tuple[list[dict], list[Path]]:
    files = []
    for p in map(Path, paths):
        found = [p] if p.is_file() else sorted(p.rglob("summary.json"))
        if not found:
            raise FileNotFoundError(f"{p}: no summary.json there (run evaluate.py first)")
        files.extend(found)
    rows, seen, runs = [], set(), {}
    for f in files:
        try:
            summary = json.loads(f.read_text())
            summary_rows, per_seed_rows = summary["rows"], summary.get("seed_rows") or []
            if not all(isinstance(x, list) and all(isinstance(r, dict) for r in x)
                       for x in (summary_rows, per_seed_rows)):
                raise TypeError("rows or seed_rows is not a list of rows")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{f}: not a summary.json of evaluate.py ({type(e).__name__}: {e})") from None
        if isinstance(summary.get("config"), dict):  # a job of a sweep split by seeds: merged below
            config = {k: v for k, v in summary["config"].items() if k != "seeds"}
            runs[str(f)] = (json.dumps(config, sort_keys=True), [{**ROW_LABELS, **r} for r in per_seed_rows])
        for i, row in enumerate(summary_rows):
            missing = sorted(set(REQUIRED) - set(row))
            if missing:
                raise ValueError(f"{f}: row {i} lacks {', '.join(missing)} (not a summary.json of evaluate.py)")
            # a label added to the schema after the run was written: the row did not say, so its default
            row = {**ROW_LABELS, **row}
            # a sweep over predictor settings repeats the rows that do not depend on them
            key = json.dumps(row, sort_keys=True)
            if key not in seen:
                seen.add(key)
                rows.append({**row, "sources": [str(f)]})
    # a sweep split by seeds across jobs (claims: five seeds a job) reports as one run over them all
    return merge_seed_splits(rows, runs), files


# -------------------------------------------------------------------- tables


# the setting keys a heading names in words (workload first); split, workflows and calls are said elsewhere
WORDED = ("workload", "gpu_tokens", "concurrency", "horizon", "gamma", "end_signal_loss", "replicas", "routing",
          "cost_model", "hicache_ratio", "scheduling", "partial_eviction")


ROBUST_SHOWN = ("workload", "gpu_tokens", "hicache_ratio", "partial_eviction")  # the robust tables' setting columns


def other_varying(robust: list[tuple]) -> list[str]:
    """The worded setting keys besides ROBUST_SHOWN that differ between robustness_rows' settings: a
    column of the robust tables where a run set varies one (the end-signal step's lost signals)."""
    return [k for k in varying_keys([row[0] for row in robust]) if k not in ROBUST_SHOWN]


def varying_keys(keys: list[tuple]) -> list[str]:
    """The WORDED keys whose value differs between `keys` (setting_of tuples); the GPU size always."""
    at = [dict(zip(SETTING, k)) for k in keys]
    return [k for k in WORDED if k in ("workload", "gpu_tokens") or len({repr(a.get(k)) for a in at}) > 1]


def setting_heading(key: tuple, varying: list[str]) -> str:
    at = dict(zip(SETTING, key))
    return ", ".join(in_words(k, at[k]) for k in varying)


def setting_title(key: tuple) -> str:
    """A setting in words, every worded key (a table cell where settings of several runs meet)."""
    at = dict(zip(SETTING, key))
    return ", ".join([in_words(k, at[k]) for k in WORDED] + [f"{at['split']} split"])


def common_settings(keys: list[tuple], varying: list[str]) -> str:
    """What every setting of a section shares, in words (one line above its tables)."""
    if not keys:
        return ""
    at = dict(zip(SETTING, keys[0]))
    defaults = {"end_signal_loss": (0, 0.0, None), "replicas": (1, None), "routing": ("none", None),
                "scheduling": ("fcfs", None), "partial_eviction": (False, None)}
    same = [in_words(k, at[k]) for k in WORDED if k not in varying and at[k] not in defaults.get(k, ())]
    return f"Every setting below: {', '.join(same)}." if same else ""


def versus(r: dict, base: dict | None, field: str, null_spec: str = "{:.2f}") -> str:
    """`r` against `base` on one metric, paired by seed, with the bootstrap over workflows beside it
    where both rows carry per-workflow results: a speed-up (base's latency over r's) for a latency,
    a ratio for a hit rate, a difference in points for the recompute rate; "no difference" where an
    interval contains 1 (0 for a difference)."""
    if base is None or not all(isinstance(x.get(field), (int, float)) for x in (r, base)):
        return "n/a"
    if r is base:
        return "-"
    if field == "recompute_rate":
        seeds = shown(in_points(over_seeds(paired_differences(r, base, field))), "{:+.1f}", 0.0)
        workflows = in_points(workflow_bootstrap(r, base, "missed_difference"))
        spec, null = "{:+.1f}", 0.0
    else:
        higher = field in HIGHER_IS_BETTER
        seeds = shown(over_seeds(paired_ratios(r, base, field, higher)), null_spec, 1.0)
        workflows = workflow_bootstrap(r, base, "speed_up") if field == "mean_workflow_latency_s" else None
        spec, null = null_spec, 1.0
    if workflows is None:
        return seeds
    return f"{seeds}; workflows: {shown(workflows, spec, null, style='range')}"


HIGHER_IS_BETTER = ("hit_rate", "reuse_rate", "gap_closed", "gap_closed_recompute")


def in_points(estimate: Estimate | None) -> Estimate | None:
    """A difference of shares in percentage points."""
    if estimate is None:
        return None
    scale = (lambda x: None if x is None else 100 * x)
    return Estimate(100 * estimate.value, scale(estimate.low), scale(estimate.high), estimate.samples)


def host_hits(r: dict) -> str:
    """The share of prompt tokens read from the host tier (reuse minus GPU hits), per seed."""
    if not isinstance(r.get("reuse_rate"), (int, float)):
        return "n/a"
    return pm([u - h for u, h in zip(per_seed(r, "reuse_rate"), per_seed(r, "hit_rate"))], "{:.1%}")


def setting_tables(rows: list[dict], split: str | None = None) -> str:
    """One table per setting of `split` (every split when None), settings sorted, each headed by what
    differs between them in words: the user-facing metrics first (mean and p99 workflow latency, TTFT,
    the recomputed share), then GPU and host hits and the setting's bounds, every metric as mean ± 95%
    CI over the seeds (the value alone for one seed); comparisons against LRU and both KVFlows (each
    with its own prefetch: kvflow as its public code runs it, kvflow_ideal the idealised one) paired by
    seed, with the paired bootstrap over workflows beside them on imported traces (statistics.py)."""
    groups = defaultdict(list)
    for r in rows:
        if is_main(r) and (split is None or split_of(r) == split):
            groups[setting_of(r)].append(r)
    keys = sorted(groups, key=sort_key)
    varying = varying_keys(keys)
    parts = [common_settings(keys, varying)] if keys else []
    for key in keys:
        group = sorted(groups[key], key=lambda r: (plot_rank(r), label(r)))
        lru = next((r for r in group if r["policy"] == "lru" and r["prefetch"] == "none"), None)
        kvflow, ideal = (next((r for r in group if r["policy"] == p and r["prefetch"] == OWN_PREFETCH[p]), None)
                         for p in ("kvflow", "kvflow_ideal"))
        body = []
        for r in group:
            body.append([label(r), cell(r, "mean_workflow_latency_s"), versus(r, lru, "mean_workflow_latency_s"),
                         cell(r, "p99_workflow_latency_s"), versus(r, lru, "p99_workflow_latency_s"),
                         cell(r, "mean_ttft_s", "{:.3f}"), cell(r, "recompute_rate", "{:.1%}"),
                         versus(r, lru, "recompute_rate"),
                         cell(r, "hit_rate", "{:.1%}"), versus(r, lru, "hit_rate"), host_hits(r),
                         cell(r, "setting_bound_hit_rate", "{:.1%}"), cell(r, "gap_closed"),
                         cell(r, "setting_bound_recompute_rate", "{:.1%}"), cell(r, "gap_closed_recompute"),
                         versus(r, kvflow, "mean_workflow_latency_s"), versus(r, ideal, "mean_workflow_latency_s"),
                         versus(r, kvflow, "hit_rate"), versus(r, ideal, "hit_rate"),
                         fmt(r.get("prefetch_precision"), "{:.0%}"),
                         *(cell(r, f"time_{part}_s") for part in TIME_SPLIT)])
        head = ["policy", "mean latency (s)", "speed-up vs LRU", "p99 latency (s)", "p99 speed-up vs LRU",
                "mean TTFT (s)", "recomputed", "recomputed minus LRU's (points)", "GPU hit rate", "x LRU",
                "host hits", "bound: GPU hits", "gap closed", "bound: recomputed", "gap closed (recomputed)",
                "speed-up vs KVFlow", "vs KVFlow ideal", "hit rate x KVFlow", "x KVFlow ideal",
                "prefetch precision", *(f"{part} (s/wf)" for part in TIME_SPLIT)]
        seeds = group[0].get("seeds") or [group[0].get("seed")]
        parts.append(f"### {setting_heading(key, varying)}\n\n{group[0]['workflows']} workflows, "
                     f"{group[0]['calls']} calls, {split_of(group[0])} split, seed(s) {seeds} "
                     f"({', '.join(f'`{Path(s).parent}`' for s in group[0]['sources'])})\n\n" + md_table(head, body))
    return "\n\n".join(parts)


SETTING_NOTE = (
    "The user-facing metrics lead: mean and p99 workflow latency, time to first token, and the recomputed "
    "share (prompt tokens prefilled: the work the cache did not save); GPU and host hits follow, all shares of "
    "prompt tokens. Speed-up: LRU's latency over the row's; comparisons are paired by seed (mean ± 95% CI of "
    "Student's t), and on imported traces a paired bootstrap over workflows follows (\"workflows:\", 95% interval); "
    "an interval that contains 1 (0 for a difference) reads \"no difference\". Bounds: the highest GPU hit rate "
    "and the lowest recomputed share that any policy of the setting and its prefetch class (no prefetch, or "
    "prefetch) can reach; each holds for every row of the setting and class (serving_integration/simulator/"
    "bound.py); gap closed = the row's share of the distance from LRU to that bound, on GPU hits and on "
    "recomputed tokens (n/a in runs made before the setting bounds). The oracle is a heuristic (Belady by "
    "distance in calls), not a bound. The last five columns split the mean workflow latency: tool time, "
    "admission queue, prefill, decode and PCIe loads, seconds per workflow.")


# -------------------------------------------------------------------- claims: one operating point per workload, chosen on val

# a configuration of a method: the knobs tuned on the validation split (memory point, K, gamma, prefetch)
MATCH = ("workload", "cost_model", "gpu_tokens", "concurrency", "horizon", "gamma", "end_signal_loss", "replicas", "routing",
         "scheduling", "partial_eviction")


def cell(r: dict, field: str, spec: str = "{:.2f}") -> str:
    """A row's metric as mean ± 95% CI over its seeds; n/a where the row has no such number."""
    return pm(per_seed(r, field), spec) if isinstance(r.get(field), (int, float)) else "n/a"


def pm(values: list[float], spec: str = "{:.2f}") -> str:
    """mean ± ci (one value: the value alone)."""
    return shown(over_seeds(values), spec)


def index_rows(rows, workloads) -> dict:
    """(split, MATCH values, policy, prefetch) -> row, for the plain policy rows of `workloads`; where
    several runs measured the same configuration (the memory sweep and the claims' own run at its
    operating point), the one with the most seeds, then the most workflows."""
    out = {}
    for r in rows:
        if is_main(r) and r["workload"].split("-")[0] in workloads:
            key = (split_of(r), tuple(r.get(k) for k in MATCH), r["policy"], r["prefetch"])
            if key not in out or measured(r) > measured(out[key]):
                out[key] = r
    return out


def measured(r: dict) -> tuple[int, int]:
    """How much a row measured: its seeds, then its replayed workflows (summed over the seeds)."""
    return len(seeds_of(r)), r.get("workflows") or 0


# generated-workload claims need this many seeds over this many test workflows each
CLAIM_SEEDS, CLAIM_WORKFLOWS = 10, 1000


def sample_text(r: dict) -> str:
    """`10 seeds x 1,000 test workflows`, flagged where a generated workload's claim has fewer than
    CLAIM_SEEDS x CLAIM_WORKFLOWS."""
    seeds, workflows = measured(r)
    per_seed_workflows = workflows // max(seeds, 1)
    text = f"{seeds} seed{'s' * (seeds > 1)} x {per_seed_workflows:,} test workflows"
    generated = r["workload"].split("-")[0] in GENERATED
    if generated and (seeds < CLAIM_SEEDS or per_seed_workflows < CLAIM_WORKFLOWS):
        text += f"; fewer than the {CLAIM_SEEDS} x {CLAIM_WORKFLOWS:,} a claim needs"
    return text


def point_text(match: tuple, prefetch: str) -> str:
    """An operating point as a claim names it: `150k GPU tokens, 32 live, prefetch conservative`."""
    at = dict(zip(MATCH, match))
    return f"{tokens_text(at['gpu_tokens'])} GPU tokens, {at['concurrency']} live, prefetch {prefetch}"


@dataclass(frozen=True)
class OperatingPoint:
    """Where every claim on a workload is made: its configuration (MATCH values), PBKV's prefetch mode,
    how it was chosen, and PBKV's and LRU's test rows there."""
    match: tuple
    prefetch: str
    how: str
    pbkv: dict
    lru: dict


CHOSEN_BY = "mean_workflow_latency_s"  # the user-facing metric the operating point is chosen by


def choose_on_val(rows, policy, base_policy, workloads, field, higher=True) -> dict[str, tuple | str | None]:
    """Per workload: the configuration of `policy` (memory point, K, gamma, prefetch mode) with the
    best mean ratio over `base_policy` (paired by seed) on the validation split, and its test rows:
    (MATCH values, prefetch, how, policy's test row, base's test row). Without val rows, a workload
    whose test rows hold a single configuration uses it (nothing to choose); otherwise a sentence
    saying why there is no choice."""
    index = index_rows(rows, workloads)
    base_prefetch = OWN_PREFETCH.get(base_policy, "none")
    chosen = {}
    for workload in sorted({key[1][0] for key in index}):
        def candidates(split):
            for (sp, match, pol, prefetch), r in index.items():
                base = index.get((sp, match, base_policy, base_prefetch))
                if sp == split and pol == policy and match[0] == workload and base is not None:
                    yield match, prefetch, r, base

        val = sorted(candidates("val"), key=lambda c: sort_key((*c[0], c[1])))  # ties: the smaller point
        test = list(candidates("test"))
        if val:
            match, prefetch, _, _ = max(val, key=lambda c: np.nanmean(paired_ratios(c[2], c[3], field, higher)))
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


def operating_points(rows) -> dict[str, OperatingPoint]:
    """Per workload, the one test configuration every claim and the headline use: where PBKV's mean
    workflow latency gains most over LRU's on the validation split (paired by seed). A workload run on
    test only, at several points, uses its smallest GPU size without prefetch (a rule fixed before
    looking at the results, not a choice on test)."""
    plain = single_server(rows)
    workloads = sorted({r["workload"].split("-")[0] for r in plain})
    index = index_rows(plain, workloads)
    points = {}
    for workload, pick in choose_on_val(plain, "pbkv", "lru", workloads, CHOSEN_BY, higher=False).items():
        if isinstance(pick, tuple):
            points[workload] = OperatingPoint(*pick)
            continue
        tested = sorted((m for (sp, m, pol, pf) in index if sp == "test" and pol == "pbkv" and pf == "none"
                         and m[0] == workload and ("test", m, "lru", "none") in index),
                        key=lambda m: sort_key((m[MATCH.index("gpu_tokens")], *m)))
        if tested:
            m = tested[0]
            points[workload] = OperatingPoint(m, "none", "no val split: the smallest GPU size, no prefetch",
                                              index[("test", m, "pbkv", "none")], index[("test", m, "lru", "none")])
    return points


def at_point(rows, point: OperatingPoint, policy: str, prefetch: str | None = None) -> dict | None:
    """`policy`'s test row at the operating point (its own prefetch mode unless one is given)."""
    index = index_rows(single_server(rows), {point.match[0].split("-")[0]})
    return index.get(("test", point.match, policy, prefetch or OWN_PREFETCH.get(policy, "none")))


def claim(rows, points, policy, base_policy, workloads, field) -> str:
    """Per workload of `workloads`, at its operating point: `policy` against `base_policy` on one
    metric (versus: paired by seed, the workflow bootstrap beside it on imported traces)."""
    parts = []
    for workload, point in points.items():
        if workload not in workloads:
            continue
        a = point.pbkv if policy == "pbkv" else at_point(rows, point, policy)
        b = point.lru if base_policy == "lru" else at_point(rows, point, base_policy)
        if a is None or b is None:
            parts.append(f"{workload}: no {policy if a is None else base_policy} row at its operating point")
            continue
        parts.append(f"**{workload}**: {versus(a, b, field)} ({sample_text(a)})")
    return "<br>".join(parts) or "not in these runs"


def latency_claim(rows, points, workloads) -> str:
    """PBKV against LRU at each operating point: speed-up of the mean and p99 workflow latency and of
    the mean TTFT."""
    parts = []
    for workload, point in points.items():
        if workload in workloads:
            a, b = point.pbkv, point.lru
            parts.append(f"**{workload}**: mean {versus(a, b, 'mean_workflow_latency_s')}, p99 "
                         f"{versus(a, b, 'p99_workflow_latency_s')}, TTFT {versus(a, b, 'mean_ttft_s')} "
                         f"({sample_text(a)})")
    return "<br>".join(parts) or "not in these runs"


def recompute_claim(rows, points, workloads) -> str:
    parts = []
    for workload, point in points.items():
        if workload in workloads:
            a, b = point.pbkv, point.lru
            parts.append(f"**{workload}**: {cell(a, 'recompute_rate', '{:.1%}')} against "
                         f"{cell(b, 'recompute_rate', '{:.1%}')}, {versus(a, b, 'recompute_rate')} points")
    return "<br>".join(parts) or "not in these runs"


def hit_rates_point(rows, points) -> str:
    """LRU / lifecycle-only / PBKV GPU hit rates (and host hits) at each dynamic workload's operating
    point."""
    parts = []
    for workload, point in points.items():
        if workload not in DYNAMIC:
            continue
        hits = [("LRU", point.lru), ("lifecycle-only", at_point(rows, point, "pbkv_lae")), ("PBKV", point.pbkv)]
        parts.append(f"**{workload}**: " + ", ".join(f"{name} {cell(r, 'hit_rate', '{:.1%}')} (host {host_hits(r)})"
                                                     for name, r in hits if r))
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


# the claims in the order the table gives them (user-facing first): (name, the paper's number, ours)
CLAIMS = (
    ("PBKV latency vs LRU (speed-up: mean, p99 workflow latency, TTFT)", PAPER["latency_vs_lru"],
     lambda rows, points: latency_claim(rows, points, DYNAMIC)),
    ("PBKV recomputed prompt tokens vs LRU (share; difference in points)", "not reported",
     lambda rows, points: recompute_claim(rows, points, DYNAMIC)),
    ("PBKV GPU hit rate vs LRU", PAPER["hit_vs_lru"],
     lambda rows, points: claim(rows, points, "pbkv", "lru", DYNAMIC, "hit_rate")),
    ("lifecycle-only (pbkv_lae) hit rate vs LRU", PAPER["lae_hit_vs_lru"],
     lambda rows, points: claim(rows, points, "pbkv_lae", "lru", DYNAMIC, "hit_rate")),
    ("static workload: PBKV latency vs KVFlow as its public code runs it (its own prefetch)",
     PAPER["static_latency_vs_kvflow"],
     lambda rows, points: claim(rows, points, "pbkv", "kvflow", STATIC, "mean_workflow_latency_s")),
    ("static workload: PBKV hit rate vs KVFlow as its public code runs it", PAPER["static_hit_vs_kvflow"],
     lambda rows, points: claim(rows, points, "pbkv", "kvflow", STATIC, "hit_rate")),
    ("static workload: PBKV latency vs the idealised KVFlow (kvflow_ideal, aggressive prefetch)",
     PAPER["static_latency_vs_kvflow_ideal"],
     lambda rows, points: claim(rows, points, "pbkv", "kvflow_ideal", STATIC, "mean_workflow_latency_s")),
    ("static workload: PBKV hit rate vs the idealised KVFlow", PAPER["static_hit_vs_kvflow_ideal"],
     lambda rows, points: claim(rows, points, "pbkv", "kvflow_ideal", STATIC, "hit_rate")),
    ("LRU / lifecycle-only / PBKV GPU hit rates (host hits) at the operating point", PAPER["hit_rates_point"],
     hit_rates_point),
    ("prediction noise and prefetch", PAPER["noise"], lambda rows, points: noise_claim(rows)),
)


def operating_points_text(points: dict[str, OperatingPoint]) -> str:
    """One line naming each workload's operating point and how it was chosen."""
    if not points:
        return "No workload with PBKV and LRU on the test split in these runs."
    return "Operating points: " + "; ".join(f"**{w}** {point_text(p.match, p.prefetch)} ({p.how})"
                                            for w, p in sorted(points.items())) + "."


def claims_table(rows) -> str:
    """The operating point of each workload, then the paper's claims beside ours, every one at it."""
    points = operating_points(rows)
    table = md_table(["claim", "paper", "ours: test split, at the operating point"],
                     [[name, paper, ours(rows, points)] for name, paper, ours in CLAIMS])
    return operating_points_text(points) + "\n\n" + table


CLAIMS_NOTE = ("Every claim on a workload is made at one operating point (GPU memory point and PBKV's prefetch "
               "mode): the one where PBKV's mean workflow latency gained most over LRU's on the validation split "
               "(`split=val`), measured on the test split. Comparisons are paired by seed: mean ± the 95% "
               "half-width of Student's t over the seeds (one seed: no interval); on imported traces "
               "(Who&When, tau-bench: the data is fixed, a seed changes the split and the replay) a paired "
               "bootstrap over the workflows follows (\"workflows:\", 95% BCa interval, scipy.stats.bootstrap). "
               "An interval that contains 1 (0 for a difference) reads \"no difference\". Speed-up: LRU's (or "
               "KVFlow's) latency over PBKV's.")


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
        base = per_seed(by_eps[0.0], "hit_rate")
        seed_regrets = [[b - h for b, h in zip(base, per_seed(by_eps[e], "hit_rate"))] for e in eps]
        fits.append((key, name, eps, regret, slope, intercept, seed_regrets, by_eps[0.0]))
    head = ["setting", "policy", "noise levels", "regret slope", "intercept", "R^2",
            "lowest hit rate minus pbkv_lae's"]
    return (md_table(head, body) if body else ""), fits


# -------------------------------------------------------------------- robust PBKV: the trust modes, per seed

ROBUST_KEEP = 0.95  # and keep this share of always's gain over LRU wherever always wins by more than its interval
JUDGED = ("outcome", "accuracy")  # the trust modes checked against lru, pbkv_lae and always (cache/trust.py)
TRUSTING = ("pbkv", "pbkv_time")  # the policies with trust modes (policies._JudgedPolicy)


def robustness_rows(rows) -> list[tuple]:
    """(setting, policy, predictor, noise, noise kind, lru, pbkv_lae, {trust mode: row}) for every
    test setting with plain lru and pbkv_lae rows, pbkv or pbkv_time under always and under at least
    one judged trust mode, no prefetch."""
    groups = defaultdict(dict)
    for r in rows:
        if r["comparison"] != "policies" or split_of(r) != "test" or r["prefetch"] != "none":
            continue
        if r["policy"] in ("lru", "pbkv_lae") and not r.get("noise"):
            groups[setting_of(r)].setdefault(r["policy"], r)
        elif r["policy"] in TRUSTING and r.get("predictor") != "perfect" and r.get("trust") in (*JUDGED, "always"):
            kind = r.get("noise_kind") if r.get("noise") else "none"
            groups[setting_of(r)].setdefault((r["policy"], r["predictor"], r.get("noise") or 0.0, kind), {}).setdefault(
                r["trust"], r)
    out = []
    for key, group in sorted(groups.items(), key=lambda item: sort_key(item[0])):  # not in load order
        if "lru" not in group or "pbkv_lae" not in group:
            continue
        for policy, pred, noise, kind in sorted(k for k in group if isinstance(k, tuple)):
            modes = group[(policy, pred, noise, kind)]
            if "always" in modes and any(m in modes for m in JUDGED):
                out.append((key, policy, pred, noise, kind, group["lru"], group["pbkv_lae"], modes))
    return out


def always_wins(lru: list[float], always: list[float]) -> bool:
    """Whether always's gain over LRU is larger than its 95% interval over the seeds (for one seed:
    any gain)."""
    mean, half = mean_ci([w - l for l, w in zip(lru, always)])
    return mean > (half if half is not None else 1e-9)


def trust_verdict(lru, lae, judged, always, wins: bool) -> tuple[list, list, float, bool, bool]:
    """Per seed: the judged mode minus max(lru, pbkv_lae) and its share of always's gain over LRU (nan
    where always gains nothing in that seed); its share of always's mean gain over the seeds (nan where
    that is none); whether the criteria hold (at most 1 point below in every seed; where always wins by
    more than its interval, 95% of always's gain, the gain that interval is of: the mean over the
    seeds), and whether they hold with the share in every seed too (stricter: a seed where always
    gains a few hundredths of a point has a share that is noise, docs/serving.md section 10)."""
    margin = [ai - max(li, ei) for li, ei, ai in zip(lru, lae, judged)]
    keep = [(ai - li) / (wi - li) if wi - li > 1e-9 else math.nan for li, ai, wi in zip(lru, judged, always)]
    kept = [k >= ROBUST_KEEP if not math.isnan(k) else ai >= wi - 1e-12 for k, ai, wi in zip(keep, judged, always)]
    gain = sum(wi - li for li, wi in zip(lru, always)) / len(lru)
    mean_keep = sum(ai - li for li, ai in zip(lru, judged)) / len(lru) / gain if gain > 1e-9 else math.nan
    near = all(m >= -ROBUST_TOLERANCE - 1e-12 for m in margin)
    return margin, keep, mean_keep, near and (not wins or mean_keep >= ROBUST_KEEP), near and (not wins or all(kept))


def robustness_check(rows) -> str:
    """Per seed: each judged trust mode minus max(lru, pbkv_lae) in points, and the share of always's
    gain over LRU it keeps, per seed and of the mean gain; each against its criterion (trust_verdict)."""
    # (policy, mode) -> [rows meeting both criteria, rows meeting them with the share in every seed, rows]
    body, met = [], {(policy, mode): [0, 0, 0] for policy in TRUSTING for mode in JUDGED}
    robust = robustness_rows(rows)
    others = other_varying(robust)
    for key, policy, pred, noise, kind, lru, lae, modes in robust:
        at = dict(zip(SETTING, key))
        l, e, w = (per_seed(r, "hit_rate") for r in (lru, lae, modes["always"]))
        wins = always_wins(l, w)
        seeds = modes["always"].get("seeds") or [modes["always"].get("seed")]
        cells = [*robust_setting_cells(at, others), policy, pred,
                 "none" if not noise else f"{kind} eps={noise:g}", ", ".join(str(x) for x in seeds),
                 " / ".join(f"{x:.1%}" for x in l), " / ".join(f"{x:.1%}" for x in e),
                 " / ".join(f"{x:.1%}" for x in w)]
        for mode in JUDGED:
            if mode not in modes:
                cells += ["n/a"] * 4
                continue
            a = per_seed(modes[mode], "hit_rate")
            margin, keep, mean_keep, ok, every_seed = trust_verdict(l, e, a, w, wins)
            met[policy, mode][0] += ok
            met[policy, mode][1] += every_seed
            met[policy, mode][2] += 1
            # the mean share truncated, not rounded: a hair under the 95% criterion must not read 95.0%
            mean_cell = (f"; mean {math.floor(mean_keep * 1000) / 10:.1f}%" if wins
                         else " (always within its interval: not checked)")
            cells += [" / ".join(f"{x:.1%}" for x in a), " / ".join(f"{100 * m:+.1f}" for m in margin),
                      " / ".join("no gain" if math.isnan(k) else f"{k:.0%}" for k in keep) + mean_cell,
                      ("yes" if every_seed else "yes (not in every seed)") if ok else "**no**"]
        body.append(cells)
    if not body:
        return ("No setting with lru, pbkv_lae, and pbkv or pbkv_time under always and under outcome or accuracy "
                "trust in these runs.")
    head = ["workload", "GPU tokens", "host tier", "eviction", *(["setting"] if others else []), "policy",
            "predictor", "noise", "seeds", "lru", "pbkv_lae", "always"]
    for mode in JUDGED:
        head += [mode, f"{mode} - max(lru, pbkv_lae) (points)", f"{mode}'s share of always's gain",
                 f"{mode}: criteria met"]
    tally = "; ".join(f"{policy} under {mode} trust in {ok} of {n} rows"
                      for (policy, mode), (ok, _, n) in met.items() if n)
    strict = "; ".join(f"{policy} under {mode} trust in {ok} of {n}" for (policy, mode), (_, ok, n) in met.items() if n)
    return (f"Both criteria met (within 1 point in every seed; 95% of always's mean gain where it wins): {tally}. "
            f"With 95% of always's gain in every seed too: {strict}.\n\n" + md_table(head, body))


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
    robust = robustness_rows(rows)
    if not robust and not any(r.get("predictor_top1_k1") is not None for r in rows):
        return ""
    fidelity = shadow_fidelity(robust, other_varying(robust))
    parts = [ROBUST_NOTE, robustness_check(rows), predictor_check(rows)]
    return "\n\n".join(parts + (["### Outcome trust's shadows against the real replays", fidelity] if fidelity else []))


ROBUST_NOTE = (
    "Per seed (values separated by /, in the order of the seeds column), test split, no prefetch: pbkv (and "
    "pbkv_time, the time-aware policy, where its runs have it) under outcome trust (it follows whichever of its "
    "score order and lifecycle-aware LRU has more GPU hits on shadow "
    "caches that follow the server's calls) and under accuracy trust (it falls back to lifecycle-aware LRU while "
    "the predictions it checks online are poor), each against the better of lru and pbkv_lae, in points of GPU "
    "hit rate (criterion: >= -1 in every seed), and the share of the gain of pbkv under always trust (the "
    "paper's policy; for pbkv_time its own order always followed) over LRU that it keeps, per seed and of the "
    "mean gain over the seeds (criterion where always's gain over LRU exceeds its 95% interval over the seeds: "
    ">= 95% of that mean gain; \"yes (not in every seed)\": met, but some seed keeps less than 95% of its own "
    "gain, which the stricter count above the table also requires; \"no gain\": always gains nothing over LRU "
    "in that seed, counted as kept when the mode is no worse than always). "
    "The predictor table gives the test top-1 at k=1 of the predictor behind pbkv beside Markov's, per seed.")


# -------------------------------------------------------------------- plots

MAX_SERIES = 8  # lines per plot; the other policies are in the tables below it


def plot_rank(r: dict) -> int:
    """Which policies a plot draws first: the baselines, then PBKV and the references."""
    order = [("lru", "none"), ("kvflow", "kvflow"), ("kvflow_ideal", "aggressive"), ("pbkv_lae", "none"),
             ("pbkv", "none"), ("pbkv_time", "none"), ("continuum", "none"), ("lru_prefetch", "last_call"),
             ("pbkv_perfect", "none"), ("oracle", "none"), ("pbkv", "conservative")]
    key = (r["policy"], r["prefetch"])
    rank = order.index(key) if key in order else len(order)
    always = r["policy"] == "pbkv" and r.get("trust") in ("always", "accuracy")  # the alternatives, after outcome
    return rank + (len(order) if always or r.get("noise_kind") == "adversarial" else 0)


def chosen_series(series: dict[str, list], rows_of: dict[str, dict], n: int) -> dict[str, list]:
    """The `n` series a plot shows, by plot_rank of the row behind each label."""
    names = sorted(series, key=lambda lab: (plot_rank(rows_of[lab]), lab))[:n]
    return {lab: series[lab] for lab in names}


def line_plot(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, list]]],
              working_set: float | None = None, percent: bool = False, dashed: tuple[str, ...] = ()) -> None:
    """Lines of mean over the seeds with the 95% interval as a band; `series` maps a label to
    (x, per-seed values) points. With `working_set`, a second x axis shows x as its fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.cm.tab10.colors
    for i, (lab, points) in enumerate(series.items()):
        points = sorted(points, key=lambda p: p[0])
        xs = np.array([x for x, _ in points], dtype=float)
        stats = [mean_ci(values) for _, values in points]
        ys = np.array([m for m, _ in stats])
        ci = np.array([c or 0.0 for _, c in stats])
        color = "0.35" if lab in dashed else colors[i % 10]
        ax.plot(xs, ys, marker="o", ms=4, color=color, label=lab, linestyle="--" if lab in dashed else "-")
        if ci.any():  # a share cannot leave [0, 1], a time or a ratio cannot fall below 0: the band is clipped
            low, high = (np.clip(ys - ci, 0, 1), np.clip(ys + ci, 0, 1)) if percent else (np.maximum(ys - ci, 0), ys + ci)
            ax.fill_between(xs, low, high, color=color, alpha=0.18, linewidth=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if "tokens" in xlabel:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: tokens_text(x)))
    if percent:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if working_set:
        top = ax.secondary_xaxis("top", functions=(lambda x: x / working_set, lambda f: f * working_set))
        top.set_xlabel("share of the live working set", fontsize=8)
        top.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def sweep_plots(rows, out: Path) -> list[tuple[str, str, str]]:
    """Plots of each sweep in the rows, one per (workload, split, the other settings):
    (file name, caption, split). GPU memory and concurrency sweeps draw hit rate and latency against
    the swept size (the memory axis also as a share of the live working set); a horizon sweep draws
    PBKV's hit rate against K, one line per gamma."""
    made: list[tuple[str, str, str]] = []

    def unique(name: str) -> str:
        stem, n = name[:-4], 1
        while any(m[0] == name for m in made):
            n += 1
            name = f"{stem}_{n}.png"
        return name

    for axis, xlabel, what in (("gpu_tokens", "GPU KV capacity (tokens)", "GPU KV capacity"),
                               ("concurrency", "live workflows", "live workflows")):
        others = [k for k in SETTING if k not in (axis, "calls")]
        groups = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if is_main(r):
                groups[tuple(r.get(k) for k in others)][label(r)].append(r)
        # the worded settings that tell one plot of a workload from another (host tier, eviction unit, ...)
        told = [k for k in WORDED if k in others and k != "workload"
                and len({key[others.index(k)] for key in groups}) > 1]
        for key, by_label in sorted(groups.items(), key=lambda item: sort_key(item[0])):
            if len({r[axis] for pts in by_label.values() for r in pts}) < 2:
                continue
            by_label = {lab: pts for lab, pts in by_label.items() if len(pts) > 1}
            if not by_label:
                continue
            at = dict(zip(others, key))
            workload, split = at["workload"], at["split"]
            rows_of = {lab: pts[0] for lab, pts in by_label.items()}
            sets = [r.get("live_working_set_tokens") for pts in by_label.values() for r in pts]
            working_set = float(np.mean(sets)) if axis == "gpu_tokens" and all(sets) else None
            lru = next((pts for lab, pts in by_label.items() if rows_of[lab]["policy"] == "lru"), None)
            lru_at = {r[axis]: r for r in lru or []}
            for field, ylabel, tag in (("hit_rate", "GPU hit rate", "hit"),
                                       ("mean_workflow_latency_s", "mean workflow latency (s)", "latency")):
                series = {lab: [(r[axis], per_seed(r, field)) for r in pts] for lab, pts in by_label.items()}
                if tag == "latency" and all(r[axis] in lru_at for pts in by_label.values() for r in pts):
                    # latency differs more between the seeds' workloads than between policies: paired
                    # by seed against LRU's, the policies' difference is what the band shows
                    ylabel = "speed-up over LRU (its latency / the policy's)"
                    series = {lab: [(r[axis], paired_ratios(r, lru_at[r[axis]], field, False)) for r in pts]
                              for lab, pts in by_label.items()}
                bound = {}
                if field == "hit_rate":
                    series = chosen_series(series, rows_of, MAX_SERIES - 1)
                    pbkv = next((pts for lab, pts in by_label.items() if rows_of[lab]["policy"] == "pbkv"
                                 and rows_of[lab]["prefetch"] == "none"), None)
                    if pbkv and all(r.get("setting_bound_hit_rate") is not None for r in pbkv):
                        # pbkv's row holds the bound of the no-prefetch class: a plotted policy that
                        # prefetches is bounded by its own class's, which can be higher
                        prefetching = any(rows_of[lab]["prefetch"] != "none" for lab in series)
                        named = ("upper bound for policies without prefetch" if prefetching
                                 else "upper bound (every policy of the setting)")
                        bound = {named: [(r[axis], per_seed(r, "setting_bound_hit_rate")) for r in pbkv]}
                    elif pbkv and all(r.get("bound_hit_rate") is not None for r in pbkv):  # runs before it
                        bound = {"upper bound (PBKV's requests)": [(r[axis], per_seed(r, "bound_hit_rate"))
                                                                   for r in pbkv]}
                else:
                    series = chosen_series(series, rows_of, MAX_SERIES)
                name = unique(f"{workload}_{split}_{axis}_{tag}.png")
                which = ", ".join(in_words(k, at[k]) for k in told)
                title = f"{workload}, {split} split{f' ({which})' if which else ''}: {ylabel.split(' (')[0]} against {what}"
                line_plot(out / name, title, xlabel, ylabel, {**series, **bound}, working_set,
                          percent=field == "hit_rate", dashed=tuple(bound))
                made.append((name, title, split))
    lookahead = defaultdict(list)  # horizon x gamma, one line per gamma
    for r in rows:
        if is_main(r) and r["policy"] == "pbkv" and r["prefetch"] == "none":
            lookahead[(r["workload"], split_of(r), r["gpu_tokens"], r["concurrency"], r["predictor"])].append(r)
    for (workload, split, gpu, conc, predictor), group in sorted(lookahead.items(), key=lambda i: sort_key(i[0])):
        if len({r["horizon"] for r in group}) > 1:
            gammas = sorted({r["gamma"] for r in group})[:MAX_SERIES]
            name = unique(f"{workload}_{split}_horizon_gamma.png")
            title = (f"{workload}, {split} split ({tokens_text(gpu)} GPU tokens, {conc} live, {predictor}): "
                     "PBKV hit rate against K")
            line_plot(out / name, title, "horizon K", "GPU hit rate",
                      {f"gamma={g}": [(r["horizon"], per_seed(r, "hit_rate")) for r in group if r["gamma"] == g]
                       for g in gammas}, percent=True)
            made.append((name, title, split))
    return made


def noise_plot(fits, out: Path) -> list[tuple[str, str, str]]:
    """Per setting: the hit-rate regret against noise eps of at most MAX_SERIES policies (mean, 95%
    band over the seeds) with its linear fit dashed in the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    by_setting = defaultdict(list)
    for fit in fits:
        by_setting[fit[0]].append(fit)
    made = []
    for key, group in sorted(by_setting.items(), key=lambda item: sort_key(item[0])):
        at = dict(zip(SETTING, key))
        group = sorted(group, key=lambda f: (plot_rank(f[7]), f[1]))[:MAX_SERIES]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for i, (_, name, eps, regret, slope, intercept, seed_regrets, _) in enumerate(group):
            color = plt.cm.tab10.colors[i % 10]
            stats = [mean_ci(values) for values in seed_regrets]
            ys, ci = np.array([m for m, _ in stats]), np.array([c or 0.0 for _, c in stats])
            ax.plot(eps, ys, marker="o", ms=4, color=color, label=name)
            if ci.any():
                ax.fill_between(eps, ys - ci, ys + ci, color=color, alpha=0.18, linewidth=0)
            ax.plot(eps, slope * eps + intercept, linestyle="--", color=color, linewidth=1)
        ax.set_xlabel("prediction noise eps (share of each prediction replaced)")
        ax.set_ylabel("GPU hit-rate regret against eps = 0")
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        title = (f"{at['workload']}, {at['split']} split, {tokens_text(at['gpu_tokens'])} GPU tokens: "
                 "regret against prediction noise (dashed: linear fit)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{at['workload']}_{at['split']}_noise_regret{'_' + str(len(made) + 1) if made else ''}.png"
        fig.savefig(out / name, dpi=110, metadata={"Software": None})
        plt.close(fig)
        made.append((name, title, at["split"]))
    return made


def backbone_and_kv_plots(rows, out: Path) -> list[tuple[str, str, str]]:
    import matplotlib

    matplotlib.use("Agg")
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
        title = (f"{at['workload']}, {at['split']} split, {tokens_text(at['gpu_tokens'])} GPU tokens: "
                 "PBKV by predictor backbone")
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        name = f"backbones_{key[0]}_{at['split']}_{len(made)}.png"
        fig.savefig(out / name, dpi=110, metadata={"Software": None})
        plt.close(fig)
        made.append((name, title, at["split"]))
    kv = [r for r in rows if r["comparison"] == "kv"]
    if kv:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([f"{r['workload']}\n{r['layout']}" for r in kv], [r["reuse_rate"] for r in kv])
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylabel("prefix hit rate")
        ax.set_title("KV pruning: prefix-cache hits by layout")
        fig.tight_layout()
        fig.savefig(out / "kv_layouts.png", dpi=110, metadata={"Software": None})
        plt.close(fig)
        made.append(("kv_layouts.png", "KV pruning: prefix-cache hits by layout", split_of(kv[0])))
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
            body.append([str(rep), routing, ev, cell(r, "mean_workflow_latency_s"), cell(r, "p99_workflow_latency_s"),
                         cell(r, "mean_ttft_s", "{:.3f}"), cell(r, "recompute_rate", "{:.1%}"),
                         cell(r, "hit_rate", "{:.1%}"), host_hits(r), cell(r, "load_imbalance"),
                         cell(r, "migrations", "{:.0f}")])
        head = ["replicas", "routing", "eviction", "mean latency (s)", "p99 latency (s)", "mean TTFT (s)",
                "recompute rate", "GPU hit rate", "host hits", "load imbalance", "migrations"]
        seeds = next(iter(combos.values())).get("seeds") or [next(iter(combos.values())).get("seed")]
        parts.append(f"### {workload}: {n_wf} workflows, total gpu_tokens={gpu}, concurrency={conc}, {cost}, "
                     f"seed(s) {seeds}\n\n" + md_table(head, body))
        found = cluster_best(combos, at) if workload.split("-")[0] in workloads else None
        if found:
            routing, ev, top, ratios = found
            vs = "; ".join(f"hit rate x {shown(over_seeds(h), null=1.0)}, latency speed-up "
                           f"{shown(over_seeds(l), null=1.0)} over {b[0]} + {b[1]}"
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


# -------------------------------------------------------------------- headline

def single_server(rows) -> list[dict]:
    """Plain policy rows of one server with every end signal delivered: where the headline and the
    claims compare policies (the cluster and end-signal experiments have their own pages)."""
    return [r for r in rows if is_main(r) and r.get("replicas", 1) == 1 and not r.get("end_signal_loss")]


def of_setting_bound(r: dict) -> str:
    """The row's GPU hit rate over its setting's bound (setting_bound_hit_rate), per seed."""
    if not isinstance(r.get("setting_bound_hit_rate"), (int, float)):
        return "n/a"
    return pm([h / b for h, b in zip(per_seed(r, "hit_rate"), per_seed(r, "setting_bound_hit_rate")) if b], "{:.0%}")


def headline_table(rows) -> str:
    """One line per workload at its operating point (operating_points), test split, mean ± 95% CI
    over the seeds (comparisons paired by seed, the workflow bootstrap beside them on imported
    traces): PBKV's mean workflow latency, its speed-up over LRU (mean and p99), TTFT and recomputed
    share against LRU's first; GPU and host hits, the share of the setting's bound and the speed-up
    over both KVFlows (each with its own prefetch) after."""
    body = []
    for workload, point in sorted(operating_points(rows).items()):
        pbkv, lru = point.pbkv, point.lru
        kvflow, ideal = at_point(rows, point, "kvflow"), at_point(rows, point, "kvflow_ideal")
        body.append([workload, f"{point_text(point.match, point.prefetch)}, {sample_text(pbkv)}",
                     cell(pbkv, "mean_workflow_latency_s"), versus(pbkv, lru, "mean_workflow_latency_s"),
                     versus(pbkv, lru, "p99_workflow_latency_s"), cell(pbkv, "mean_ttft_s", "{:.3f}"),
                     cell(pbkv, "recompute_rate", "{:.1%}"), cell(lru, "recompute_rate", "{:.1%}"),
                     versus(pbkv, lru, "recompute_rate"), cell(pbkv, "hit_rate", "{:.1%}"),
                     versus(pbkv, lru, "hit_rate"), host_hits(pbkv), of_setting_bound(pbkv),
                     versus(pbkv, kvflow, "mean_workflow_latency_s"), versus(pbkv, ideal, "mean_workflow_latency_s")])
    if not body:
        return "No workload with PBKV and LRU on the test split in these runs."
    head = ["workload", "operating point", "PBKV latency (s)", "speed-up vs LRU", "p99 speed-up", "PBKV TTFT (s)",
            "recomputed: PBKV", "LRU", "PBKV minus LRU (points)", "PBKV GPU hit rate", "x LRU", "host hits",
            "of the bound", "speed-up vs KVFlow", "vs KVFlow ideal"]
    return md_table(head, body)


HEADLINE_NOTE = (
    "Test split, at each workload's operating point: the GPU memory point and PBKV prefetch mode where PBKV's "
    "mean workflow latency gained most over LRU's on the validation split (workloads run without a validation "
    "split: their smallest GPU size, no prefetch). Mean ± 95% CI over the seeds (Student t), comparisons paired "
    "by seed; on imported traces the paired bootstrap over workflows follows (\"workflows:\"); an interval that "
    "contains 1 (0 for a difference) reads \"no difference\". Speed-up: the other policy's latency over PBKV's "
    "(KVFlow as its public code runs it, and the idealised kvflow_ideal, each with its own prefetch; "
    "docs/baselines/kvflow.md); recomputed: the share of prompt tokens prefilled (neither a GPU nor a host hit); "
    "host hits: the share read back from the host tier; of the bound: PBKV's GPU hit rate over the highest any "
    "policy of the setting and prefetch class can reach (simulator/bound.py; n/a in older runs).")


def policy_bars(rows, out: Path, split: str = "test", groups: int = 8) -> list[tuple[str, str, str]]:
    """For a report with no sweep: GPU hit rate of at most MAX_SERIES policies (95% interval as error
    bars) at each of its `split` settings (at most `groups` of them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    by_setting = defaultdict(dict)
    for r in rows:
        if is_main(r) and split_of(r) == split:
            by_setting[setting_of(r)].setdefault(label(r), r)
    if not by_setting:
        return []
    keys = sorted(by_setting, key=sort_key)[:groups]
    at = [dict(zip(SETTING, k)) for k in keys]
    unusual = [k for k, usual in (("end_signal_loss", (0, 0.0, None)), ("replicas", (1, None)), ("routing", ("none",)))
               if any(a[k] not in usual for a in at)]  # named under every group, so the plot says what it shows
    varying = [k for k in WORDED if k in varying_keys(keys) or k in unusual]
    ranked = sorted({lab: r for k in keys for lab, r in by_setting[k].items()}.items(),
                    key=lambda item: (plot_rank(item[1]), item[0]))
    labels = [lab for lab, _ in ranked[:MAX_SERIES]]
    seeded = any(len(per_seed(r, "hit_rate")) > 1 for k in keys for r in by_setting[k].values())
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        stats = [mean_ci(per_seed(by_setting[k][lab], "hit_rate")) if lab in by_setting[k] else (math.nan, None)
                 for k in keys]
        xs = np.arange(len(keys)) + (i - (len(labels) - 1) / 2) * width
        means, cis = np.array([m for m, _ in stats]), np.array([c or 0.0 for _, c in stats])
        below, above = np.minimum(cis, means), np.minimum(cis, 1 - means)  # a share stays in [0, 1]
        ax.bar(xs, means, width, yerr=[below, above] if seeded else None, capsize=2, label=lab,
               color=plt.cm.tab10.colors[i % 10])
    ax.set_xticks(np.arange(len(keys)), [setting_heading(k, varying).replace(", ", "\n") for k in keys], fontsize=7)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylabel("GPU hit rate")
    workloads = sorted({dict(zip(SETTING, k))["workload"] for k in keys})
    title = f"{', '.join(workloads)}, {split} split: GPU hit rate by policy" + (" (95% interval)" if seeded else ", one seed")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    name = f"{split}_policies.png"
    fig.savefig(out / name, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return [(name, title, split)]


# -------------------------------------------------------------------- the report

def splits_in(rows) -> list[str]:
    """The replayed splits, test first and val last (the appendix)."""
    found = {split_of(r) for r in rows}
    return sorted(found, key=lambda s: (s != "test", s == "val", s))


def report_body(rows, tmp: Path, claims: bool = True) -> tuple[str, list[tuple[str, str, str]]]:
    """The report's sections (Markdown, plots written into `tmp`): the paper's claims (unless
    `claims` is False: the results page shows them once), the experiment's own sections, then per
    split its plots and one table per setting, test first, validation in an appendix."""
    regret_md, fits = regret_fit(rows)
    plots = sweep_plots(rows, tmp) + noise_plot(fits, tmp) + backbone_and_kv_plots(rows, tmp)
    if not plots:
        plots = policy_bars(rows, tmp, splits_in(rows)[0])
    from serving_integration.experiments.admission import admission_section
    from serving_integration.experiments.eviction_unit import eviction_unit_section
    from serving_integration.experiments.headroom import headroom_section
    from serving_integration.experiments.regime import regime_section
    from serving_integration.experiments.time_aware import time_aware_section

    optional = [("## Time-aware eviction: pbkv_time against the field", time_aware_section(rows, tmp)),
                ("## Admission order against eviction order", admission_section(rows, tmp)),
                ("## Eviction unit: whole nodes against a victim's tail", eviction_unit_section(rows)),
                ("## Where prediction pays: GPU memory x host tier x live workflows", regime_section(rows, tmp)),
                ("## Where the headroom lies: the eviction bound against each row", headroom_section(rows)),
                ("## Prediction noise: regret and its linear fit", regret_md),
                ("## Robust PBKV: the trust modes per seed", robust_section(rows)),
                ("## KV pruning (IntentKV)", kv_table(rows)),
                ("## A cluster: replicas x routing x eviction", cluster_section(rows))]
    parts = ["## The paper's claims beside ours", CLAIMS_NOTE, claims_table(rows)] if claims else []
    parts += [part for heading, body in optional if body for part in (heading, body)]
    for split in splits_in(rows):
        appendix = split == "val" and len(splits_in(rows)) > 1
        shown = [f"![{title}]({name})" for name, title, sp in plots if sp == split]
        heading = "## Appendix: validation split" if appendix else f"## {split.capitalize()} split"
        parts += [heading, *shown, SETTING_NOTE if not appendix else
                  "The knobs of the claims and of the headline are chosen on these rows.",
                  setting_tables(rows, split)]
    return "\n\n".join(p for p in parts if p), plots


COMMAND = "serving_integration.experiments.report"


def build(paths: list[str], out: Path, claims: bool = True) -> Path:
    """The report folder `out`, replaced all at once (data.atomic): never one of the runs read, a
    folder holding them, nor a folder this command did not make."""
    check_output(out, paths)
    check_replaceable(out, (COMMAND,))
    rows, files = load_rows(paths)
    if not rows:
        raise ValueError(f"no rows in {', '.join(map(str, files))}: nothing to report")
    with atomic_dir(out, COMMAND, inputs=paths) as tmp:
        body, _ = report_body(rows, tmp, claims)
        md = "\n\n".join(["# PBKV report",
                          f"Built from {len(files)} summary.json file(s), {len(rows)} rows:\n\n" + sources(files),
                          body]) + "\n"
        (tmp / "report.md").write_text(md)
        import markdown

        html = markdown.markdown(md, extensions=["tables"])
        (tmp / "report.html").write_text(
            "<!doctype html><meta charset='utf-8'><title>PBKV report</title><style>body{font-family:sans-serif;"
            "max-width:1100px;margin:auto}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
            "padding:3px 6px}img{max-width:100%}</style>\n" + html)
    return out / "report.md"


@dataclass
class ReportConfig:
    """python -m serving_integration.experiments.report runs=[RUN_OR_SWEEP_DIR,...] out=REPORT_DIR"""
    runs: Any = knob(help="evaluate.py run folders, sweep folders or summary.json files (a list, or one path)")
    out: str = knob(help="the report folder (replaced as a whole; only one this command made)")

    def __post_init__(self):
        if isinstance(self.runs, str):
            self.runs = [self.runs]
        if not isinstance(self.runs, (list, tuple)) or not self.runs or not all(isinstance(r, str) and r
                                                                                for r in self.runs):
            raise ConfigError(f"runs={shown_knob(self.runs)}: should be a path or a non-empty list of paths")
        check(self)


register(None, ReportConfig, "report_schema")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body():
        args = build_knobs(compose_config("report", argv), ReportConfig)
        path = build(args.runs, Path(args.out))
        print(f"report: {path} and {path.with_suffix('.html')}")
    return run_reported(body)


if __name__ == "__main__":
    sys.exit(main())
