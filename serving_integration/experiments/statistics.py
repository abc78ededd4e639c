"""The statistics the results pages print, one definition for every table and claim.

- Over seeds: the mean and the 95% half-width of Student's t. A ratio or a difference of two rows is
  taken per seed, paired by the seed (the same workload draw, split and replay seed in both rows).
- Over workflows, for imported traces (the data is fixed; a seed changes only the split and the
  replay): a paired bootstrap (scipy.stats.bootstrap, paired=True) that resamples workflow indices,
  the same ones for both policies, from the rows' `per_workflow` results (cache/metrics.py
  per_workflow_results, pooled over the seeds by rows.pool_per_workflow).
- A verdict: an interval that contains the null value (1 for a ratio, 0 for a difference) is printed
  "no difference", never as a win or a loss.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000  # resamples of the workflow bootstrap (its 95% interval moves by < 0.01 beyond)
BOOTSTRAP_SEED = 0  # the pages are rebuilt identically from the same runs


def seeds_of(r: dict) -> list:
    """The seeds behind a row: its `seeds` (an aggregated row), else its own `seed`."""
    return list(r.get("seeds") or [r.get("seed")])


def per_seed(r: dict, field: str) -> list[float]:
    """A metric's values, one per seed of seeds_of(r) (the value itself for a row of one seed)."""
    return list(r.get(f"{field}_per_seed") or [r[field]])


def by_seed(r: dict, field: str) -> dict:
    values = per_seed(r, field)
    seeds = seeds_of(r)
    if len(seeds) != len(values):  # a row without its seeds listed: pair by position
        seeds = list(range(len(values)))
    return dict(zip(seeds, values))


def paired_ratios(a: dict, b: dict, field: str, higher: bool) -> list[float]:
    """Per-seed ratios a/b (higher is better) or b/a (lower is better: a speed-up), over the seeds
    both rows ran, each seed's value of `a` divided by the same seed's of `b`."""
    xs, ys = by_seed(a, field), by_seed(b, field)
    pairs = [(xs[s], ys[s]) for s in xs if s in ys]
    return [(x / y if y else math.nan) if higher else (y / x if x else math.nan) for x, y in pairs]


def paired_differences(a: dict, b: dict, field: str) -> list[float]:
    """Per-seed differences a - b over the seeds both rows ran."""
    xs, ys = by_seed(a, field), by_seed(b, field)
    return [xs[s] - ys[s] for s in xs if s in ys]


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


@dataclass(frozen=True)
class Estimate:
    """A value with its 95% interval [low, high] (None for both where there is none: one seed)."""
    value: float
    low: float | None
    high: float | None
    samples: int  # seeds, or paired workflows

    def contains(self, null: float) -> bool:
        return self.low is not None and self.low <= null <= self.high


def over_seeds(values: list[float]) -> Estimate:
    mean, half = mean_ci(values)
    n = len([v for v in values if v is not None and not math.isnan(v)])
    return Estimate(mean, None, None, n) if half is None else Estimate(mean, mean - half, mean + half, n)


def paired_workflows(a: dict, b: dict) -> tuple[dict, dict] | None:
    """The two rows' per-workflow results restricted to the workflows both replayed, in the same
    order ({column: array}); None where either row has none (a generated workload, an old run)."""
    pa, pb = a.get("per_workflow"), b.get("per_workflow")
    if not pa or not pb:
        return None
    index_b = {w: i for i, w in enumerate(pb["workflow"])}
    both = [(i, index_b[w]) for i, w in enumerate(pa["workflow"]) if w in index_b]
    if len(both) < 2:
        return None
    ia, ib = (np.array(ix) for ix in zip(*both))
    columns = [c for c in pa if c != "workflow"]
    return ({c: np.asarray(pa[c], dtype=float)[ia] for c in columns},
            {c: np.asarray(pb[c], dtype=float)[ib] for c in columns})


def _speed_up(latency_a, latency_b, axis=-1):
    """b's mean workflow latency over a's: above 1, a is faster."""
    return np.mean(latency_b, axis=axis) / np.mean(latency_a, axis=axis)


def _missed_difference(missed_a, prompt_a, missed_b, prompt_b, axis=-1):
    """a's share of prompt tokens prefilled minus b's (negative: a recomputes less)."""
    return np.sum(missed_a, axis=axis) / np.sum(prompt_a, axis=axis) - np.sum(missed_b, axis=axis) / np.sum(
        prompt_b, axis=axis)


BOOTSTRAPPED = {  # what the bootstrap estimates: (statistic, the per-workflow columns it reads from a then b)
    "speed_up": (_speed_up, ("latency_s",)),
    "missed_difference": (_missed_difference, ("missed_tokens", "prompt_tokens")),
}


def workflow_bootstrap(a: dict, b: dict, what: str) -> Estimate | None:
    """A paired bootstrap over the workflows both rows replayed (scipy.stats.bootstrap, paired=True:
    each resample draws workflow indices once, for both policies): `speed_up` (b's mean workflow
    latency over a's) or `missed_difference` (a's recompute rate minus b's), with its 95% BCa interval
    (percentile where BCa is undefined). None without per-workflow results in both rows."""
    from scipy.stats import bootstrap

    paired = paired_workflows(a, b)
    if paired is None:
        return None
    statistic, columns = BOOTSTRAPPED[what]
    xa, xb = paired
    data = tuple(xa[c] for c in columns) + tuple(xb[c] for c in columns)
    value = float(statistic(*data))
    if all(np.array_equal(xa[c], xb[c]) for c in columns) or np.isnan(value):
        return Estimate(value, value, value, len(data[0]))  # the same replay: nothing to resample
    low = high = math.nan
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a degenerate BCa interval comes back as nan: percentile then
            result = bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=BOOTSTRAP_RESAMPLES,
                               method=method, rng=np.random.default_rng(BOOTSTRAP_SEED))
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
        if not (math.isnan(low) or math.isnan(high)):
            break
    return Estimate(value, low, high, len(data[0]))


NO_DIFFERENCE = "no difference"


def fine_enough(spec: str, estimate: Estimate, most: int = 4) -> str:
    """`spec` with more decimals (up to `most`) where its own would print a non-zero interval as
    [1.00, 1.00]: a small but clear difference must not read like none."""
    found = re.fullmatch(r"\{:(\+?)\.(\d)([f%])\}", spec)
    if not found or estimate.low is None or estimate.low == estimate.high:
        return spec
    sign, digits, kind = found.group(1), int(found.group(2)), found.group(3)
    while digits < most and f"{{:.{digits}{kind}}}".format(estimate.low) == f"{{:.{digits}{kind}}}".format(
            estimate.high):
        digits += 1
    return f"{{:{sign}.{digits}{kind}}}"


def shown(estimate: Estimate | None, spec: str = "{:.2f}", null: float | None = None, style: str = "pm") -> str:
    """An estimate as a cell: `1.16 ± 0.04` (style pm: a seed interval) or `1.16 [1.10, 1.22]`
    (style range: a bootstrap interval); `no difference (…)` where the interval contains `null`
    (1 for a ratio, 0 for a difference); the value alone without an interval; n/a without a value."""
    if estimate is None or math.isnan(estimate.value):
        return "n/a"
    spec = fine_enough(spec, estimate)
    text = spec.format(estimate.value)
    if estimate.low is not None:
        if style == "pm":
            text += " ± " + spec.replace("+", "").format((estimate.high - estimate.low) / 2)
        else:
            text += f" [{spec.format(estimate.low)}, {spec.format(estimate.high)}]"
    return f"{NO_DIFFERENCE} ({text})" if null is not None and estimate.contains(null) else text
