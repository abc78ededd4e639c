"""Start stock SGLang 0.5.23 with HiCache and a cache policy (PBKV's through the plugin).

    python -m serving_integration.server.launch --model-path Qwen/Qwen3-14B --policy pbkv \\
        --checkpoint runs/train/markov/predictor.pt
    python -m serving_integration.server.launch --model-path M --policy lru          # the baseline
    python -m serving_integration.server.launch ... --dry-run                        # print, do not start
    python -m serving_integration.server.launch ... -- --tp-size 2 --max-total-tokens 200000
    python -m serving_integration.server.launch --cpu --policy lru                   # no GPU (below)

It runs `python -m sglang.launch_server` (replacing this process) with the recommended flags:
`--enable-hierarchical-cache --hicache-ratio R --hicache-write-policy write_through
--enable-metrics --enable-cache-report`, the policy, and for the plugin's policies (pbkv, pbkv_lae,
kvflow, kvflow_ideal, kvflow_nolae, continuum, lru_prefetch) the plugin's
`--radix-eviction-policy-config` (checkpoint, gamma, prefetch, ...). Anything after `--` goes to
SGLang unchanged. Before starting it checks what would otherwise fail inside the server's
scheduler: the plugin's entry point is installed in this environment, and the checkpoint (or the
KVFlows' step-graph traces) can be read.

`--cpu` serves on a machine without a GPU (docs/serving.md, "SGLang on a CPU"): the model defaults
to the tiny random Llama of tiny_model.py (built on first use), the server gets SGLang's CPU flags
(`--device cpu --attention-backend torch_native --sampling-backend pytorch --disable-cuda-graph
--dtype float32 --max-total-tokens N --sleep-on-idle`, HiCache with `--hicache-io-backend direct
--hicache-mem-layout layer_first --disable-overlap-schedule`), the environment
`SGLANG_USE_CPU_ENGINE=1` and `SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`, and a PYTHONPATH of
cpu_support/ (a stand-in sgl_kernel and the torchvision guard, see its README.md) and this repository.
Its compute threads are `OMP_NUM_THREADS=--cpu-threads` (default 1): the stand-in sgl_kernel cannot
bind threads to cores as SGLang's CPU kernels do, and with torch's default (one thread per core)
a server sharing the cores with another process (a second replica, the bench client, a test run)
spins its OpenMP threads against it, measured 6-8x slower per replay on 2 cores
(docs/serving.md, "SGLang on a CPU").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

from data import REPO
from serving_integration.cache.policies import PLUGIN_POLICIES, SGLANG_POLICIES, STEP_GRAPH_POLICIES, Prefetch
from serving_integration.simulator.config import SimConfig

PLUGIN_GROUP = "sglang.srt.plugins"
CPU_SUPPORT = Path(__file__).resolve().parent / "cpu_support"
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--dtype", "float32", "--sleep-on-idle", "--hicache-io-backend", "direct",
             "--hicache-mem-layout", "layer_first", "--disable-overlap-schedule"]
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}


def split_at_dashes(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """The command line (default sys.argv) before and after its first `--` (what is passed on)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_at_dashes(argv)
    p = argparse.ArgumentParser(prog="python -m serving_integration.server.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="required without --cpu; with --cpu default: the tiny random Llama")
    p.add_argument("--cpu", action="store_true", help="serve on the CPU (tiny model, CPU flags, cpu_support/)")
    p.add_argument("--max-total-tokens", type=int,
                   help="device KV pool in tokens (default with --cpu: 32000; else SGLang's memory fraction)")
    p.add_argument("--cpu-threads", type=int, default=1, help="--cpu: OMP_NUM_THREADS of the server (default 1)")
    p.add_argument("--tiny-model-dir", default=None,
                   help="--cpu: where the tiny model is built/cached (default .cache/pbkv/models/tiny-llama)")
    p.add_argument("--policy", default="pbkv", choices=PLUGIN_POLICIES + SGLANG_POLICIES)
    p.add_argument("--checkpoint", help="train.py predictor.pt (pbkv, pbkv_time; optional for pbkv_lae prefetch)")
    p.add_argument("--step-graph-traces",
                   help="kvflow, kvflow_ideal, kvflow_nolae: trace dataset dir whose train split gives the step graph")
    p.add_argument("--prefetch", choices=Prefetch.MODES,
                   help="default: conservative for pbkv, none for pbkv_lae, aggressive for kvflow_ideal, the "
                        "policy's own for kvflow (kvflow) and lru_prefetch (last_call), which no other policy takes")
    p.add_argument("--gamma", type=float, help="PBKV's lookahead discount (default 0.5)")
    p.add_argument("--policy-config", default="{}",
                   help="more plugin options as JSON, e.g. '{\"predictor_timeout_s\": 0.1}' (docs/serving.md)")
    p.add_argument("--stats-path", help="file the plugin writes its counters to (JSON, every 10 s)")
    p.add_argument("--hidden-state", action="store_true",
                   help="capture each tagged request's hidden state at its last prefill token (the plugin's "
                        "hidden_state; adds SGLang's --enable-return-hidden-states --return-hidden-states-mode last)")
    p.add_argument("--hidden-layer", type=int,
                   help="with --hidden-state: the output of this decoder layer instead of the final one "
                        "(the plugin's hidden_layer; adds SGLang's aux hidden-state capture flags)")
    p.add_argument("--hicache-ratio", type=float, default=SimConfig.hicache_ratio, help="host KV pool = ratio x GPU pool")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args = p.parse_args(argv)
    if not args.model_path and not args.cpu:
        p.error("--model-path is required (or --cpu for the tiny CPU model)")
    if args.cpu and args.max_total_tokens is None:
        args.max_total_tokens = 32000
    if args.cpu_threads < 1:
        p.error(f"--cpu-threads must be at least 1, got {args.cpu_threads}")
    return args, extra


def policy_config(args: argparse.Namespace) -> dict:
    """The plugin's --radix-eviction-policy-config; paths absolute, as the server may run elsewhere."""
    config = json.loads(args.policy_config)
    if not isinstance(config, dict):
        raise ValueError("--policy-config must be a JSON object")
    for key, path in (("checkpoint", args.checkpoint), ("step_graph_traces", args.step_graph_traces),
                      ("stats_path", args.stats_path)):
        if path is not None:
            config[key] = str(Path(path).resolve())
    for key, value in (("prefetch", args.prefetch), ("gamma", args.gamma), ("hidden_layer", args.hidden_layer),
                       ("hidden_state", args.hidden_state or None)):
        if value is not None:
            config[key] = value
    return config


def hidden_state_flags(config: dict) -> list[str]:
    """SGLang's flags for the plugin's hidden-state capture: the server's capture mode "last" (the
    forward keeps one row per request, what its LM head reads; CUDA graphs are captured in that
    mode), and for a layer other than the final one SGLang's aux capture (EAGLE3 convention,
    speculative decoding stays off)."""
    if not config.get("hidden_state"):
        return []
    flags = ["--enable-return-hidden-states", "--return-hidden-states-mode", "last"]
    if config.get("hidden_layer") is not None:
        flags += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                  "--return-aux-hidden-state-layer-ids", str(config["hidden_layer"])]
    return flags


