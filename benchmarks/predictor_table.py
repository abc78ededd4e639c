"""Markdown table of test metrics per predictor family, from the metrics.json of train.py runs.

    python train.py -m model=graphsage,rgcn,markov,intent_residual hydra.sweep.dir=multirun/families
    python -m benchmarks.predictor_table multirun/families                    # top-1, k = 1..K
    python -m benchmarks.predictor_table multirun/families --metric top3 nll
    python -m benchmarks.predictor_table multirun/signals --by text --interval   # conf/train_experiment/signals.yaml

Each run is named by its checkpoint's family; with several seeds per family the table shows
mean +- standard deviation over them; `--by text` names each row by family and text signal
(`graphsage [hidden]`), `--interval` shows the mean with its 95% Student-t interval instead.
`top1` is unconditional (steps past a workflow's end count as END), `top1_alive` counts only
steps up to the END (models/metrics.py). On generated data a
last row gives the Bayes ceiling of top1 and top1_alive: the best any predictor can do knowing the
latent the task text reveals and the whole history (data/generators.py, expected over the generator).

:func:`format_time_table` is the table of the time until each predicted call (models/timing.py):
per family the source of the gaps, the MAE of the median's log time per k and overall, and the
share of true times at or below each predicted quantile over all steps (``--time``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from models import read_checkpoint

ORDER = ("markov", "graphsage", "rgcn", "intent_residual")


def find_runs(paths: list[Path]) -> list[Path]:
    runs = []
    for path in paths:
        runs += [path] if (path / "metrics.json").is_file() else sorted(p.parent for p in path.glob("*/metrics.json"))
    if not runs:
        raise SystemExit(f"no metrics.json under {', '.join(map(str, paths))}")
    return runs


def cell(values: list[float], interval: bool = False) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    mean = statistics.mean(values)
    if interval:
        from scipy import stats

        half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
        return f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]"
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}"


def run_label(checkpoint: dict, by_text: bool) -> str:
    """The family, and with `by_text` its text signal (none for families without one)."""
    family = checkpoint["family"]
    if not by_text:
        return family
    return f"{family} [{(checkpoint['init'].get('text') or {}).get('source', 'none')}]"


def format_table(paths: list[Path], metrics: list[str], split: str = "test", by_text: bool = False,
                 interval: bool = False) -> str:
    """The Markdown table: one row per family (and text signal), one column per (metric, k)."""
    by_family: dict[str, list[dict]] = defaultdict(list)
    for run in find_runs(paths):
        values = json.loads((run / "metrics.json").read_text())
        by_family[run_label(read_checkpoint(values["checkpoint"]), by_text)].append(values)
    horizon = max(int(k.rsplit("_k", 1)[1]) for k in next(iter(by_family.values()))[0] if "/" in k and "_k" in k)
    columns = [(m, k) for m in metrics for k in range(1, horizon + 1)]
    lines = ["| family | runs | " + " | ".join(f"{m} k={k}" for m, k in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for family in sorted(by_family, key=lambda f: (ORDER.index(f.split(" ")[0]) if f.split(" ")[0] in ORDER
                                                   else len(ORDER), f)):
        runs = by_family[family]
        cells = [cell([r[f"{split}/{m}_k{k}"] for r in runs], interval) for m, k in columns]
        lines.append(f"| {family} | {len(runs)} | " + " | ".join(cells) + " |")
    ceilings = {json.dumps(r.get("bayes_ceiling"), sort_keys=True) for rs in by_family.values() for r in rs}
    if len(ceilings) == 1 and (ceiling := json.loads(ceilings.pop())):
        cells = [f"{ceiling[f'{m}_k{k}']:.3f}" if f"{m}_k{k}" in ceiling else "" for m, k in columns]
        lines.append(f"| Bayes ceiling (knows {', '.join(ceiling.get('knows', []))}) | - | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_cell(values: list[float | None], interval: bool = False) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    return cell(known, interval)


def format_time_table(paths: list[Path], split: str = "test", interval: bool = False) -> str:
    """The Markdown table of the time head: one row per family; runs from before times were
    predicted have none of its metrics and are left out (a line says so when none has them)."""
    by_family: dict[str, list[dict]] = defaultdict(list)
    for run in find_runs(paths):
        values = json.loads((run / "metrics.json").read_text())
        if "time_source" in values:
            by_family[read_checkpoint(values["checkpoint"])["family"]].append(values)
    if not by_family:
        return "No time-until-call metrics in these runs (trained before predictors gave times: rerun them)."
    first = next(iter(by_family.values()))[0]
    horizon = max(int(k.rsplit("_k", 1)[1]) for k in first if k.startswith(f"{split}/time_mae_log_k"))
    labels = [k.split("time_below_", 1)[1] for k in first if k.startswith(f"{split}/time_below_") and "_k" not in k]
    errors = [f"time_mae_log_k{k}" for k in range(1, horizon + 1)] + ["time_mae_log"]
    head = [f"MAE log k={k}" for k in range(1, horizon + 1)] + ["MAE log all"] + \
        [f"share below {q}, at or below" for q in labels]
    lines = ["| family | runs | gaps from | " + " | ".join(head) + " |", "|---|---|---|" + "---|" * len(head)]
    for family in sorted(by_family, key=lambda f: (ORDER.index(f) if f in ORDER else len(ORDER), f)):
        runs = by_family[family]
        sources = sorted({r["time_source"] + (" (per-agent fallback)" if r["time_fallback"] else "") for r in runs})
        cells = [time_cell([r.get(f"{split}/{c}") for r in runs], interval) for c in errors]
        cells += [share_cell([r.get(f"{split}/time_below_{q}") for r in runs],
                             [r.get(f"{split}/time_at_or_below_{q}") for r in runs]) for q in labels]
        lines.append(f"| {family} | {len(runs)} | {', '.join(sources)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def share_cell(below: list[float | None], at_or_below: list[float | None]) -> str:
    """Mean shares of true times strictly below and at or below a quantile: one number when they
    agree (no ties), else the range (an atom at the quantile; calibrated when q lies in it)."""
    below, at_or_below = [v for v in below if v is not None], [v for v in at_or_below if v is not None]
    if not below or not at_or_below:
        return "n/a"
    low, high = statistics.mean(below), statistics.mean(at_or_below)
    return f"{low:.3f}" if round(low, 3) == round(high, 3) else f"{low:.3f}-{high:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or sweep directories holding them")
    parser.add_argument("--metric", nargs="+", default=["top1", "top1_alive"],
                        help="top1 top1_alive top3 nll ece end_acc")
    parser.add_argument("--split", default="test", choices=["val", "test"])
    parser.add_argument("--by", choices=["family", "text"], default="family",
                        help="text: one row per family and text signal (hidden, encoder, none)")
    parser.add_argument("--interval", action="store_true", help="mean and 95%% Student-t interval over the runs")
    parser.add_argument("--time", action="store_true", help="the time-until-call table instead (models/timing.py)")
    args = parser.parse_args()
    if args.time:
        print(format_time_table(args.runs, args.split, args.interval))
    else:
        print(format_table(args.runs, args.metric, args.split, args.by == "text", args.interval))


if __name__ == "__main__":
    main()
