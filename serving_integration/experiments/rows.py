"""The summary row: its schema (the labels every row carries, with their defaults, and the metrics
every row has) and the rules across rows (gap closed against LRU, the mean over seeds). Used by
evaluate.py, the bench client, validate_sim, the report and the tests; how rows are printed and
plotted is presentation.py's."""

from __future__ import annotations

import numpy as np

# A summary.json row = these labels (with their defaults) + the replay's metrics
# (serving_integration.cache.metrics.replay_metrics, and a few more from the simulator or the server).
ROW_LABELS = {
    "comparison": "policies",  # policies | kv (IntentKV pruning rows)
    "workload": None, "policy": None, "prefetch": "none", "gpu_tokens": None, "concurrency": None,
    "noise": 0.0, "noise_kind": "none", "predictor": "none", "trust": "none", "horizon": None, "gamma": None,
    "layout": "none", "kv_method": "none", "kv_budget": None,
    "cost_model": None, "workflows": 0, "calls": 0, "seed": 0,
    "split": "test",  # the replayed split: knobs are chosen on val, claims made on test
    "end_signal_loss": 0.0,  # share of end-of-workflow signals lost (the simulator's sim.end_signal_loss)
    "replicas": 1, "routing": "none",  # simulated servers behind the router, and its routing policy
    "hicache_ratio": None,  # host KV tier = ratio x GPU tokens (0: none; None: a row that does not say)
    # the GPU size as a fraction of the live working set (sim.gpu_working_set_fraction; None: given in tokens);
    # gpu_tokens separates the settings, so the memory plots draw fractions on one GPU-size axis
    "gpu_working_set_fraction": None,
}
# rows compare only within one setting: the same replayed workflows under the same sizes
SETTING = ("workload", "split", "workflows", "calls", "cost_model", "gpu_tokens", "concurrency", "horizon", "gamma",
           "end_signal_loss", "replicas", "routing", "hicache_ratio")


# metrics every row carries, null where a run cannot compute them (the bench client has no bound)
ROW_METRIC_DEFAULTS = {"bound_hit_rate": None, "bound_method": None, "gap_closed": None}


def make_row(labels: dict, metrics: dict) -> dict:
    """One summary row; a label outside ROW_LABELS is a bug in the caller."""
    unknown = set(labels) - set(ROW_LABELS)
    if unknown:
        raise KeyError(f"not row labels: {sorted(unknown)} (serving_integration.experiments.rows.ROW_LABELS)")
    return {**ROW_LABELS, **labels, **ROW_METRIC_DEFAULTS, **metrics}


def add_gap_closed(rows: list[dict]) -> list[dict]:
    """gap_closed = (hit_rate - LRU's) / (bound_hit_rate - LRU's): the share of the distance from
    LRU to the row's own upper bound (simulator/bound.py) that the policy covers. LRU's row is the
    one of the same setting (same workflows, sizes, layout and seed); null without one, or where
    the bound leaves no room above LRU."""
    def key(r):
        return (*(r.get(k) for k in SETTING), r["comparison"], r.get("layout"), r.get("kv_budget"), r.get("seed"))

    lru = {key(r): r["hit_rate"] for r in rows if r["policy"] == "lru" and r["prefetch"] == "none"}
    for r in rows:
        base, bound = lru.get(key(r)), r.get("bound_hit_rate")
        room = bound - base if base is not None and bound is not None else None
        r["gap_closed"] = (r["hit_rate"] - base) / room if room is not None and room > 1e-12 else None
    return rows


def aggregate_seeds(rows: list[dict]) -> list[dict]:
    """One row per setting and method over the seeds of `rows`: each metric's mean, its 95%
    confidence interval `{metric}_ci95` (half-width, Student t with n-1 degrees of freedom; None
    for one seed) and `{metric}_per_seed`; `seeds` lists the seeds, `workflows` and `calls` are totals."""
    from scipy import stats

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = tuple(repr(r.get(k)) for k in ROW_LABELS if k not in ("seed", "workflows", "calls"))
        groups.setdefault(key, []).append(r)
    out = []
    for group in groups.values():
        first = group[0]
        row = {k: first.get(k) for k in ROW_LABELS}
        row.update(seed=None, seeds=[r["seed"] for r in group], workflows=sum(r["workflows"] for r in group),
                   calls=sum(r["calls"] for r in group))
        for name in first:
            if name in ROW_LABELS:
                continue
            values = [r.get(name) for r in group]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                row[name] = first[name] if all(v == first[name] for v in values) else None
                continue
            n = len(values)
            row[name] = float(np.mean(values))
            row[f"{name}_ci95"] = (float(stats.t.ppf(0.975, n - 1) * np.std(values, ddof=1) / np.sqrt(n))
                                   if n > 1 else None)
            row[f"{name}_per_seed"] = values
        out.append(row)
    return out
