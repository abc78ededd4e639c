"""Start stock SGLang 0.5.23 with HiCache and a cache policy (PBKV's through the plugin).

    python -m serving_integration.server.launch --model-path Qwen/Qwen3-14B --policy pbkv \\
        --checkpoint runs/train/markov/predictor.pt
    python -m serving_integration.server.launch --model-path M --policy lru          # the baseline
    python -m serving_integration.server.launch ... --dry-run                        # print, do not start
    python -m serving_integration.server.launch ... -- --tp-size 2 --max-total-tokens 200000

It runs `python -m sglang.launch_server` (replacing this process) with the recommended flags:
`--enable-hierarchical-cache --hicache-ratio R --hicache-write-policy write_through
--enable-metrics --enable-cache-report`, the policy, and for pbkv / pbkv_lae / kvflow the
plugin's `--radix-eviction-policy-config` (checkpoint, gamma, prefetch, ...). Anything after
`--` goes to SGLang unchanged. Before starting it checks what would otherwise fail inside the
server's scheduler: the plugin's entry point is installed in this environment, and the
checkpoint (or kvflow's step-graph traces) can be read.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

from serving_integration.cache.policies import PLUGIN_POLICIES, SGLANG_POLICIES

PLUGIN_GROUP = "sglang.srt.plugins"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m serving_integration.server.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--policy", default="pbkv", choices=PLUGIN_POLICIES + SGLANG_POLICIES)
    p.add_argument("--checkpoint", help="train.py predictor.pt (pbkv; optional for pbkv_lae prefetch)")
    p.add_argument("--step-graph-traces", help="kvflow: trace dataset dir whose train split gives the step graph")
    p.add_argument("--prefetch", choices=("none", "conservative", "aggressive"),
                   help="default: conservative for pbkv, none for pbkv_lae, aggressive for kvflow")
    p.add_argument("--gamma", type=float, help="PBKV's lookahead discount (default 0.5)")
    p.add_argument("--policy-config", default="{}",
                   help="more plugin options as JSON, e.g. '{\"predictor_timeout_s\": 0.1}' (docs/serving.md)")
    p.add_argument("--stats-path", help="file the plugin writes its counters to (JSON, every 10 s)")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="host KV pool = ratio x GPU pool")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    return p.parse_args(argv), extra


def policy_config(args: argparse.Namespace) -> dict:
    """The plugin's --radix-eviction-policy-config; paths absolute, as the server may run elsewhere."""
    config = json.loads(args.policy_config)
    if not isinstance(config, dict):
        raise ValueError("--policy-config must be a JSON object")
    for key, path in (("checkpoint", args.checkpoint), ("step_graph_traces", args.step_graph_traces),
                      ("stats_path", args.stats_path)):
        if path is not None:
            config[key] = str(Path(path).resolve())
    for key, value in (("prefetch", args.prefetch), ("gamma", args.gamma)):
        if value is not None:
            config[key] = value
    return config


def build_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
           "--host", args.host, "--port", str(args.port),
           "--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio),
           "--hicache-write-policy", "write_through", "--enable-metrics", "--enable-cache-report",
           "--radix-eviction-policy", args.policy]
    if args.policy in PLUGIN_POLICIES:
        cmd += ["--radix-eviction-policy-config", json.dumps(policy_config(args), sort_keys=True)]
    return cmd + extra


def preflight(args: argparse.Namespace) -> list[str]:
    """Problems that would otherwise surface only inside the server's scheduler process."""
    if args.policy not in PLUGIN_POLICIES:
        return []
    problems = []
    names = {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP)}
    if names.get("pbkv") != "serving_integration.server.plugin:register":
        problems.append(f"the PBKV plugin is not installed in this environment (no '{PLUGIN_GROUP}' entry point "
                        "'pbkv'); run `pip install -c constraints.txt --no-deps -e .` in the repository")
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "pbkv" not in {x.strip() for x in allowed.split(",")}:
        problems.append(f"SGLANG_PLUGINS={allowed!r} excludes the 'pbkv' plugin")
    if args.policy == "pbkv" and not args.checkpoint:
        problems.append("--policy pbkv needs --checkpoint (a train.py predictor.pt)")
    if args.checkpoint:
        try:
            from models import read_checkpoint

            read_checkpoint(args.checkpoint)
        except Exception as e:  # noqa: BLE001  (report any unreadable checkpoint the same way)
            problems.append(f"--checkpoint: {e}")
    if args.policy == "kvflow" and not (args.step_graph_traces and Path(args.step_graph_traces).is_dir()):
        problems.append("--policy kvflow needs --step-graph-traces DIR (a trace dataset)")
    try:
        policy_config(args)
    except ValueError as e:
        problems.append(str(e))
    return problems


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    problems = preflight(args)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    cmd = build_command(args, extra)
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    os.execv(cmd[0], cmd)  # the server replaces this process, so signals reach it directly
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
