"""Replay a trace dataset against a live SGLang server and measure what its cache policy does.

    python -m serving_integration.experiments.bench --url http://127.0.0.1:30000 --data DIR --concurrency 8 \\
        --out runs/bench/hover [--append] [--save-trace runs/bench/hover/collected]

Closed loop, as in the simulator: C workflows are live; each sends its next call when the previous
one has finished plus that call's tool time (scaled by --tool-time-scale); a new workflow starts
when one ends. Every call is a streamed `/generate` request with `input_ids` and
`max_new_tokens = output_tokens` (`ignore_eos`), carrying its workflow id, agent and step
(workflow_tags.py; `sampling_params.custom_params` by default, `kv_hints` with --metadata kv_hints).
The end of a workflow is sent as a real orchestrator can send it: once its last call returned, a
tiny request (one prompt token, one output token) whose tag says `end_signal` (--end-signal request,
the default); `last-call` flags the last call itself instead (which needs knowing the future),
`none` sends nothing (the plugin's inactivity timeout retires the workflow).

Token ids: a segment's ids are drawn deterministically from its segment id (prefix-stable), so
prompts that share a segment prefix share a token prefix and hit the same radix-tree nodes. A
call's output segment is replaced, in the later prompts that contain it, by the tokens the server
actually generated, as an agent framework would append the real answer.

Per call it records TTFT (first streamed chunk), end-to-end latency, and the cached tokens the
server reports (`meta_info.cached_tokens`, split device / host by `cached_tokens_details`). It
writes summary.json with one row in evaluate.py's schema (hit_rate is the GPU hit share of prompt
tokens; host hits are counted apart), calls.jsonl with every call, and with --save-trace the
replayed calls as a trace dataset (native trace format, imported with data.import_traces): the way
to collect traces from a live server. With --save-trace each call's tag asks the plugin for the
hidden state it captured (`return_hidden`; the server runs with --hidden-state), which the trace
stores per call, with the served model's name and hidden size in the dataset's meta.json.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from serving_integration.cache.metrics import per_workflow_results, replay_metrics
from serving_integration.experiments.rows import make_row
from serving_integration.cache.workflow_tags import (HIDDEN_RESPONSE_KEY, WorkflowTag, custom_params_for,
                                                     end_signal_tag, kv_hints_for, rid_for)

CHUNK = 256  # tokens per deterministic draw; fixed so that segment token lists are prefix-stable


# -------------------------------------------------------------------- what is replayed


@dataclass(frozen=True)
class ReplayCall:
    workflow_id: str
    step: int
    agent: str
    task: str
    workload: str
    prompt: tuple  # ((segment id, tokens), ...)
    output_id: str
    output_tokens: int
    tool_time: float
    first: bool
    last: bool


def replay_workflows(rows: list[dict]) -> list[list[ReplayCall]]:
    """Dataset call rows (grouped by workflow in step order) to the calls of each workflow."""
    workflows: dict[str, list[dict]] = {}
    for row in rows:
        workflows.setdefault(row["workflow_id"], []).append(row)
    out = []
    for wid, calls in workflows.items():
        out.append([ReplayCall(
            workflow_id=wid, step=int(r["step"]), agent=r["agent"], task=r.get("task") or "",
            workload=r.get("workload") or "", prompt=tuple(zip(r["prompt_ids"], r["prompt_segment_tokens"])),
            output_id=r.get("output_id") or f"{wid}/output/{r['step']}", output_tokens=int(r["output_tokens"]),
            tool_time=float(r.get("tool_time") or 0.0) if i else 0.0, first=i == 0, last=i == len(calls) - 1)
            for i, r in enumerate(calls)])
    return out


class SegmentTokens:
    """Token ids of prompt segments: drawn from the segment id, or the server's real output."""

    def __init__(self, low: int = 1000, high: int = 30000):
        if not 0 <= low < high:
            raise ValueError(f"token range must satisfy 0 <= low < high; got {low}, {high}")
        self.low, self.high = low, high
        self.drawn: dict[str, np.ndarray] = {}
        self.generated: dict[str, list[int]] = {}  # output segment id -> the server's tokens

    def tokens(self, segment_id: str, n: int) -> list[int]:
        if segment_id in self.generated:
            return self.generated[segment_id]
        drawn = self.drawn.get(segment_id)
        if drawn is None or len(drawn) < n:
            drawn = self.drawn[segment_id] = self._draw(segment_id, n)
        return drawn[:n].tolist()

    def _draw(self, segment_id: str, n: int) -> np.ndarray:
        seed = int.from_bytes(hashlib.blake2b(segment_id.encode(), digest_size=8).digest(), "little")
        chunks = [np.random.default_rng([seed, j]).integers(self.low, self.high, CHUNK)
                  for j in range(max(1, math.ceil(n / CHUNK)))]
        return np.concatenate(chunks)

    def prompt(self, call: ReplayCall) -> tuple[list[int], list[tuple[str, int]]]:
        """The call's input ids, and its segments with the token counts actually sent."""
        ids, sent = [], []
        for segment_id, n in call.prompt:
            tokens = self.tokens(segment_id, n)
            ids.extend(tokens)
            sent.append((segment_id, len(tokens)))
        return ids, sent


