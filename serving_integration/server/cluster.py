"""A real cluster on one machine: N SGLang servers (`launch`, each on its own port) behind one
sglang-router (docs/cluster.md, "A real cluster").

    python -m serving_integration.server.cluster --replicas 2 --routing sticky --max-total-tokens 32000 \\
        --port 30000 -- --cpu --policy pbkv --checkpoint RUN/predictor.pt
    python -m serving_integration.experiments.bench --url http://127.0.0.1:30000 --routing sticky ...

Everything after `--` goes to every server's `launch` (`--cpu`, `--policy`, `--checkpoint`, ...);
`--max-total-tokens` is the cluster's total device KV pool, split evenly (each server gets
total // N, as the simulator splits `sim.gpu_tokens` over `sim.replicas`). The servers start
together and are waited for (`/health`, at most `--health-timeout` seconds); then the router starts
with their URLs (`python -m sglang_router.launch_router`), and is waited for the same way. On exit,
SIGINT or SIGTERM the router and every server are stopped by process group (LocalProcess).

Routing (`--routing`, the simulator's names, serving_integration/cache/router.py) to the router:
    round_robin  --policy round_robin
    cache_aware  --policy cache_aware (sglang-router's defaults, as the simulator's CacheAware)
    sticky       --policy manual --assignment-mode min_load; the client sends the workflow id in
                 the routing-key header, so a workflow stays on the worker its first call got
    pbkv         --policy consistent_hashing; the client chooses the worker with the PBKV router
                 class (serving_integration/cache/router.py) and names it in the target-worker
                 header (the worker's index in the router's list; the cluster finds the index of
                 each server with one probe request at start). sglang-router 0.3.2's Rust core has
                 this policy and header, its command line does not list the policy: the router
                 is started through `run_router`, which adds it to the choices.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from serving_integration.server.launch import LocalProcess, LocalServer, free_port, split_at_dashes

ROUTING_KEY_HEADER = "x-smg-routing-key"  # sglang-router 0.3.2, manual policy: same key -> same worker
TARGET_WORKER_HEADER = "x-smg-target-worker"  # sglang-router 0.3.2, consistent_hashing: worker index
ROUTER_POLICIES = {
    "round_robin": ["--policy", "round_robin"],
    "cache_aware": ["--policy", "cache_aware"],
    "sticky": ["--policy", "manual", "--assignment-mode", "min_load"],
    "pbkv": ["--policy", "consistent_hashing"],
}


def routing_headers(routing: str, workflow_id: str, worker_index: int | None = None) -> dict[str, str]:
    """The headers a client sends with a call of `workflow_id` under `routing` (worker_index: the
    router's index of the worker pbkv chose)."""
    if routing == "sticky":
        return {ROUTING_KEY_HEADER: workflow_id}
    if routing == "pbkv":
        if worker_index is None:
            raise ValueError("pbkv routing needs the router's index of the chosen worker")
        return {TARGET_WORKER_HEADER: str(worker_index)}
    return {}


def run_router(argv: list[str] | None = None) -> None:
    """`python -m sglang_router.launch_router ARGS`, with `consistent_hashing` among the policies
    (sglang-router 0.3.2's Rust core and Python binding have it; its command line lists only
    random, round_robin, cache_aware, power_of_two and manual)."""
    from sglang_router.launch_router import launch_router
    from sglang_router.router_args import RouterArgs

    args = router_parser().parse_args(sys.argv[1:] if argv is None else argv)
    launch_router(RouterArgs.from_cli_args(args))


def router_parser() -> argparse.ArgumentParser:
    """sglang-router's own argument parser (RouterArgs.add_cli_args), `consistent_hashing` added."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="sglang-router")
    RouterArgs.add_cli_args(parser)
    for action in parser._actions:
        if action.dest == "policy" and "consistent_hashing" not in action.choices:
            action.choices = [*action.choices, "consistent_hashing"]
    return parser


def router_command(worker_urls: list[str], routing: str, port: int, prometheus_port: int,
                   extra: list[str] | None = None) -> list[str]:
    if routing not in ROUTER_POLICIES:
        raise ValueError(f"unknown routing '{routing}'; choose from {', '.join(ROUTER_POLICIES)}")
    return [sys.executable, "-c", "from serving_integration.server.cluster import run_router; run_router()", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, *ROUTER_POLICIES[routing], "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prometheus_port), "--log-level", "warn", *(extra or [])]


class LocalRouter(LocalProcess):
    """sglang-router as a LocalProcess; healthy once `/readiness` answers 200 (its `/health` does as
    soon as it listens, before the workers are registered, when requests still get 503)."""

    health_path = "/readiness"


class LocalCluster:
    """N `launch` servers and, in front of them, one sglang-router per routing policy asked for
    (routers are cheap; the servers are not): `with LocalCluster(["--cpu", "--policy", "lru"], 2,
    "sticky", 32000) as c: c.url, c.worker_urls`. `routing` is a name or a list of names; `url` is the
    first one's router, `urls[name]` each one's. For pbkv, `worker_index[i]` is the router's index
    of server i (what the target-worker header names), found with one probe request per server."""

    def __init__(self, launch_args: list[str], replicas: int, routing: str | list[str], total_tokens: int,
                 log_dir: str | Path | None = None, health_timeout_s: float = 240.0, port: int | None = None,
                 router_args: list[str] | None = None):
        routings = [routing] if isinstance(routing, str) else list(routing)
        unknown = [r for r in routings if r not in ROUTER_POLICIES]
        if not routings or unknown:
            raise ValueError(f"unknown routing {unknown}; choose from {', '.join(ROUTER_POLICIES)}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1; got {replicas}")
        if total_tokens // replicas < 1:
            raise ValueError(f"--max-total-tokens {total_tokens} is less than one token per replica")
        if "--max-total-tokens" in launch_args:
            raise ValueError("give the cluster's total --max-total-tokens to the cluster, not to each server")
        import tempfile

        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="pbkv-cluster-"))
        self.replicas, self.routing, self.tokens_per_replica = replicas, routings[0], total_tokens // replicas
        self.servers = [LocalServer([*launch_args, "--max-total-tokens", str(self.tokens_per_replica)],
                                    log_path=self.log_dir / f"server-{i}.log", health_timeout_s=health_timeout_s)
                        for i in range(replicas)]
        self.worker_urls = [s.url for s in self.servers]
        self._routings, self._port, self._router_args = routings, port, router_args
        self.health_timeout_s = health_timeout_s
        self.routers: dict[str, LocalRouter] = {}  # made once the servers are up (their ports taken)
        self.urls: dict[str, str] = {}
        self.url = ""
        self.worker_index: list[int] = []
        self.ready_s = float("nan")

    def _make_routers(self) -> None:
        for k, name in enumerate(self._routings):
            router_port = (self._port if k == 0 else None) or free_port()
            self.routers[name] = LocalRouter(
                router_command(self.worker_urls, name, router_port, free_port(), self._router_args),
                f"http://127.0.0.1:{router_port}", log_path=self.log_dir / f"router-{name}.log",
                health_timeout_s=self.health_timeout_s)
        self.urls = {name: r.url for name, r in self.routers.items()}
        self.url = self.urls[self.routing]

    def __enter__(self) -> "LocalCluster":
        try:
            for server in self.servers:  # all start at once; each is waited for from its own start
                server.start()
            for server in self.servers:
                server.wait_healthy()
            self.worker_urls = [s.url for s in self.servers]  # a server whose port was taken moved to another
            self._make_routers()  # free ports picked now: a starting server takes ports of its own
            for router in self.routers.values():
                router.start()
            for router in self.routers.values():
                router.wait_healthy()
            if "pbkv" in self.routers:
                self.worker_index = probe_worker_index(self.urls["pbkv"], self.worker_urls)
        except BaseException:
            self.stop()
            raise
        self.ready_s = max(s.ready_s for s in self.servers) + max(r.ready_s for r in self.routers.values())
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for process in (*self.routers.values(), *self.servers):
            process.stop()


def probe_worker_index(router_url: str, worker_urls: list[str]) -> list[int]:
    """The router's index of each server, as the target-worker header names it (pbkv routing): a
    one-token request per index, seen in exactly one server's request count (sglang:num_requests_total)."""
    index = [-1] * len(worker_urls)
    for j in range(len(worker_urls)):
        before = [request_count(u) for u in worker_urls]
        _post_json(f"{router_url}/generate", {"input_ids": [1000], "sampling_params": {"max_new_tokens": 1}},
                   {TARGET_WORKER_HEADER: str(j)})
        after = [request_count(u) for u in worker_urls]
        moved = [i for i in range(len(worker_urls)) if after[i] > before[i]]
        if len(moved) != 1 or index[moved[0]] != -1:
            raise RuntimeError(f"target-worker probe {j} through {router_url} reached servers {moved} "
                               f"(request counts {before} -> {after}); is its policy consistent_hashing?")
        index[moved[0]] = j
    return index


def _post_json(url: str, body: dict, headers: dict | None = None, timeout: float = 120.0) -> dict:
    import json
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def server_metrics(url: str, timeout: float = 30.0) -> dict[str, float]:
    """A server's request and token counters from its Prometheus `/metrics` (--enable-metrics):
    requests, prompt_tokens, and cached_tokens_<source> (device, host, ...) summed over labels."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        return parse_metrics(resp.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """server_metrics of a /metrics text (Prometheus exposition format, prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"requests": 0.0, "prompt_tokens": 0.0}
    names = {"sglang:num_requests": "requests", "sglang:prompt_tokens": "prompt_tokens"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name in names:
                out[names[family.name]] += sample.value
            elif family.name == "sglang:cached_tokens":
                key = f"cached_tokens_{sample.labels.get('cache_source', 'all')}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def request_count(url: str) -> float:
    return server_metrics(url)["requests"]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv, launch = split_at_dashes(argv)
    p = argparse.ArgumentParser(prog="python -m serving_integration.server.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routing", default="sticky", choices=list(ROUTER_POLICIES))
    p.add_argument("--max-total-tokens", type=int, default=32000,
                   help="the cluster's device KV pool in tokens, split evenly over the replicas")
    p.add_argument("--port", type=int, default=30000, help="the router's port (the servers get free ports)")
    p.add_argument("--log-dir", help="server-I.log and router.log (default: a temporary directory)")
    p.add_argument("--health-timeout", type=float, default=240.0, help="seconds to wait for each /health")
    p.add_argument("--router-arg", action="append", default=[], help="one more sglang-router argument (repeat)")
    args = p.parse_args(argv)
    return args, launch or ["--cpu"]


def main(argv: list[str] | None = None) -> int:
    args, launch = parse_args(argv)

    def stop_on(signum, frame):  # leave the with-block, which stops everything
        raise KeyboardInterrupt

    # both set here: a shell starting this in the background leaves SIGINT ignored
    signal.signal(signal.SIGTERM, stop_on)
    signal.signal(signal.SIGINT, stop_on)
    cluster = LocalCluster(launch, args.replicas, args.routing, args.max_total_tokens, args.log_dir,
                           args.health_timeout, args.port, args.router_arg)
    try:
        with cluster:
            print(f"router {cluster.url} ({args.routing}) -> {' '.join(cluster.worker_urls)}; "
                  f"{cluster.tokens_per_replica} device tokens each; logs in {cluster.log_dir}; Ctrl-C stops",
                  flush=True)
            signal.pause()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
