"""Replay the same workflows on a real SGLang server (CPU) and in the simulator, with the same
capacities, and compare what each policy does (docs/serving.md, "Simulator against the server").

    python -m serving_integration.experiments.validate_sim --data DIR --policies lru,pbkv_lae,pbkv \\
        --checkpoint runs/train/markov/predictor.pt --n-workflows 10 --gpu-tokens 32000 --concurrency 4 \\
        --out runs/validate_sim

Per policy it starts `launch --cpu` (a fresh server, so no run inherits another's cache), replays
the split's first N workflows with the bench client (serving_integration.experiments.bench), stops
the server, then simulates the same workflows with the same device tokens, host ratio, page size,
concurrency, chunked-prefill budget and tool-time scale. It prints real vs simulated device hit
rate, host hit rate and recomputed (missed) prompt tokens, and the policies' order by device hit
rate on both sides; summary.json keeps both rows of every policy.

Without --checkpoint, pbkv's predictor is the first-order Markov chain fitted on the train split
(models.markov, as evaluate.py does without predictor.checkpoint), saved once under --out.

Latency: with `--calibrate-split val` (the default) it first replays the first N workflows of that
split under lru on a fresh server (a fresh cluster with --replicas, routed as the first --routing)
and fits the cost model to those calls (experiments.calibrate),
so the simulated latencies of the compared runs (other workflows, every policy) are predictions on
runs the fit never saw, made on the machine as it is now; the fit is written to
OUT/calibration/cost_model.yaml (never into conf/: `calibrate --promote` copies it there on request).
`--calibrate-split none` uses the committed conf/cost_model/cpu-tiny-llama.yaml as it is. Besides
summary.json, --out gets report.md (the table, the checks and the command) for the results page.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from data import CONF_DIR
from serving_integration.cache.metrics import eviction_overshoot
from serving_integration.cache.policies import PLUGIN_POLICIES, Prefetch
from serving_integration.cache.router import ROUTERS
from serving_integration.cache.config import PbkvConfig
from serving_integration.simulator.config import SimConfig

SGLANG_CHUNKED_PREFILL = 4096  # SGLang 0.5.23's chunked_prefill_size on a CPU (its startup log)
CPU_COST_MODEL = "cpu-tiny-llama"


# -------------------------------------------------------------------- the real server


def real_run(workflows, policy: str, *, gpu_tokens: int, hicache_ratio: float = SimConfig.hicache_ratio,
             concurrency: int = 2, tool_time_scale: float = 0.1, checkpoint: str | None = None, log_dir: str | Path | None = None,
             health_timeout_s: float = 240.0, extra_launch: list[str] | None = None, replicas: int = 1,
             routing: str = "none", partial_eviction: bool = False) -> dict:
    """Start `launch --cpu` with `policy` (with replicas > 1: a LocalCluster of that many servers,
    gpu_tokens split evenly, behind sglang-router with `routing`), replay `workflows`
    (bench.replay_workflows) with the bench client, stop everything. Returns the bench row, the
    per-call results, the plugin's state (from /server_info; the first replica's in a cluster) and
    the start and replay times; in a cluster also per-replica stats and which replica served each
    call (`served_by`, from the plugins' recent tags)."""
    from serving_integration.server.cluster import LocalCluster
    from serving_integration.server.launch import LocalServer

    args = ["--cpu", "--policy", policy, "--hicache-ratio", str(hicache_ratio)]
    if checkpoint and policy in PLUGIN_POLICIES:
        args += ["--checkpoint", str(checkpoint)]
    if policy in PLUGIN_POLICIES:  # a 2-core CPU is slow: let a predictor round finish (docs/serving.md)
        args += ["--policy-config", json.dumps({"predictor_timeout_s": 0, "partial_eviction": partial_eviction})]
    args += extra_launch or []
    if replicas > 1:
        log = Path(log_dir) / f"cluster-{routing}-{policy}" if log_dir else None
        owner = LocalCluster(args, replicas, routing, gpu_tokens, log_dir=log, health_timeout_s=health_timeout_s)
        log_path = owner.log_dir
    else:
        log_path = Path(log_dir) / f"server-{policy}.log" if log_dir else None
        owner = LocalServer(args + ["--max-total-tokens", str(gpu_tokens)], log_path=log_path,
                            health_timeout_s=health_timeout_s)
    with owner:  # the servers' URLs are final once they are up (a taken port moves one)
        workers = owner.worker_urls if replicas > 1 else []
        run = replay_and_collect(owner.url, workers, workflows, policy, gpu_tokens=gpu_tokens, concurrency=concurrency,
                                 tool_time_scale=tool_time_scale, routing=routing,
                                 worker_index=getattr(owner, "worker_index", None) or None,
                                 replica_capacity_tokens=gpu_tokens // max(replicas, 1) * (1 + hicache_ratio))
    return {**run, "ready_s": owner.ready_s, "log": str(log_path)}


def replay_and_collect(url: str, workers: list[str], workflows, policy: str, *, gpu_tokens: int, concurrency: int,
                       tool_time_scale: float, routing: str = "none", worker_index: list[int] | None = None,
                       replica_capacity_tokens: float = float("inf")) -> dict:
    """Replay `workflows` against a live server (`url`), or a router in front of `workers`, with the
    bench client; the bench row, the per-call results and the plugin's state, and with workers the
    per-replica stats (bench.replica_stats) and which replica's plugin recorded each call (served_by)."""
    from serving_integration.experiments import bench

    cluster = {}
    if workers:
        cluster = {"routing": routing, "replicas": len(workers), "worker_index": worker_index,
                   "replica_capacity_tokens": replica_capacity_tokens}
        before = bench.replica_counters(workers)
    # behind sglang-router the workflow tag travels in the request id (it drops custom_params)
    replay = bench.ClosedLoopReplay(url, workflows, concurrency, bench.SegmentTokens(),
                                    metadata="rid" if workers else "custom_params",
                                    tool_time_scale=tool_time_scale, progress=False, **cluster)
    began = time.monotonic()
    asyncio.run(replay.run())
    replay_s = time.monotonic() - began
    infos = [asyncio.run(bench.server_info(u)) for u in (workers or [url])]
    labels = {"workload": workflows[0][0].workload or "unknown", "policy": policy,
              "prefetch": bench.plugin_state(infos[0]).get("prefetch") or "none", "gpu_tokens": gpu_tokens,
              "concurrency": concurrency, "noise": 0.0, "cost_model": "sglang-cpu", "seed": 0,
              "replicas": max(len(workers), 1), "routing": routing if workers else "none"}
    extra = bench.plugin_metrics(infos[0])
    out = {"results": replay.results, "replay": replay, "plugin": bench.plugin_state(infos[0]), "info": infos[0],
           "replay_s": replay_s}
    if workers:
        time.sleep(1.0)  # the servers count a request's tokens as it finishes
        extra["replica_stats"] = out["replicas"] = bench.replica_stats(before, bench.replica_counters(workers), infos)
        out["served_by"], out["worker_urls"] = bench.served_by(infos), workers
        for r in replay.results:  # where the router sent it, as the replica's plugin recorded it
            if r.replica < 0:
                r.replica = out["served_by"].get((r.workflow_id, r.step), -1)
    out["row"] = bench.summarize(replay, labels, extra)
    return out


# -------------------------------------------------------------------- the simulator


def sim_config(gpu_tokens: int, hicache_ratio: float, concurrency: int, page_size: int = 1, replicas: int = 1,
               routing: str = "none", partial_eviction: bool = False):
    return SimConfig(gpu_tokens=gpu_tokens, hicache_ratio=hicache_ratio, page_size=page_size,
                     concurrency=concurrency, max_prefill_tokens=SGLANG_CHUNKED_PREFILL, replicas=replicas,
                     routing=routing if replicas > 1 else "none", partial_eviction=partial_eviction)


def cpu_cost_model():
    """conf/cost_model/cpu-tiny-llama.yaml (written by experiments.calibrate), read as values."""
    from serving_integration.simulator.config import cost_model_preset

    return cost_model_preset(CONF_DIR / "cost_model" / f"{CPU_COST_MODEL}.yaml")


def sped_up(cost, speedup: float):
    """The cost model of a machine `speedup` times as fast (step and request overheads / F, peak FLOP/s
    and memory bandwidth x F; the efficiencies stay shares in [0, 1]): a replay's hit rates depend on
    how its calls overlap in time."""
    import dataclasses

    return dataclasses.replace(cost, step_overhead_s=cost.step_overhead_s / speedup,
                               request_overhead_s=cost.request_overhead_s / speedup,
                               peak_flops=cost.peak_flops * speedup, mem_bandwidth=cost.mem_bandwidth * speedup)


def sim_run(rows: list[dict], policy: str, config, cost, predictor=None, tool_time_scale: float = 0.1,
            gamma: float = PbkvConfig.gamma) -> dict:
    """The simulator's row for `policy` on the same call rows (tool times scaled as in the replay)."""
    from serving_integration.cache.predictions import ModelSource
    from serving_integration.cache.workload import workflows_from_rows
    from serving_integration.experiments.rows import make_row
    from serving_integration.server.runtime import DEFAULT_PREFETCH
    from serving_integration.simulator.engine import simulate

    workflows = workflows_from_rows([{**r, "tool_time": float(r.get("tool_time") or 0.0) * tool_time_scale}
                                     for r in rows])
    kwargs: dict = {"policy": policy, "prefetch": DEFAULT_PREFETCH.get(policy, "none")}
    if policy in PLUGIN_POLICIES:  # the plugin's defaults: pbkv prefetches (conservative), pbkv_lae does not
        kwargs["gamma"] = gamma
        if policy in ("pbkv", "pbkv_time") or Prefetch(kwargs["prefetch"], None).uses_predictions:  # lru_prefetch: none
            kwargs["predictions"] = ModelSource(predictor)
    if config.routing == "pbkv" and "predictions" not in kwargs:  # the pbkv router reads the ledgers' values
        kwargs["predictions"] = ModelSource(predictor)
    result = simulate(workflows, config, cost, bound=False, **kwargs)
    labels = {"workload": rows[0].get("workload") or "unknown", "policy": policy,
              "prefetch": kwargs.get("prefetch", "none"), "gpu_tokens": config.gpu_tokens,
              "concurrency": config.concurrency, "noise": 0.0, "cost_model": cost.name, "seed": 0,
              "workflows": len(workflows), "calls": sum(len(w.calls) for w in workflows),
              "replicas": config.replicas, "routing": config.routing}
    return make_row(labels, result)


# -------------------------------------------------------------------- the comparison

TOLERANCE = 0.05  # device hit rates should agree within 5 points per policy
LATENCY_TOLERANCE = 0.25  # simulated mean workflow latency within 25% of the measured one
METRICS = (("hit_rate", "device hit rate"), ("host_hit_rate", "host hit rate"), ("miss_tokens", "recomputed tokens"),
           ("mean_workflow_latency_s", "mean workflow latency (s)"))


def _host_rate(row: dict) -> float:
    return row["host_hit_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0


def compare(real: dict[str, dict], sim: dict[str, dict]) -> dict:
    """Per policy, real vs simulated metrics; the policies' order by device hit rate on each side."""
    lines = []
    for policy in real:
        r, s = real[policy], sim[policy]
        line = {"policy": policy}
        for key, _ in METRICS:
            line[f"real_{key}"] = _host_rate(r) if key == "host_hit_rate" else r[key]
            line[f"sim_{key}"] = _host_rate(s) if key == "host_hit_rate" else s[key]
        # the plugin's counters (none for SGLang's own policies, which it does not run), the simulator's row
        line["real_eviction_overshoot"] = eviction_overshoot(r.get("plugin_counters") or {})
        line["sim_eviction_overshoot"] = eviction_overshoot(s)
        line["prompt_tokens"] = (r["prompt_tokens"], s["prompt_tokens"])
        lines.append(line)
    for line in lines:
        real = line["real_mean_workflow_latency_s"]
        line["latency_error"] = (line["sim_mean_workflow_latency_s"] - real) / real if real else float("nan")
    order = {side: [l["policy"] for l in sorted(lines, key=lambda l: -l[f"{side}_hit_rate"])] for side in ("real", "sim")}
    return {"rows": lines, "order": order, "same_order": order["real"] == order["sim"],
            "max_hit_rate_gap": max(abs(l["real_hit_rate"] - l["sim_hit_rate"]) for l in lines),
            "max_latency_error": max(abs(l["latency_error"]) for l in lines)}


def format_comparison(table: dict) -> str:
    header = ["policy"] + [f"{name} real / sim" for _, name in METRICS] + ["latency error",
                                                                          "freed per token needed real / sim"]
    out = [" | ".join(header), " | ".join("---" for _ in header)]
    for line in table["rows"]:
        cells = [line["policy"]]
        for key, _ in METRICS:
            real, sim = line[f"real_{key}"], line[f"sim_{key}"]
            if key in ("hit_rate", "host_hit_rate"):
                cells.append(f"{real:.1%} / {sim:.1%}")
            elif key == "miss_tokens":
                cells.append(f"{real:,} / {sim:,}")
            else:
                cells.append(f"{real:.2f} / {sim:.2f}")
        cells.append(f"{line['latency_error']:+.1%}")
        cells.append(" / ".join("n/a" if line.get(f"{side}_eviction_overshoot") is None
                                else f"{line[f'{side}_eviction_overshoot']:.2f}" for side in ("real", "sim")))
        out.append(" | ".join(cells))
    out.append(f"order by device hit rate: real {' > '.join(table['order']['real'])}; "
               f"simulated {' > '.join(table['order']['sim'])} ({'same' if table['same_order'] else 'DIFFERENT'})")
    out.append(f"largest device hit-rate gap: {table['max_hit_rate_gap']:.1%} (tolerance {TOLERANCE:.0%})")
    out.append(f"largest mean-workflow-latency error: {table['max_latency_error']:.1%} "
               f"(tolerance {LATENCY_TOLERANCE:.0%})")
    return "\n".join(out)


# -------------------------------------------------------------------- command line


def fitted_markov(rows: list[dict], out: Path, horizon: int = 3) -> Path:
    """A first-order Markov checkpoint counted on the train split (as evaluate.py's default)."""
    from models import save_predictor
    from models.base import vocabulary
    from models.markov import MarkovPredictor
    from serving_integration.experiments.bench import replay_workflows

    sequences = [[c.agent for c in wf] for wf in replay_workflows(rows)]
    names = vocabulary(a for s in sequences for a in s)
    index = {a: i for i, a in enumerate(names)}
    predictor = MarkovPredictor.from_sequences(names, horizon, [[index[a] for a in s] for s in sequences], order=1)
    return save_predictor(predictor, out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serving_integration.experiments.validate_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a trace dataset dir (data.generate / data.import_traces)")
    p.add_argument("--split", default="test")
    p.add_argument("--n-workflows", type=int, default=10)
    p.add_argument("--policies", default="lru,pbkv_lae,pbkv")
    p.add_argument("--checkpoint", help="pbkv's predictor.pt (default: a Markov chain fitted on the train split)")
    p.add_argument("--gpu-tokens", type=int, default=32000, help="device KV tokens (--max-total-tokens)")
    p.add_argument("--hicache-ratio", type=float, default=SimConfig.hicache_ratio)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tool-time-scale", type=float, default=0.1)
    p.add_argument("--health-timeout", type=float, default=240.0)
    p.add_argument("--calibrate-split", default="val",
                   help="fit the cost model on an lru run of this split's first N workflows first ('none': use the preset)")
    p.add_argument("--cost-speedup", type=float, default=1.0,
                   help="simulate a machine this many times as fast as the cost model says (a diagnostic)")
    p.add_argument("--real-from", help="an earlier run's summary.json: compare its real rows (same data and "
                                       "settings) with a new simulation instead of starting the compared servers")
    p.add_argument("--replicas", type=int, default=1,
                   help="servers behind sglang-router (server/cluster.py); --gpu-tokens is their total")
    p.add_argument("--routing", default="sticky",
                   help="with --replicas > 1, comma-separated routings: round_robin, cache_aware, sticky, pbkv "
                        "(each with each policy; the simulator's sim.routing of the same name)")
    p.add_argument("--partial-eviction", action="store_true",
                   help="the plugin's policies evict only a victim's tail (its partial_eviction), and so does "
                        "their simulation (sim.partial_eviction); SGLang's own (lru, lfu) evict whole nodes on "
                        "both sides")
    p.add_argument("--out", required=True, help="summary.json, report.md, per-policy calls.jsonl and server logs")
    return p.parse_args(argv)


def save_calls(path: Path, results) -> None:
    from dataclasses import asdict

    from data.formats import write_jsonl_atomic

    write_jsonl_atomic(path, ({k: v for k, v in asdict(r).items() if k != "output_ids"} for r in results))


def calibrated_cost_model(ds, args, out: Path, routing: str = "none"):
    """Replay the calibration split's first N workflows under lru on the compared deployment (one
    server, or --replicas behind the router with `routing`), fit the cost model to those calls
    (experiments.calibrate) and return it with a line describing the fit. On the deployment, not on
    one server: replicas that share a machine's cores (CPU servers) run each call slower than one
    server alone, and a fit on one server would not know it."""
    from serving_integration.experiments import calibrate
    from serving_integration.experiments.bench import replay_workflows
    from serving_integration.server.tiny_model import DEFAULT_DIR

    workflows = replay_workflows(ds.rows(args.calibrate_split))[: args.n_workflows or None]
    run = real_run(workflows, "lru", gpu_tokens=args.gpu_tokens, hicache_ratio=args.hicache_ratio,
                   concurrency=args.concurrency, tool_time_scale=args.tool_time_scale, log_dir=out / "calibration",
                   health_timeout_s=args.health_timeout, replicas=args.replicas, routing=routing)
    save_calls(out / "calibration" / "calls-lru.jsonl", run["results"])
    preset = out / "calibration" / "cost_model.yaml"  # under the run: `calibrate --promote` copies it into conf/
    cost, report = calibrate.fit_preset(out / "calibration" / "calls-lru.jsonl", preset, name=CPU_COST_MODEL,
                                        model_dir=DEFAULT_DIR, peak_flops=calibrate.CPU_PEAK_FLOPS,
                                        mem_bandwidth=calibrate.CPU_MEM_BANDWIDTH,
                                        pcie_bandwidth=calibrate.CPU_COPY_BANDWIDTH)
    on = "" if args.replicas == 1 else f" on {args.replicas} replicas ({routing} routing)"
    about = (f"cost model fitted on an lru run{on} of the {args.calibrate_split} split's first {len(workflows)} workflows "
             f"(written to calibration/{preset.name}); "
             + calibrate.describe(cost, report).replace("\n", "; "))
    return cost, about


def write_report(out: Path, table: dict, about: list[str]) -> None:
    """report.md for the results page: what was replayed, the table and the checks."""
    from data.atomic import atomic_file

    text = "\n\n".join([*about, format_comparison(table)]) + "\n"
    with atomic_file(out / "report.md") as tmp:
        tmp.write_text(text)


def main(argv=None) -> int:
    from data import store
    from data.atomic import write_json
    from models import load_predictor
    from serving_integration.experiments.bench import replay_workflows

    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unsupported = [p for p in policies if p not in ("lru", "lfu", "pbkv_lae", "pbkv", "pbkv_time")]
    if unsupported:
        print(f"error: validate_sim runs lru, lfu, pbkv_lae, pbkv and pbkv_time; not {unsupported}", file=sys.stderr)
        return 2
    from data.atomic import OutputError, check_command_output

    try:  # before any work: never over the dataset, the checkpoint or the run compared with
        check_command_output(args.out, [args.data, args.checkpoint, args.real_from])
    except OutputError as e:
        print(f"error: --out: {e}", file=sys.stderr)
        return 1
    ds = store.load(args.data)
    rows = ds.rows(None if args.split == "all" else args.split)
    workflows = replay_workflows(rows)[: args.n_workflows or None]
    keep = {c.workflow_id for wf in workflows for c in wf}
    rows = [r for r in rows if r["workflow_id"] in keep]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or str(fitted_markov(ds.rows("train"), out / "markov" / "predictor.pt"))
    predictor = load_predictor(checkpoint)
    routings = [r.strip() for r in args.routing.split(",") if r.strip()] if args.replicas > 1 else ["none"]
    bad = [r for r in routings if r not in ROUTERS]
    if bad or not routings:
        print(f"error: --routing takes {', '.join(r for r in ROUTERS if r != 'none')}; not {bad}", file=sys.stderr)
        return 2
    if args.calibrate_split == "none":
        cost, about = cpu_cost_model(), f"cost model: conf/cost_model/{CPU_COST_MODEL}.yaml as committed"
    else:
        cost, about = calibrated_cost_model(ds, args, out, routings[0])
    if args.cost_speedup != 1.0:
        cost, about = sped_up(cost, args.cost_speedup), f"{about}; simulated {args.cost_speedup:g}x as fast"
    print(about, flush=True)
    real, sim = {}, {}
    earlier = None
    if args.real_from:
        earlier = {r["policy"] if args.replicas == 1 else f"{r['routing']}+{r['policy']}": r
                   for r in json.loads(Path(args.real_from).read_text())["real"]}
    for routing in routings:
        for policy in policies:
            partial = args.partial_eviction and policy in PLUGIN_POLICIES
            config = sim_config(args.gpu_tokens, args.hicache_ratio, args.concurrency, replicas=args.replicas,
                                routing=routing, partial_eviction=partial)
            name = policy if args.replicas == 1 else f"{routing}+{policy}"
            sim[name] = sim_run(rows, policy, config, cost, predictor, args.tool_time_scale)
            if earlier is not None:  # --real-from: the real rows of an earlier run, re-simulated
                if name not in earlier:
                    print(f"error: {args.real_from} has no real row {name}", file=sys.stderr)
                    return 2
                real[name] = earlier[name]
                print(f"{name}: real device hits {real[name]['hit_rate']:.1%} (from {args.real_from}), "
                      f"simulated {sim[name]['hit_rate']:.1%}", flush=True)
                continue
            run = real_run(workflows, policy, gpu_tokens=args.gpu_tokens, hicache_ratio=args.hicache_ratio,
                           concurrency=args.concurrency, tool_time_scale=args.tool_time_scale, checkpoint=checkpoint,
                           log_dir=out, health_timeout_s=args.health_timeout, replicas=args.replicas, routing=routing,
                           partial_eviction=partial)
            real[name] = run["row"]
            save_calls(out / f"calls-{name}.jsonl", run["results"])
            where = ""
            if args.replicas > 1:
                where = (f"; per replica real calls {[r['requests'] for r in run['replicas']]} (with end signals), "
                         f"device hits {[round(r['hit_rate'], 3) for r in run['replicas']]}; simulated calls "
                         f"{sim[name]['replica_calls']}, migrations {sim[name]['migrations']}")
            if partial:  # the plugin's count of victims split (none would mean the walk never saw a shortfall)
                counters = real[name].get("plugin_counters") or {}
                where += f"; victims split {counters.get('partial_evictions', 0)}"
            print(f"{name}: real device hits {real[name]['hit_rate']:.1%} (ready in {run['ready_s']:.0f} s, "
                  f"replay {run['replay_s']:.0f} s), simulated {sim[name]['hit_rate']:.1%}{where}", flush=True)
    table = compare(real, sim)
    write_json(out / "summary.json", {"real": list(real.values()), "sim": list(sim.values()), "comparison": table,
                                      "config": {**vars(args), "checkpoint": checkpoint}, "cost_model": about})
    replayed = (f"{len(workflows)} {args.split} workflows ({sum(len(wf) for wf in workflows)} calls), "
                f"{args.gpu_tokens:,} device tokens, host pool {args.hicache_ratio:g}x, concurrency {args.concurrency}, "
                f"tool times x{args.tool_time_scale:g}; "
                + ("the plugin's policies evict a victim's tail only (partial eviction, on both sides); "
                   if args.partial_eviction else "")
                + ("a fresh server per policy." if args.replicas == 1 else
                   f"{args.replicas} replicas (the device tokens in total) behind sglang-router, a fresh cluster "
                   f"per routing and policy."))
    write_report(out, table, [replayed, about])
    print(format_comparison(table))
    failed = sum(r["failed_calls"] for r in real.values())
    if failed:
        print(f"{failed} real calls failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