def build_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    model_path = args.model_path or str(Path(args.tiny_model_dir or REPO / ".cache/pbkv/models/tiny-llama").resolve())
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
           "--host", args.host, "--port", str(args.port),
           "--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio),
           "--hicache-write-policy", "write_through", "--enable-metrics", "--enable-cache-report",
           "--radix-eviction-policy", args.policy]
    if args.policy in PLUGIN_POLICIES:
        config = policy_config(args)
        cmd += ["--radix-eviction-policy-config", json.dumps(config, sort_keys=True), *hidden_state_flags(config)]
    if args.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.cpu:
        cmd += CPU_FLAGS
    return cmd + extra


def server_env(args: argparse.Namespace, base: dict | None = None) -> dict:
    """The server's environment: with --cpu, SGLang's CPU switches and cpu_support/ + the repository
    first on PYTHONPATH (a stand-in sgl_kernel must be importable before sglang's scheduler is)."""
    env = dict(os.environ if base is None else base)
    if args.cpu:
        env.update(CPU_ENV)
        env["OMP_NUM_THREADS"] = str(args.cpu_threads)
        paths = [str(CPU_SUPPORT), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.pop("PYTHONPYCACHEPREFIX", None)  # sglang's imports cost 3x CPU with it
    return env


def preflight(args: argparse.Namespace) -> list[str]:
    """Problems that would otherwise surface only inside the server's scheduler process."""
    if args.policy not in PLUGIN_POLICIES:
        return ["--hidden-state needs a plugin policy (pbkv, pbkv_lae, kvflow)"] if args.hidden_state else []
    problems = []
    names = {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP)}
    if names.get("pbkv") != "serving_integration.server.plugin:register":
        problems.append(f"the PBKV plugin is not installed in this environment (no '{PLUGIN_GROUP}' entry point "
                        "'pbkv'); run `pip install -c constraints.txt --no-deps -e .` in the repository")
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "pbkv" not in {x.strip() for x in allowed.split(",")}:
        problems.append(f"SGLANG_PLUGINS={allowed!r} excludes the 'pbkv' plugin")
    if args.policy in ("pbkv", "pbkv_time") and not args.checkpoint:
        problems.append(f"--policy {args.policy} needs --checkpoint (a train.py predictor.pt)")
    if args.checkpoint:
        try:
            from models import read_checkpoint

            text = (read_checkpoint(args.checkpoint)["init"].get("text") or {})
            if text.get("source") == "hidden" and not policy_config(args).get("hidden_state"):
                problems.append(f"--checkpoint {args.checkpoint} reads the serving model's hidden state: "
                                "pass --hidden-state")
        except Exception as e:  # noqa: BLE001  (report any unreadable checkpoint the same way)
            problems.append(f"--checkpoint: {e}")
    if args.policy in STEP_GRAPH_POLICIES and not (args.step_graph_traces and Path(args.step_graph_traces).is_dir()):
        problems.append(f"--policy {args.policy} needs --step-graph-traces DIR (a trace dataset)")
    try:
        problems += hidden_layer_problems(policy_config(args), args)
    except ValueError as e:
        problems.append(str(e))
    return problems