@dataclass
class CallResult:
    workflow_id: str
    step: int
    agent: str
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    device_tokens: int = 0
    host_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = math.nan
    latency_s: float = math.nan
    server_e2e_s: float = math.nan
    start_s: float = 0.0
    end_s: float = 0.0
    segments: list = field(default_factory=list)  # [(segment id, tokens sent)]
    output_ids: list = field(default_factory=list)
    output_text: str = ""  # the server's detokenized output (empty with --skip-tokenizer-init)
    hidden: list = field(default_factory=list)  # the plugin's hidden state of the last prefill token, if sent
    replica: int = -1  # the replica the client routed the call to (pbkv routing); -1: the router chose


# -------------------------------------------------------------------- the client


END_SIGNALS = ("request", "last-call", "none")


def request_body(call: ReplayCall, input_ids: list[int], metadata: str, stream: bool, rid: str,
                 end_on_last_call: bool = False, return_hidden: bool = False) -> dict:
    sampling = {"max_new_tokens": max(call.output_tokens, 1), "ignore_eos": True, "temperature": 0.0}
    # the task text (the predictor's text signal) travels once, on the workflow's first call
    tag = WorkflowTag(call.workflow_id, call.agent, call.step, call.last and end_on_last_call,
                      call.task if call.first else "", return_hidden=return_hidden)
    return tagged_body(tag, input_ids, sampling, metadata, stream, rid)


def end_signal_body(last: ReplayCall, token: int, metadata: str, rid: str) -> dict:
    """The end-of-workflow request sent after the workflow's last call returned."""
    sampling = {"max_new_tokens": 1, "temperature": 0.0}
    return tagged_body(end_signal_tag(last.workflow_id, last.agent), [token], sampling, metadata, False, rid)


def tagged_body(tag: WorkflowTag, input_ids: list[int], sampling: dict, metadata: str, stream: bool, rid: str) -> dict:
    body: dict = {"input_ids": input_ids, "sampling_params": sampling, "stream": stream, "rid": rid}
    if metadata == "custom_params":
        sampling["custom_params"] = custom_params_for(tag)
    elif metadata == "kv_hints":
        body["kv_hints"] = kv_hints_for(tag, rid)
    elif metadata == "rid":  # the tag in the request id: what passes through sglang-router (docs/cluster.md)
        body["rid"] = rid_for(tag, rid)
    return body


def read_meta(result: CallResult, meta: dict) -> None:
    result.prompt_tokens = int(meta.get("prompt_tokens") or 0)
    result.cached_tokens = int(meta.get("cached_tokens") or 0)
    result.completion_tokens = int(meta.get("completion_tokens") or 0)
    details = meta.get("cached_tokens_details") or {}
    # without a breakdown (no HiCache, older servers) every cached token was on the GPU
    result.device_tokens = int(details.get("device", result.cached_tokens))
    result.host_tokens = int(details.get("host", 0))
    if meta.get("e2e_latency") is not None:
        result.server_e2e_s = float(meta["e2e_latency"])
    hidden = meta.get(HIDDEN_RESPONSE_KEY)  # [vector] once the prefill is done (the plugin's return_hidden)
    if isinstance(hidden, list) and hidden and isinstance(hidden[0], list):
        result.hidden = hidden[0]


