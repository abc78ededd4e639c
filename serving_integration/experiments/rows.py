"""The summary row: its schema (the labels every row carries, with their defaults, and the metrics
every row has) and the rules across rows (the setting's bounds and gap closed against LRU, the check
that no row beats a bound, the mean over seeds). Used by evaluate.py, the bench client,
validate_sim, the report and the tests; how rows are printed and plotted is presentation.py's."""

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
    "scheduling": "fcfs",  # the admission order (the simulator's sim.scheduling; the server's --schedule-policy)
    "partial_eviction": False,  # a victim node gives up only its tail (sim.partial_eviction; SGLang: the whole node)
    "hicache_ratio": None,  # host KV tier = ratio x GPU tokens (0: none; None: a row that does not say)
    # the GPU size as a fraction of the live working set (sim.gpu_working_set_fraction; None: given in tokens);
    # gpu_tokens separates the settings, so the memory plots draw fractions on one GPU-size axis
    "gpu_working_set_fraction": None,
}
# rows compare only within one setting: the same replayed workflows under the same sizes
SETTING = ("workload", "split", "workflows", "calls", "cost_model", "gpu_tokens", "concurrency", "horizon", "gamma",
           "end_signal_loss", "replicas", "routing", "hicache_ratio", "scheduling", "partial_eviction")


def setting_of(r: dict) -> tuple:
    """The row's setting: SETTING's values."""
    return tuple(r.get(k) for k in SETTING)


def setting_but(r: dict, compared: str) -> dict:
    """The row's setting (SETTING's keys and values) less the one key a section compares across."""
    return {k: r.get(k) for k in SETTING if k != compared}


# metrics every row carries, null where a run cannot compute them (the bench client has no bound; a
# summary.json written before a metric existed lacks it). Per row, on the row's own request sequence
# (serving_integration/simulator/bound.py, where each is proven; summed over replicas in a cluster):
ROW_METRIC_DEFAULTS = {
    "bound_hit_rate": None,  # no eviction policy without prefetch reaches a higher GPU hit rate
    "bound_prefetch_hit_rate": None,  # nor one that also prefetches from the host in the run's idle PCIe time
    "bound_recompute_rate": None,  # no policy at all recomputes a smaller share of prompt tokens
    # how they were solved, "+"-joined: lp, pfoo_u (bound.py's fallback for large runs), any_tier
    # (a large run's prefetch bound: the recompute bound's GPU + host hits stand for it)
    "bound_method": None,
    # per setting and seed, over its rows (add_setting_bounds): what tables print beside the row
    "setting_bound_hit_rate": None,  # max over the rows of the bound of this row's class (prefetch none / any)
    "setting_bound_recompute_rate": None,  # min over the rows of bound_recompute_rate
    "gap_closed": None,  # (hit_rate - LRU's) / (setting_bound_hit_rate - LRU's)
    "gap_closed_recompute": None,  # (LRU's recompute_rate - row's) / (LRU's - setting_bound_recompute_rate)
}
# a row's prefetch class, and the bound of its own sequence that covers it
CLASS_BOUND = {"none": "bound_hit_rate", "prefetch": "bound_prefetch_hit_rate"}


def make_row(labels: dict, metrics: dict) -> dict:
    """One summary row; a label outside ROW_LABELS is a bug in the caller."""
    unknown = set(labels) - set(ROW_LABELS)
    if unknown:
        raise KeyError(f"not row labels: {sorted(unknown)} (serving_integration.experiments.rows.ROW_LABELS)")
    return {**ROW_LABELS, **labels, **ROW_METRIC_DEFAULTS, **metrics}


def prefetch_class(row: dict) -> str:
    return "none" if row["prefetch"] == "none" else "prefetch"


def setting_key(row: dict) -> tuple:
    """Rows compared with each other: the same setting (same workflows, sizes), comparison, layout and seed."""
    return (*(row.get(k) for k in SETTING), row["comparison"], row.get("layout"), row.get("kv_budget"), row.get("seed"))


