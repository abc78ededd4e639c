"""The benchmark client (`python -m serving_integration.experiments.bench`) against a local HTTP server that
answers in SGLang's /generate schema (streamed SSE chunks and plain JSON, meta_info with
cached_tokens and cached_tokens_details, /server_info with the plugin's state).

The server is a test double, used only because CI has no GPU to run real SGLang on; the real
server is exercised by scripts/gpu_smoke.sh (docs/serving.md). It keeps a set of served token
sequences and reports the longest cached prefix of each prompt, a quarter of it as host hits.
"""

import asyncio
import json
import threading

import numpy as np
import pytest
from aiohttp import web

from data import store
from serving_integration.experiments import bench

EVALUATE_ROW_KEYS = {"workload", "policy", "prefetch", "gpu_tokens", "concurrency", "noise", "hit_rate",
                     "gpu_hit_tokens", "host_hit_tokens", "miss_tokens", "prompt_tokens",
                     "mean_workflow_latency_s", "p50_workflow_latency_s", "p99_workflow_latency_s", "mean_ttft_s",
                     "throughput_calls_per_s", "prefetch_precision"}


class SGLangDouble:
    """/generate and /server_info in SGLang 0.5.23's response schema, on 127.0.0.1 (a thread)."""

    def __init__(self, fail_every: int = 0, hidden: bool = True):
        self.bodies: list[dict] = []
        self.ends: list[dict] = []  # end-of-workflow signals (kept apart from the calls)
        self.replies: list[dict] = []  # per request: output ids and cached tokens reported
        self.sequences: list[np.ndarray] = []
        self.in_flight = self.max_in_flight = 0
        self.fail_every = fail_every
        self.hidden = hidden  # a plugin with hidden_state on: it sends each call's state back when asked
        self.port = None

    # ---------------------------------------------------------------- the protocol

    def cached_prefix(self, ids: np.ndarray) -> int:
        best = 0
        for seq in self.sequences:
            n = min(len(seq), len(ids))
            diff = np.flatnonzero(seq[:n] != ids[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        return min(best, len(ids) - 1)  # SGLang always computes the last prompt token

    async def generate(self, request: web.Request):
        body = await request.json()
        actions = (body.get("kv_hints") or {}).get("actions") or [{}]
        tag = body["sampling_params"].get("custom_params", {}).get("pbkv") or actions[0].get("payload") or {}
        if tag.get("end_signal"):
            self.ends.append({**tag, "body": body, "after_calls": len(self.bodies)})
            return web.json_response({"text": None, "output_ids": [3], "meta_info": {"id": body["rid"]}})
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.json_response({"error": {"message": "scheduler overloaded"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            ids = np.asarray(body["input_ids"])
            n_out = body["sampling_params"]["max_new_tokens"]
            cached = self.cached_prefix(ids)
            host = cached // 4
            output = [int((ids.sum() + i) % 997) + 3 for i in range(n_out)]
            self.replies.append({"rid": body["rid"], "output_ids": output, "cached": cached})
            await asyncio.sleep(0.003)  # prefill
            self.sequences.append(np.concatenate([ids, output[:-1]]))

            def chunk(done):
                meta = {"id": body["rid"], "prompt_tokens": len(ids), "completion_tokens": done,
                        "cached_tokens": cached, "cached_tokens_details": {"device": cached - host, "host": host},
                        "finish_reason": {"type": "length", "length": n_out} if done == n_out else None}
                if tag.get("return_hidden") and self.hidden:  # the plugin's captured state, as its hook sends it
                    meta["pbkv_hidden"] = [self.hidden_of(ids)]
                if done == n_out:
                    meta["e2e_latency"] = 0.01
                return {"text": None, "output_ids": output[:done], "meta_info": meta}  # cumulative snapshot

            if not body.get("stream"):
                await asyncio.sleep(0.002)
                return web.json_response(chunk(n_out))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for done in sorted({1, max(1, n_out // 2), n_out}):
                await asyncio.sleep(0.001)  # decode steps
                await response.write(b"data: " + json.dumps(chunk(done)).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1

    HIDDEN_SIZE = 8

    def hidden_of(self, ids) -> list[float]:
        """A stand-in for the model's hidden state of the last prompt token (deterministic)."""
        return [float(np.sin(int(ids[-1]) + i)) for i in range(self.HIDDEN_SIZE)]

    async def server_info(self, request):
        cost = {"n": len(self.bodies), "mean": 0.05, "p50": 0.04, "p99": 0.2, "max": 0.3}
        return web.json_response({"radix_eviction_policy": "pbkv", "max_total_num_tokens": 12345,
                                  "internal_states": [{"pbkv": {"prefetch": "conservative",
                                                                "prefetch_precision": 0.5,
                                                                "counters": {"fallback_rounds": 0,
                                                                             "hidden_captured": len(self.bodies)},
                                                                "config": {"hidden_state": True},
                                                                "hidden": {"size": self.HIDDEN_SIZE, "cost_ms": cost},
                                                                "model": {"path": "org/double",
                                                                          "hidden_size": self.HIDDEN_SIZE}}}]})

    # ---------------------------------------------------------------- a server in a thread

    def __enter__(self):
        started = threading.Event()
        self.loop = asyncio.new_event_loop()

        async def serve():
            app = web.Application()
            app.router.add_post("/generate", self.generate)
            app.router.add_get("/server_info", self.server_info)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            started.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(serve()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        assert started.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, hover_small):
    path = tmp_path_factory.mktemp("bench") / "hover"
    store.save(store.build(hover_small), path)
    return path


def replayed_rows(dataset, n):
    workflows = bench.replay_workflows(store.load(dataset).rows())[:n]
    return workflows, {(c.workflow_id, c.step): c for wf in workflows for c in wf}


def test_replay_streams_measures_and_saves_a_trace(dataset, tmp_path, capsys):
    out = tmp_path / "run"
    with SGLangDouble() as server:
        assert bench.main(["--url", server.url, "--data", str(dataset), "--split", "all", "--n-workflows", "4",
                           "--concurrency", "2", "--tool-time-scale", "0", "--out", str(out),
                           "--save-trace", str(tmp_path / "collected")]) == 0
    workflows, calls = replayed_rows(dataset, 4)
    n_calls = sum(len(wf) for wf in workflows)
    captured = capsys.readouterr()
    assert f"{n_calls}/{n_calls}" in captured.err  # the progress bar ran to the end
    assert "summary:" in captured.out
    assert f"hidden state: {n_calls} captured (size 8)" in captured.out and "mean 0.050 ms" in captured.out

    (row,) = json.loads((out / "summary.json").read_text())["rows"]
    assert EVALUATE_ROW_KEYS <= set(row)
    assert row["calls"] == n_calls == len(server.bodies) and row["failed_calls"] == 0
    assert (row["policy"], row["prefetch"], row["gpu_tokens"]) == ("pbkv", "conservative", 12345)
    assert row["prefetch_precision"] == 0.5 and row["concurrency"] == 2
    assert row["prompt_tokens"] == sum(len(b["input_ids"]) for b in server.bodies)
    cached = sum(r["cached"] for r in server.replies)
    assert row["gpu_hit_tokens"] + row["host_hit_tokens"] == cached > 0
    assert row["host_hit_tokens"] == sum(r["cached"] // 4 for r in server.replies)
    assert row["hit_rate"] == pytest.approx(row["gpu_hit_tokens"] / row["prompt_tokens"])
    assert row["miss_tokens"] == row["prompt_tokens"] - cached
    assert 0 < row["mean_ttft_s"] < row["mean_call_latency_s"]
    assert row["p50_workflow_latency_s"] <= row["p99_workflow_latency_s"] and row["throughput_calls_per_s"] > 0

    # closed loop: two workflows at a time, each one call after another
    assert server.max_in_flight == 2
    for body in server.bodies:  # never a namespace key: that would stop prefix sharing
        assert "extra_key" not in body and "cache_salt" not in body
        assert body["stream"] and body["sampling_params"]["ignore_eos"]
    tags = [b["sampling_params"]["custom_params"]["pbkv"] for b in server.bodies]
    for wf in workflows:
        sent = sorted((t for t in tags if t["workflow_id"] == wf[0].workflow_id), key=lambda t: t["step"])
        assert [(t["agent"], t["step"]) for t in sent] == [(c.agent, c.step) for c in wf]
        assert not any(t["workflow_end"] for t in sent)  # the end travels after the last call
        (end,) = [e for e in server.ends if e["workflow_id"] == wf[0].workflow_id]
        assert end["workflow_end"] and end["agent"] == wf[-1].agent and len(end["body"]["input_ids"]) == 1
        last_rid = next(b["rid"] for t, b in zip(tags, server.bodies)
                        if (t["workflow_id"], t["step"]) == (wf[-1].workflow_id, wf[-1].step))
        assert last_rid in {r["rid"] for r in server.replies[:end["after_calls"]]}  # sent after the last call
        assert sent[0]["task"] == wf[0].task and all("task" not in t for t in sent[1:])
        assert all(t["return_hidden"] for t in sent)  # --save-trace asks for each call's hidden state

    # a call's real output replaces its segment in later prompts, so outputs are shared prefixes too
    records = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    reply_of = {tuple(reply["rid"].split("/")[:2]): reply for reply in server.replies}  # rid: workflow/step/ns
    outputs = {calls[(r["workflow_id"], r["step"])].output_id: reply_of[(r["workflow_id"], str(r["step"]))]["output_ids"]
               for r in records}
    body_of = {(t["workflow_id"], t["step"]): b for t, b in zip(tags, server.bodies)}
    reused = 0
    for r in records:
        ids, offset = body_of[(r["workflow_id"], r["step"])]["input_ids"], 0
        for segment_id, n in r["segments"]:
            if segment_id in outputs:
                assert ids[offset:offset + n] == outputs[segment_id]
                reused += 1
            offset += n
        assert offset == len(ids)
    assert reused > 0

    collected = store.load(tmp_path / "collected" / "dataset")
    rows = collected.rows()
    assert len(rows) == n_calls
    by_key = {(r["workflow_id"], r["step"]): r for r in rows}
    for r in records:
        saved = by_key[(r["workflow_id"], r["step"])]
        assert saved["prompt_segment_tokens"] == [n for _, n in r["segments"]]
        assert saved["output_tokens"] == calls[(r["workflow_id"], r["step"])].output_tokens
        assert saved["agent"] == r["agent"] and saved["end_time"] >= saved["start_time"]
        ids = body_of[(r["workflow_id"], r["step"])]["input_ids"]
        assert saved["hidden"] == pytest.approx(server.hidden_of(ids))  # float32 in the stored column
    assert collected.meta["hidden"] == {"model": "org/double", "size": 8}
    assert row["hidden_cost_ms"]["mean"] == 0.05


def test_a_trace_saved_from_a_server_without_hidden_states_says_so(dataset, tmp_path, capsys):
    with SGLangDouble(hidden=False) as server:
        assert bench.main(["--url", server.url, "--data", str(dataset), "--split", "all", "--n-workflows", "1",
                           "--concurrency", "1", "--tool-time-scale", "0", "--out", str(tmp_path / "run"),
                           "--no-progress", "--save-trace", str(tmp_path / "collected")]) == 0
    assert "the server sent no hidden states" in capsys.readouterr().err
    collected = store.load(tmp_path / "collected" / "dataset")
    assert "hidden" not in collected.meta and all(r["hidden"] == [] for r in collected.rows())


def test_plain_responses_kv_hints_failures_and_append(dataset, tmp_path):
    out = tmp_path / "run"
    with SGLangDouble() as server:
        assert bench.main(["--url", server.url, "--data", str(dataset), "--split", "all", "--n-workflows", "2",
                           "--concurrency", "1", "--tool-time-scale", "0", "--out", str(out), "--no-progress",
                           "--policy", "lru", "--prefetch", "none"]) == 0
    with SGLangDouble(fail_every=3) as server:
        assert bench.main(["--url", server.url, "--data", str(dataset), "--split", "all", "--n-workflows", "2",
                           "--concurrency", "2", "--tool-time-scale", "0", "--out", str(out), "--no-progress",
                           "--no-stream", "--metadata", "kv_hints", "--append"]) == 0
    first, second = json.loads((out / "summary.json").read_text())["rows"]
    assert (first["policy"], first["prefetch"]) == ("lru", "none")
    assert second["policy"] == "pbkv" and second["mean_ttft_s"] == 0.0  # no stream: no TTFT
    assert second["failed_calls"] == len(server.bodies) // 3 > 0  # failures are counted, the replay goes on
    assert second["calls"] == len(server.bodies)
    for body in server.bodies:
        assert "custom_params" not in body["sampling_params"]
        (action,) = body["kv_hints"]["actions"]
        assert action["action_type"] == "pbkv.workflow" and body["kv_hints"]["message_id"] == body["rid"]


def test_an_unreachable_server_fails_every_call(dataset, tmp_path):
    assert bench.main(["--url", "http://127.0.0.1:9", "--data", str(dataset), "--n-workflows", "1",
                       "--out", str(tmp_path), "--no-progress", "--request-timeout", "5"]) == 1
    (row,) = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert row["failed_calls"] == row["calls"] > 0 and row["hit_rate"] == 0.0


def test_segment_tokens_are_prefix_stable_and_shared():
    tokens = bench.SegmentTokens(1000, 30000)
    long = tokens.tokens("sys:hover:retriever", 700)
    assert tokens.tokens("sys:hover:retriever", 300) == long[:300]
    assert bench.SegmentTokens(1000, 30000).tokens("sys:hover:retriever", 1000)[:700] == long
    assert tokens.tokens("task:1", 50) != tokens.tokens("task:2", 50)
    assert all(1000 <= t < 30000 for t in long)
