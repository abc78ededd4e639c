"""Collect traces that carry the serving model's hidden state from a CPU SGLang server, in one command:

    python -m serving_integration.experiments.bench_collect --data DATASET --out DIR [--n-workflows N] \\
        [--json FIGURES.json]

It starts a fresh `launch --cpu --policy pbkv_lae --hidden-state` server (the tiny random Llama, a
free port, its log in DIR/server.log), replays the dataset's workflows with the benchmark client's
`--save-trace DIR` (DIR/calls.native.jsonl and DIR/dataset: every call with its hidden state of the
last prefill token, the model's name and hidden size in meta.json; DIR/bench: the replay's
summary.json), stops the server, and prints the plugin's capture line: calls captured, failed, and
the cost per request. `--json` also writes those figures for the results page (conf/results.yaml,
step hidden_state). Then, for example:

    python train.py model=graphsage data.path=DIR/dataset datamodule.text_source=hidden
    python train.py train_experiment=signals data=collected data.source.src=DIR/calls.native.jsonl

On a GPU run the server yourself (`launch --model-path M --policy pbkv_lae --hidden-state`) and
`bench --save-trace DIR` against it (scripts/gpu_smoke.sh, step 5).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    from data.knobs import help_of
    from serving_integration.experiments.bench_config import BenchConfig, default

    p = argparse.ArgumentParser(prog="python -m serving_integration.experiments.bench_collect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help=help_of(BenchConfig, "data"))
    p.add_argument("--split", default="all", help=help_of(BenchConfig, "split"))
    p.add_argument("--n-workflows", type=int, default=default("n_workflows"), help=help_of(BenchConfig, "n_workflows"))
    p.add_argument("--concurrency", type=int, default=4, help=help_of(BenchConfig, "concurrency"))
    p.add_argument("--out", required=True, help="where the collected traces go (calls.native.jsonl, dataset/, bench/)")
    p.add_argument("--max-total-tokens", type=int, default=32000, help="the server's device KV pool in tokens")
    p.add_argument("--hidden-layer", type=int, help="the output of this decoder layer instead of the final one")
    p.add_argument("--health-timeout", type=float, default=400.0, help="seconds to wait for the server to be ready")
    p.add_argument("--json", help="also write the capture's figures for the results page here")
    return p.parse_args(argv)


def figures(row: dict, hidden: dict) -> dict:
    """The results page's figures of one collection (`row`: the replay's summary row, `hidden`: the
    collected dataset's meta.json `hidden`): the cost per request and what was captured."""
    counters, cost, n_calls = row.get("plugin_counters") or {}, row.get("hidden_cost_ms") or {}, row["calls"]
    ms = {key: f"{cost[key]:.3f} ms" if key in cost else "n/a" for key in ("mean", "p50", "p99", "max")}
    model = Path(hidden.get("model") or "unknown").name
    return {"about": f"A `launch --cpu --policy pbkv_lae --hidden-state` server ({model}, hidden size "
                     f"{hidden.get('size')}) and `bench --save-trace` over {n_calls} calls: the plugin's cost per "
                     "request of taking each call's hidden state of its last prefill token (SGLang's host copy + "
                     "the plugin's conversion), and how many calls it captured.",
            "figures": [{"name": "hidden state cost per request, mean", "value": ms["mean"]},
                        {"name": "hidden state cost per request, p50 / p99 / max",
                         "value": f"{ms['p50']} / {ms['p99']} / {ms['max']}"},
                        {"name": "calls with a hidden state captured",
                         "value": f"{counters.get('hidden_captured', 0)} of {n_calls} "
                                  f"({counters.get('hidden_capture_failed', 0)} failed)"}]}


def main(argv=None) -> int:
    from data.errors import run_reported

    args = parse_args(argv)
    status = []
    failed = run_reported(lambda: status.append(collect(args)))
    return failed or status[0]


def collect(args: argparse.Namespace) -> int:
    from data.atomic import check_output, write_json
    from serving_integration.experiments import bench
    from serving_integration.server.launch import LocalServer

    out = Path(args.out)
    check_output(args.out, [args.data])
    if args.json:
        check_output(args.json, [args.data])
    out.mkdir(parents=True, exist_ok=True)
    launch = ["--cpu", "--policy", "pbkv_lae", "--hidden-state", "--max-total-tokens", str(args.max_total_tokens)]
    if args.hidden_layer is not None:
        launch += ["--hidden-layer", str(args.hidden_layer)]
    with LocalServer(launch, log_path=out / "server.log", health_timeout_s=args.health_timeout) as server:
        print(f"server ready in {server.ready_s:.0f} s: {server.url}", flush=True)
        status = bench.main(["--url", server.url, "--data", args.data, "--split", args.split, "--n-workflows",
                             str(args.n_workflows), "--concurrency", str(args.concurrency), "--tool-time-scale", "0",
                             "--out", str(out / "bench"), "--save-trace", str(out), "--no-progress"])
    if status:
        return status
    from data import store

    (row,) = json.loads((out / "bench" / "summary.json").read_text())["rows"]
    if args.json:
        write_json(args.json, figures(row, store.load(out / "dataset").meta.get("hidden") or {}))
    return 0 if row["failed_calls"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