def add_setting_bounds(rows: list[dict]) -> list[dict]:
    """Per setting and seed, the bounds every row of a class respects, and gap closed against them.

    setting_bound_hit_rate: for a row without prefetch, the max over the setting's rows of
    bound_hit_rate; with prefetch, the max of bound_prefetch_hit_rate. No row of the class exceeds
    it: each row's hit rate is at most its own sequence's bound of the class (bound.py: the
    eviction bound holds for every run without prefetch, the prefetch bound for every run with
    it), and that is at most the max. The max runs over every row of the setting, both classes:
    each row's bound is a bound on its own sequence, whoever produced it, so the max only grows;
    and as each row's prefetch bound is at least its eviction bound, the prefetch class's bound is
    at least the other's. setting_bound_recompute_rate, the min of bound_recompute_rate, holds
    likewise for every row (a bound on any policy). gap_closed = (hit_rate - LRU's) /
    (setting_bound_hit_rate - LRU's) and gap_closed_recompute = (LRU's recompute_rate - row's) /
    (LRU's - setting_bound_recompute_rate), against LRU's row without prefetch of the setting; null
    without one, without a bound, or where the bound leaves no room beyond LRU."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(setting_key(r), []).append(r)
    for group in groups.values():
        lru = next((r for r in group if r["policy"] == "lru" and r["prefetch"] == "none"), None)
        best = {cls: _extreme(max, group, name) for cls, name in CLASS_BOUND.items()}
        recompute = _extreme(min, group, "bound_recompute_rate")
        for r in group:
            bound = best[prefetch_class(r)]
            r["setting_bound_hit_rate"], r["setting_bound_recompute_rate"] = bound, recompute
            base = lru and lru["hit_rate"]
            r["gap_closed"] = _share(_minus(r["hit_rate"], base), _minus(bound, base))
            base = lru and lru.get("recompute_rate")
            r["gap_closed_recompute"] = _share(_minus(base, r.get("recompute_rate")), _minus(base, recompute))
    return rows


def _extreme(pick, rows: list[dict], name: str):
    values = [r[name] for r in rows if r.get(name) is not None]
    return pick(values) if values else None


def _minus(a, b):
    return None if a is None or b is None else a - b


def _share(gain, room):
    """gain / room: the share of the distance from LRU to the bound that a row covers."""
    return None if gain is None or room is None or abs(room) <= 1e-12 else gain / room


class BoundViolated(AssertionError):
    """A row beat a proven bound: the proof or the code is wrong (simulator/bound.py)."""


def check_bounds(rows: list[dict], tolerance: float = 1e-9) -> None:
    """Fail loudly where a row's GPU hit rate exceeds its setting's bound for its class (or its own
    sequence's), or its recomputed share is below the setting's bound (or its own)."""
    for r in rows:
        own = r.get(CLASS_BOUND[prefetch_class(r)])
        for name, bound in (("setting_bound_hit_rate", r.get("setting_bound_hit_rate")),
                            (CLASS_BOUND[prefetch_class(r)], own)):
            if bound is not None and r["hit_rate"] > bound + tolerance:
                raise BoundViolated(f"{_describe(r)}: hit_rate {r['hit_rate']!r} exceeds {name} {bound!r}")
        for name in ("setting_bound_recompute_rate", "bound_recompute_rate"):
            bound = r.get(name)
            if bound is not None and r["recompute_rate"] < bound - tolerance:
                raise BoundViolated(f"{_describe(r)}: recompute_rate {r['recompute_rate']!r} is below {name} {bound!r}")


def _describe(row: dict) -> str:
    labels = ("workload", "policy", "prefetch", "trust", "predictor", "layout", "gpu_tokens", "concurrency", "seed")
    return "row " + ", ".join(f"{k}={row.get(k)}" for k in labels)


def method_key(row: dict) -> tuple:
    """What one aggregated row stands for: every label but the seed and the counts it sums."""
    return tuple(repr(row.get(k)) for k in ROW_LABELS if k not in ("seed", "workflows", "calls"))


def aggregate_seeds(rows: list[dict]) -> list[dict]:
    """One row per setting and method over the seeds of `rows`: each metric's mean, its 95%
    confidence interval `{metric}_ci95` (half-width, Student t with n-1 degrees of freedom; None
    for one seed) and `{metric}_per_seed`; `seeds` lists the seeds, `workflows` and `calls` are totals;
    `per_workflow` pools the seeds' per-workflow results (pool_per_workflow)."""
    from scipy import stats

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(method_key(r), []).append(r)
    out = []
    for group in groups.values():
        first = group[0]
        row = {k: first.get(k) for k in ROW_LABELS}
        row.update(seed=None, seeds=[r["seed"] for r in group], workflows=sum(r["workflows"] for r in group),
                   calls=sum(r["calls"] for r in group))
        for name in first:
            if name in ROW_LABELS:
                continue
            if name == "per_workflow":
                row[name] = pool_per_workflow(group)
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


def pool_per_workflow(rows: list[dict]) -> dict | None:
    """The per-workflow results (cache/metrics.py per_workflow_results) of one method's seeds as one
    set of columns, each workflow id prefixed by its seed (`3/wf-17`: with imported traces a seed
    splits the same workflows anew, so one workflow may be replayed under several seeds, each a
    separate sample); null when a seed has none."""
    if any(not r.get("per_workflow") for r in rows):
        return None
    columns = list(rows[0]["per_workflow"])
    pooled = {c: [] for c in columns}
    for r in sorted(rows, key=lambda r: r["seed"]):
        results = r["per_workflow"]
        pooled["workflow"] += [f"{r['seed']}/{w}" for w in results["workflow"]]
        for c in columns[1:]:
            pooled[c] += list(results[c])
    return pooled


def merge_seed_splits(rows: list[dict], runs: dict[str, tuple[str, list[dict]]]) -> list[dict]:
    """`rows` (aggregated rows, each with its summary's path in `sources`) with the rows of one method
    that one sweep measured in several jobs on disjoint seeds (its runs' configs equal but for
    `seeds`) replaced by the one row a run over all their seeds writes: their seed rows aggregated
    anew, in seed order, and their pooled per-workflow results joined. `runs`: per summary path, (its
    config but `seeds`, as text; its seed rows). Rows of other configs, of overlapping seeds, or
    whose summary lacks their seed rows stay apart."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        if r.get("seeds") and len(r["sources"]) == 1 and r["sources"][0] in runs:
            groups.setdefault((runs[r["sources"][0]][0], method_key(r)), []).append(i)
    replaced: dict[int, dict | None] = {}
    for (_, key), members in groups.items():
        parts = [rows[i] for i in members]
        seeds = [s for r in parts for s in r["seeds"]]
        if len(parts) < 2 or len(set(seeds)) != len(seeds):
            continue
        split = [[s for s in runs[r["sources"][0]][1] if method_key(s) == key] for r in parts]
        if any(sorted(s["seed"] for s in found) != sorted(r["seeds"]) for found, r in zip(split, parts)):
            continue
        (row,) = aggregate_seeds(sorted((s for found in split for s in found), key=lambda s: s["seed"]))
        pools = [r.get("per_workflow") for r in parts]
        row["per_workflow"] = _join_pools(pools) if all(pools) else None
        row["sources"] = [r["sources"][0] for r in parts]
        replaced.update({i: None for i in members[1:]})
        replaced[members[0]] = row
    return [row for i, r in enumerate(rows) if (row := replaced.get(i, r)) is not None]


def _join_pools(pools: list[dict]) -> dict:
    """Pooled per-workflow columns (pool_per_workflow) of disjoint seeds as one pool, in seed order
    as pool_per_workflow orders them (each workflow id is `seed/id`)."""
    columns = list(pools[0])
    entries = [(int(w.split("/", 1)[0]), p, i) for p in pools for i, w in enumerate(p["workflow"])]
    entries.sort(key=lambda e: e[0])  # stable: each seed's workflows keep their order
    return {c: [p[c][i] for _, p, i in entries] for c in columns}