def take_output(result: CallResult, chunk: dict) -> None:
    """Output of a chunk: a cumulative snapshot (SGLang's default) or a delta (incremental)."""
    ids = list(chunk.get("output_ids") or [])
    text = chunk.get("text") if isinstance(chunk.get("text"), str) else ""
    done = int((chunk.get("meta_info") or {}).get("completion_tokens") or 0)
    if len(ids) == done or not result.output_ids:
        result.output_ids = ids
        result.output_text = text or result.output_text
    else:
        result.output_ids.extend(ids)
        result.output_text += text


async def generate(session, url: str, body: dict, result: CallResult, clock, headers: dict | None = None) -> None:
    import aiohttp

    sent = clock()
    try:
        async with session.post(f"{url}/generate", json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            if not body["stream"]:
                chunk = await resp.json()
                _take_chunk(result, chunk)
            else:
                async for line in resp.content:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    if math.isnan(result.ttft_s):
                        result.ttft_s = clock() - sent
                    _take_chunk(result, json.loads(payload))
                    if result.error:
                        return
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
        return
    result.latency_s = clock() - sent
    result.ok = not result.error and bool(result.output_ids)
    if not result.ok and not result.error:
        result.error = "no output"


def _take_chunk(result: CallResult, chunk: dict) -> None:
    if "error" in chunk:
        error = chunk["error"]
        result.error = str(error.get("message", error) if isinstance(error, dict) else error)[:200]
        return
    read_meta(result, chunk.get("meta_info") or {})
    take_output(result, chunk)


class ClosedLoopReplay:
    """C workers, each replaying whole workflows one call after another.

    Behind a router (serving_integration/server/cluster.py, docs/cluster.md) `routing` says what a
    call carries: `sticky` the workflow id as the routing key; `pbkv` the target worker chosen here
    by the PBKV router class (serving_integration/cache/router.py, the simulator's) over the
    replicas as this client sees them (ClientReplica), `worker_index[i]` being the router's index
    of replica i; other routings nothing (the router decides). A workflow's end signal goes where
    its calls went: under pbkv routing one to every replica the workflow visited (as the
    simulator retires a workflow on every replica)."""

    def __init__(self, url: str, workflows: list[list[ReplayCall]], concurrency: int, tokens: SegmentTokens,
                 metadata: str = "custom_params", stream: bool = True, tool_time_scale: float = 1.0,
                 request_timeout_s: float = 600.0, progress: bool = True, end_signal: str = "request",
                 routing: str = "none", replicas: int = 1, worker_index: list[int] | None = None,
                 replica_capacity_tokens: float = math.inf, router_options: dict | None = None,
                 return_hidden: bool = False):
        from serving_integration.cache.router import ROUTERS, ClientReplica, make_router

        if end_signal not in END_SIGNALS:
            raise ValueError(f"end_signal must be one of {', '.join(END_SIGNALS)}; got {end_signal!r}")
        if routing not in ROUTERS:
            raise ValueError(f"routing must be one of {', '.join(ROUTERS)}; got {routing!r}")
        self.routing, self.router, self.views = routing, None, []
        if routing == "pbkv":
            self.router = make_router("pbkv", replicas, **(router_options or {}))
            self.views = [ClientReplica(replica_capacity_tokens) for _ in range(replicas)]
            self.worker_index = list(worker_index) if worker_index is not None else list(range(replicas))
            if sorted(self.worker_index) != list(range(replicas)):
                raise ValueError(f"worker_index must order the {replicas} replicas; got {self.worker_index}")
        self.end_signal, self.end_signals_failed, self.end_signals_sent = end_signal, 0, 0
        self.return_hidden = return_hidden  # ask the plugin for each call's hidden state (--save-trace)
        self.visited: dict[str, dict[int, None]] = {}  # pbkv routing: workflow -> replicas its calls went to
        self.url, self.workflows, self.concurrency = url.rstrip("/"), workflows, concurrency
        self.tokens, self.metadata, self.stream = tokens, metadata, stream
        self.tool_time_scale, self.request_timeout_s, self.progress = tool_time_scale, request_timeout_s, progress
        self.results: list[CallResult] = []
        self.workflow_latencies: dict[str, float] = {}
        self.makespan_s = 0.0
        self.tool_s = 0.0  # time the workers spent in tool time (sleeping between calls), all workflows
        self._prompt_tokens = self._device_tokens = 0  # running totals for the progress bar

    async def run(self) -> None:
        import aiohttp
        from tqdm import tqdm

        queue: asyncio.Queue = asyncio.Queue()
        for wf in self.workflows:
            queue.put_nowait(wf)
        total = sum(len(wf) for wf in self.workflows)
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._clock = lambda: loop.time() - start
        bar = tqdm(total=total, desc="calls", unit="call", disable=not self.progress, file=sys.stderr)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=max(self.concurrency, 1))
        # a large read buffer: a streamed chunk is one line holding every output id so far
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=1 << 20) as session:
            workers = [asyncio.create_task(self._worker(session, queue, bar)) for _ in range(self.concurrency)]
            await asyncio.gather(*workers)
        bar.close()
        self.makespan_s = self._clock()

    async def _worker(self, session, queue: asyncio.Queue, bar) -> None:
        while not queue.empty():
            workflow = queue.get_nowait()
            began = self._clock()
            for call in workflow:
                if call.tool_time > 0 and self.tool_time_scale > 0:
                    slept = self._clock()
                    await asyncio.sleep(call.tool_time * self.tool_time_scale)
                    self.tool_s += self._clock() - slept
                result = await self._call(session, call)
                self.results.append(result)
                if result.ok:
                    self._prompt_tokens += result.prompt_tokens
                    self._device_tokens += result.device_tokens
                bar.update(1)
                bar.set_postfix(gpu_hit=f"{self._device_tokens / max(self._prompt_tokens, 1):.1%}", refresh=False)
            self.workflow_latencies[workflow[0].workflow_id] = self._clock() - began
            if self.end_signal == "request" and self.metadata != "none":
                await self._send_end(session, workflow[-1])

    async def _send_end(self, session, last: ReplayCall) -> None:
        import aiohttp

        from serving_integration.server.cluster import routing_headers

        if self.router is not None:
            self.router.forget(last.workflow_id)
            targets = [routing_headers("pbkv", last.workflow_id, self.worker_index[i])
                       for i in self.visited.pop(last.workflow_id, {})]
        else:
            targets = [routing_headers(self.routing, last.workflow_id)]
        for headers in targets:
            body = end_signal_body(last, self.tokens.low, self.metadata, f"{last.workflow_id}/end/{time.time_ns()}")
            try:
                async with session.post(f"{self.url}/generate", json=body, headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            self.end_signals_sent += 1
            self.end_signals_failed += not ok

    def _route(self, call: ReplayCall, segments: list) -> tuple[dict, int, object]:
        """The call's routing headers, the replica chosen here (-1: none) and the call as the router saw it."""
        from serving_integration.cache.workload import SimCall, SimWorkflow, prefix_keys
        from serving_integration.server.cluster import routing_headers

        if self.router is None:
            return routing_headers(self.routing, call.workflow_id), -1, None
        units = tuple(s for s, _ in segments)
        routed = SimCall(call.agent, units, tuple(n for _, n in segments), prefix_keys(units), call.output_id,
                         call.output_tokens, call.tool_time, None)
        i = self.router.route(SimWorkflow(call.workflow_id, 0, call.task, []), routed, self.views, self._clock())
        self.views[i].load += 1
        self.visited.setdefault(call.workflow_id, {})[i] = None
        return routing_headers("pbkv", call.workflow_id, self.worker_index[i]), i, routed

    async def _call(self, session, call: ReplayCall) -> CallResult:
        input_ids, segments = self.tokens.prompt(call)
        rid = f"{call.workflow_id}/{call.step}/{time.time_ns()}"
        result = CallResult(call.workflow_id, call.step, call.agent, segments=segments, start_s=self._clock())
        headers, result.replica, routed = self._route(call, segments)
        try:
            await generate(session, self.url, request_body(call, input_ids, self.metadata, self.stream, rid,
                                                           end_on_last_call=self.end_signal == "last-call",
                                                           return_hidden=self.return_hidden),
                           result, self._clock, headers)
        finally:
            if result.replica >= 0:
                self.views[result.replica].load -= 1
        if result.replica >= 0 and result.ok:
            self.views[result.replica].sent(routed)
        result.end_s = self._clock()
        if result.ok and call.output_tokens > 0:
            self.tokens.generated[call.output_id] = list(result.output_ids)
        if not result.prompt_tokens:
            result.prompt_tokens = len(input_ids)
        return result


# -------------------------------------------------------------------- results


def summarize(replay: ClosedLoopReplay, labels: dict, extra: dict | None = None) -> dict:
    """One row in evaluate.py's summary.json schema (serving_integration.experiments.rows)."""
    ok = [r for r in replay.results if r.ok]
    ttfts = [r.ttft_s for r in ok if not math.isnan(r.ttft_s)]
    labels = {**labels, "workflows": len(replay.workflows), "calls": len(replay.results)}
    return make_row(labels, {
        "failed_calls": len(replay.results) - len(ok),
        **replay_metrics(gpu_hit_tokens=sum(r.device_tokens for r in ok), host_hit_tokens=sum(r.host_tokens for r in ok),
                         prompt_tokens=sum(r.prompt_tokens for r in ok),
                         workflow_latencies=list(replay.workflow_latencies.values()), ttfts=ttfts, calls=len(ok),
                         makespan_s=replay.makespan_s,
                         # a client measures its own tool time; queueing, prefill, decode and PCIe
                         # happen inside the server and stay null
                         time_totals={"tool": replay.tool_s},
                         per_workflow=per_workflow_results(
                             replay.workflow_latencies,
                             ((r.workflow_id, r.prompt_tokens, r.prompt_tokens - r.device_tokens - r.host_tokens)
                              for r in ok))),
        "p99_ttft_s": float(np.percentile(ttfts, 99)) if ttfts else 0.0,
        "mean_call_latency_s": float(np.mean([r.latency_s for r in ok])) if ok else 0.0,
        "makespan_s": replay.makespan_s, **(extra or {}),
    })


async def server_info(url: str) -> dict:
    """The server's /server_info, or {} when it has none (any SGLang-compatible endpoint works)."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(f"{url.rstrip('/')}/server_info") as resp:
                return await resp.json() if resp.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
        return {}


def plugin_state(info: dict) -> dict:
    """The PBKV plugin's snapshot from /server_info (first scheduler), {} without the plugin."""
    for state in info.get("internal_states") or []:
        if isinstance(state, dict) and isinstance(state.get("pbkv"), dict):
            return state["pbkv"]
    return {}


def gpu_token_capacity(info: dict) -> int:
    """The server's GPU KV capacity in tokens (scheduler info, else the first scheduler's memory usage)."""
    if info.get("max_total_num_tokens"):
        return int(info["max_total_num_tokens"])
    for state in info.get("internal_states") or []:
        capacity = ((state or {}).get("memory_usage") or {}).get("token_capacity")
        if capacity:
            return int(capacity)
    return 0


def labels_for(args, info: dict, workload: str) -> dict:
    plugin = plugin_state(info)
    return {"workload": workload, "policy": args.policy or info.get("radix_eviction_policy") or "unknown",
            "prefetch": args.prefetch or plugin.get("prefetch") or "none",
            "gpu_tokens": args.gpu_tokens or gpu_token_capacity(info),
            "concurrency": args.concurrency, "noise": 0.0, "cost_model": f"sglang {args.url}",
            "seed": args.seed}


def replica_counters(worker_urls: list[str]) -> list[dict]:
    """Each replica's request and token counters (its Prometheus /metrics, server/cluster.py)."""
    from serving_integration.server.cluster import server_metrics

    return [server_metrics(url) for url in worker_urls]


def replica_stats(before: list[dict], after: list[dict], infos: list[dict]) -> list[dict]:
    """Per replica, what a replay added to its counters (requests, which count end signals too;
    prompt tokens; cached tokens by tier; its device hit rate) and its plugin's counters."""
    out = []
    for b, a, info in zip(before, after, infos):
        delta = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
        prompt = delta.get("prompt_tokens", 0.0)
        out.append({"requests": int(delta.get("requests", 0)), "prompt_tokens": int(prompt),
                    "device_tokens": int(delta.get("cached_tokens_device", 0)),
                    "host_tokens": int(delta.get("cached_tokens_host", 0)),
                    "hit_rate": delta.get("cached_tokens_device", 0.0) / prompt if prompt else 0.0,
                    "plugin_counters": plugin_state(info).get("counters", {}),
                    "live_workflows": plugin_state(info).get("live_workflows")})
    return out


def served_by(infos: list[dict]) -> dict[tuple[str, int], int]:
    """(workflow id, step) -> the replica whose PBKV plugin recorded the call (its recent tags);
    empty for replicas without the plugin (SGLang's own policies)."""
    out = {}
    for i, info in enumerate(infos):
        for tag in plugin_state(info).get("recent_tags") or []:
            out[(tag["workflow_id"], int(tag["step"]))] = i
    return out


def plugin_metrics(info: dict) -> dict:
    plugin = plugin_state(info)
    return {"prefetch_precision": plugin.get("prefetch_precision"), "plugin_counters": plugin.get("counters", {}),
            "hidden_cost_ms": (plugin.get("hidden") or {}).get("cost_ms")}


def hidden_report(info: dict) -> str | None:
    """One line on the plugin's hidden-state capture: calls captured, failed, used by predictions, and
    the cost per request (SGLang's copy to the host + the plugin's conversion and projection)."""
    plugin = plugin_state(info)
    counters, hidden = plugin.get("counters", {}), plugin.get("hidden") or {}
    if not plugin.get("config", {}).get("hidden_state"):
        return None
    cost = hidden.get("cost_ms")
    line = (f"hidden state: {counters.get('hidden_captured', 0)} captured (size {hidden.get('size')}), "
            f"{counters.get('hidden_capture_failed', 0)} failed, "
            f"{counters.get('hidden_missing', 0)} calls without one, "
            f"{counters.get('predicted_with_hidden', 0)} predictions used one")
    if cost:
        line += (f"; cost per request (copy + projection) mean {cost['mean']:.3f} ms, p50 {cost['p50']:.3f}, "
                 f"p99 {cost['p99']:.3f}, max {cost['max']:.3f} over the last {cost['n']}")
    return line


def save_trace(replay: ClosedLoopReplay, calls: dict, segment_table: dict, out: Path, fmt: str,
               model: dict | None = None) -> Path:
    """The replayed calls that succeeded as a trace dataset (data.import_traces reads it back).

    native keeps the segment ids and the token counts actually sent (the server's real output
    lengths included); chat keeps only message texts, which import_traces re-counts. Each call
    keeps the hidden state the plugin sent back; `model` ({"path", "hidden_size"}, the plugin's
    report) goes to the import, which checks every vector's size and records both in meta.json."""
    from data.cli import compose_config
    from data.formats import chat_records, native_records, write_jsonl_atomic
    from data.import_traces import import_traces
    from data.schema import call_record

    out.mkdir(parents=True, exist_ok=True)
    segments: dict[str, dict] = {}
    rows = []
    for r in sorted((r for r in replay.results if r.ok), key=lambda r: (r.workflow_id, r.step)):
        call = calls[(r.workflow_id, r.step)]
        for segment_id, _ in r.segments:
            known = segment_table.get(segment_id, {})
            segments.setdefault(segment_id, {"kind": known.get("kind") or "user", "text": known.get("text") or ""})
        segments[call.output_id] = {"kind": "assistant" if fmt == "chat" else "output", "text": r.output_text}
        rows.append(call_record(
            workflow_id=r.workflow_id, step=r.step, agent=r.agent, workload=call.workload, task=call.task,
            prompt_ids=[s for s, _ in r.segments], prompt_segment_tokens=[n for _, n in r.segments],
            output_tokens=len(r.output_ids) or r.completion_tokens, output_id=call.output_id,
            output_text=r.output_text, tool_time=call.tool_time * replay.tool_time_scale,
            start_time=r.start_s, end_time=r.end_s, hidden=r.hidden, end_of_workflow=call.last))
    source = out / f"calls.{fmt}.jsonl"
    write_jsonl_atomic(source, (native_records if fmt == "native" else chat_records)(rows, segments))
    hidden = []
    if rows and not any(row["hidden"] for row in rows):
        print("note: the server sent no hidden states; the trace has none (serve with launch --hidden-state "
              "and a plugin policy to collect them)", file=sys.stderr)
    elif model:
        hidden = [f"hidden_model={json.dumps(str(model.get('path') or ''))}"]
        if model.get("hidden_size"):
            hidden.append(f"hidden_size={int(model['hidden_size'])}")
    import_traces(compose_config("import_traces", [f"format={fmt}", f"src={source}", f"out={out / 'dataset'}",
                                                   "overwrite=true", *hidden]))
    return out / "dataset"


def write_summary(out: Path, row: dict, config: dict, append: bool) -> Path:
    from data.atomic import write_json

    path = out / "summary.json"
    rows = []
    if append and path.is_file():
        rows = json.loads(path.read_text()).get("rows", [])
    write_json(path, {"rows": rows + [row], "config": config})
    return path


# -------------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    from data.knobs import help_of
    from serving_integration.cache.router import ROUTERS
    from serving_integration.experiments.bench_config import BenchConfig, default

    p = argparse.ArgumentParser(prog="python -m serving_integration.experiments.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # the checked options take default and help from serving_integration/experiments/bench_config.py
    p.add_argument("--url", default=default("url"), help=help_of(BenchConfig, "url"))
    p.add_argument("--data", required=True, help=help_of(BenchConfig, "data"))
    p.add_argument("--split", default=default("split"), help=help_of(BenchConfig, "split"))
    p.add_argument("--n-workflows", type=int, default=default("n_workflows"), help=help_of(BenchConfig, "n_workflows"))
    p.add_argument("--concurrency", type=int, default=default("concurrency"), help=help_of(BenchConfig, "concurrency"))
    p.add_argument("--tool-time-scale", type=float, default=default("tool_time_scale"),
                   help=help_of(BenchConfig, "tool_time_scale"))
    p.add_argument("--metadata", choices=("custom_params", "kv_hints", "rid", "none"), default=None,
                   help="where the workflow tag travels (default: rid with --worker-urls, as sglang-router drops "
                        "custom_params and kv_hints; else custom_params)")
    p.add_argument("--no-stream", action="store_true", help="plain responses (no TTFT)")
    p.add_argument("--end-signal", choices=END_SIGNALS, default="request",
                   help="request: a tiny end-of-workflow request after the last call returned; last-call: flag "
                        "the last call; none: never (the plugin's inactivity timeout)")
    p.add_argument("--token-range", type=int, nargs=2, default=default("token_range"), metavar=("LOW", "HIGH"),
                   help=help_of(BenchConfig, "token_range"))
    p.add_argument("--request-timeout", type=float, default=default("request_timeout"),
                   help=help_of(BenchConfig, "request_timeout"))
    p.add_argument("--out", required=True, help=help_of(BenchConfig, "out"))
    p.add_argument("--append", action="store_true", help="add the row to an existing summary.json")
    p.add_argument("--policy", help="row label (default: the server's --radix-eviction-policy)")
    p.add_argument("--prefetch", help="row label (default: the plugin's prefetch mode, else none)")
    p.add_argument("--gpu-tokens", type=int, default=default("gpu_tokens"), help=help_of(BenchConfig, "gpu_tokens"))
    p.add_argument("--save-trace", help="also save the replayed calls as a trace dataset under this dir")
    p.add_argument("--save-format", choices=("native", "chat"), default="native",
                   help="native keeps segment ids and the token counts sent; chat re-counts message text")
    p.add_argument("--seed", type=int, default=default("seed"), help=help_of(BenchConfig, "seed"))
    p.add_argument("--routing", default="none", choices=list(ROUTERS),
                   help="behind sglang-router (server/cluster.py): sticky sends the workflow id as the routing "
                        "key, pbkv the target worker chosen by the PBKV router; the others send nothing")
    p.add_argument("--worker-urls", nargs="*", default=[],
                   help="the replicas behind --url (their order is the replica index): per-replica counters, "
                        "and pbkv routing's worker indices (one probe request each)")
    p.add_argument("--router-option", action="append", default=[], metavar="KEY=VALUE",
                   help="pbkv routing: an option of the PBKV router class (load_factor, load_slack)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def number(text: str) -> int | float:
    """A --router-option value: an integer where it is written as one (load_slack), else a float."""
    return int(text) if text.lstrip("+-").isdigit() else float(text)


def main(argv=None) -> int:
    from data.errors import run_reported

    args = parse_args(argv)
    status = []
    failed = run_reported(lambda: status.append(run(args)))
    return failed or status[0]


def run(args: argparse.Namespace) -> int:
    from data import store
    from data.atomic import check_output
    from serving_integration.experiments.bench_config import check_options
    from serving_integration.experiments.presentation import format_table

    check_options(vars(args))
    check_output(args.out, [args.data])
    if args.save_trace:
        check_output(args.save_trace, [args.data])
    ds = store.load(args.data)
    rows = ds.rows(None if args.split == "all" else args.split)
    workflows = replay_workflows(rows)[: args.n_workflows or None]
    if not workflows:
        print(f"error: split '{args.split}' of {args.data} has no workflows", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        from data.atomic import OutputError, describe

        raise OutputError(describe(e, out)) from None
    workers = list(args.worker_urls)
    metadata = args.metadata or ("rid" if workers else "custom_params")
    if args.routing == "pbkv" and len(workers) < 2:
        print("error: --routing pbkv needs --worker-urls (two or more replicas behind --url)", file=sys.stderr)
        return 2
    cluster: dict = {}
    if workers:
        from serving_integration.server.cluster import probe_worker_index

        index = probe_worker_index(args.url, workers) if args.routing == "pbkv" else None
        infos = [asyncio.run(server_info(u)) for u in workers]
        # what a replica can hold: its device pool and a host pool of --hicache-ratio times that
        capacity = min(gpu_token_capacity(i) * (1 + float(i.get("hicache_ratio") or 0)) for i in infos)
        cluster = {"routing": args.routing, "replicas": len(workers), "worker_index": index,
                   "replica_capacity_tokens": capacity or math.inf,
                   "router_options": {k: number(v) for k, v in (o.split("=", 1) for o in args.router_option)}}
        before = replica_counters(workers)
    replay = ClosedLoopReplay(args.url, workflows, args.concurrency, SegmentTokens(*args.token_range),
                              metadata=metadata, stream=not args.no_stream,
                              tool_time_scale=args.tool_time_scale, request_timeout_s=args.request_timeout,
                              progress=not args.no_progress, end_signal=args.end_signal,
                              return_hidden=bool(args.save_trace), **cluster)
    asyncio.run(replay.run())
    # behind a router (which has no /server_info), the first replica speaks for the servers
    info = asyncio.run(server_info(workers[0] if workers else args.url))
    extra = plugin_metrics(info)
    workload = workflows[0][0].workload or Path(args.data).name
    labels = labels_for(args, info, workload)
    if workers:
        infos = [asyncio.run(server_info(u)) for u in workers]
        extra["replica_stats"] = replica_stats(before, replica_counters(workers), infos)
        labels.update(replicas=len(workers), routing=args.routing,
                      gpu_tokens=args.gpu_tokens or sum(gpu_token_capacity(i) for i in infos))
    row = summarize(replay, labels, extra)
    from data.formats import write_jsonl_atomic

    write_jsonl_atomic(out / "calls.jsonl", ({k: v for k, v in asdict(r).items() if k not in ("output_ids", "hidden")}
                                             for r in replay.results))
    path = write_summary(out, row, {k: v for k, v in vars(args).items()}, args.append)
    if row["prompt_tokens"]:
        print(format_table([row]))
    if (line := hidden_report(info)) is not None:
        print(line)
    print(f"summary: {path}")
    if row["failed_calls"]:
        errors = {r.error for r in replay.results if not r.ok}
        print(f"{row['failed_calls']} of {row['calls']} calls failed: {sorted(errors)[:3]}", file=sys.stderr)
    if args.save_trace:
        calls = {(c.workflow_id, c.step): c for wf in workflows for c in wf}
        saved = save_trace(replay, calls, ds.segment_table(), Path(args.save_trace), args.save_format,
                           plugin_state(info).get("model"))
        print(f"trace dataset: {saved}")
    return 1 if row["failed_calls"] == row["calls"] else 0


if __name__ == "__main__":
    sys.exit(main())