def hidden_layer_problems(config: dict, args: argparse.Namespace) -> list[str]:
    """SGLang's aux capture (EAGLE3 convention) takes layer L's output as the input of layer L + 1:
    the last layer has none, and a layer past the model fails inside the scheduler. Checked here
    when the model's config.json is at hand (a local model directory, or the tiny CPU model)."""
    layer = config.get("hidden_layer")
    if layer is None:
        return []
    if args.model_path:
        config_file = Path(args.model_path) / "config.json"
        layers = json.loads(config_file.read_text()).get("num_hidden_layers") if config_file.is_file() else None
    else:
        from serving_integration.server.tiny_model import SPEC

        layers = SPEC["num_hidden_layers"]
    if layers is not None and not 0 <= layer < layers - 1:
        return [f"--hidden-layer {layer}: the model has {layers} layers; SGLang's capture takes the output of "
                f"layers 0..{layers - 2} (the last one's is the final hidden state: leave --hidden-layer out)"]
    return []


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    problems = preflight(args)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    cmd = build_command(args, extra)
    env = server_env(args)
    shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in [*CPU_ENV, "PYTHONPATH"] if args.cpu)
    print(f"{shown} {shlex.join(cmd)}".strip(), flush=True)
    if args.dry_run:
        return 0
    if args.cpu and not args.model_path:
        from serving_integration.server.tiny_model import build

        build(cmd[cmd.index("--model-path") + 1])
    os.execve(cmd[0], cmd, env)  # the server replaces this process, so signals reach it directly
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())


# -------------------------------------------------------------------- a server owned by a program


class LocalProcess:
    """A command in a subprocess of its own process group, owned by a program: `start()` it, then
    `wait_healthy()` for `url + health_path` (at most `health_timeout_s`; the log tail is in the error
    if it dies or times out); `stop()` terminates the whole process group, then kills it after
    `stop_timeout_s`. As a context manager: start, wait, and stop on leaving."""

    health_path = "/health"
    fatal_log_marks: tuple[str, ...] = ()  # a log line with one of these: the process will not become healthy

    def __init__(self, cmd: list[str], url: str, log_path: str | Path | None = None,
                 health_timeout_s: float = 240.0, stop_timeout_s: float = 20.0, env: dict | None = None):
        self.cmd, self.url = cmd, url
        self.log_path = Path(log_path) if log_path else None
        self.health_timeout_s, self.stop_timeout_s, self.env = health_timeout_s, stop_timeout_s, env
        self.proc = None
        self.ready_s = math.nan
        self._started = math.nan

    def __enter__(self):
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        import subprocess
        import tempfile
        import time

        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="pbkv-server-")) / "server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
            [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self._started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, env=env, start_new_session=True)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def wait_healthy(self) -> None:
        import time
        import urllib.error
        import urllib.request

        name = type(self).__name__
        while time.monotonic() - self._started < self.health_timeout_s:
            if self.proc.poll() is not None or any(mark in self.log_tail() for mark in self.fatal_log_marks):
                raise RuntimeError(f"{name} {self.url} failed before it was healthy (exit code {self.proc.returncode}); "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}{self.health_path}", timeout=5) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - self._started
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2.0)
        raise TimeoutError(f"{name} {self.url} was not healthy within {self.health_timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.proc.pid):
                break


PORT_TAKEN = "error while attempting to bind on address"  # uvicorn's, when the port is taken (errno 98)
PORT_ATTEMPTS = 3


class LocalServer(LocalProcess):
    """`launch` as a LocalProcess, for programs and tests that need a live server:
    `with LocalServer(["--cpu", "--policy", "lru"]) as server: server.url ...`. The launcher's PID
    is the server's (it execs); sglang's scheduler and detokenizer processes share its group."""

    fatal_log_marks = (PORT_TAKEN,)

    def __init__(self, launch_args: list[str], port: int | None = None, log_path: str | Path | None = None,
                 health_timeout_s: float = 240.0, stop_timeout_s: float = 20.0, env: dict | None = None):
        self.args, self.port_given = list(launch_args), port is not None
        super().__init__([], "", log_path, health_timeout_s, stop_timeout_s, env)
        self._listen_on(port or free_port())

    def _listen_on(self, port: int) -> None:
        self.port = port
        self.launch_args = [*self.args, "--port", str(port)]
        self.cmd = [sys.executable, "-m", "serving_integration.server.launch", *self.launch_args]
        self.url = f"http://127.0.0.1:{port}"

    def wait_healthy(self) -> None:
        """As LocalProcess's; a free port picked for the server can be taken before the server binds
        it (an outgoing connection's source port comes from the same range), and then it starts
        again on another one, up to PORT_ATTEMPTS times."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return super().wait_healthy()
            except RuntimeError:
                if self.port_given or attempt == PORT_ATTEMPTS or PORT_TAKEN not in self.log_tail():
                    raise
            self.stop()
            self._listen_on(free_port())
            self.start()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
