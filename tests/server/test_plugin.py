"""The PBKV SGLang plugin, on CPU, against the real sglang 0.5.23 package (installed as docs/install.md
describes; CI installs it too). Nothing here is skipped: a missing sglang fails.

The cache is SGLang's own UnifiedRadixCache with real CPU pools and the Python tree core; requests
are SGLang `Req` objects released through SGLang's `release_kv_cache`, so the plugin's hooks run
exactly where they run in a server. Only the scheduler step is driven by hand (`Serving.step`): a
real Scheduler needs a GPU model runner.
"""

import argparse
import json
import math
import os
import sys
import time
import types
from array import array
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch

from serving_integration.server.compat import install_torchvision_guard

install_torchvision_guard()
import sglang.srt.mem_cache.unified_cache.tree_core_registry as tree_core_registry  # noqa: E402
from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES  # noqa: E402
from sglang.srt.managers.kv_hints import decode_kv_hints_envelope  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, NextBatchPlan, Req  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import match_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES, get_eviction_strategy  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import (ServerArgs, prepare_server_args,  # noqa: E402
                                    set_global_server_args_for_scheduler)

from models import WorkflowPrefix, save_predictor  # noqa: E402
from models.markov import MarkovPredictor  # noqa: E402
from serving_integration.server import launch, plugin  # noqa: E402
from serving_integration.cache.predictions import ModelSource  # noqa: E402
from serving_integration.server import runtime as runtime_module  # noqa: E402
from serving_integration.server.runtime import GuardedPredictor  # noqa: E402

AGENTS = ["<unk>", "a", "b"]


# -------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def loaded_plugins():
    """What launch_server and each scheduler process do: load every sglang.srt.plugins entry point."""
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))  # the config a scheduler publishes
    load_plugins()
    yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real Markov predictor: after `a` the next call is `a` again (3 of 4), after `b` the workflow ends."""
    predictor = MarkovPredictor.from_sequences(AGENTS, 2, [[1, 1, 1, 1, 2]] * 4, order=1)
    return str(save_predictor(predictor, tmp_path_factory.mktemp("ckpt") / "predictor.pt"))


class Serving:
    """One SGLang radix cache on CPU pools, and what the scheduler does for each request."""

    def __init__(self, policy="pbkv", config=None, kv_tokens=256):
        self.req_pool = ReqToTokenPool(size=16, max_context_len=512, device="cpu", enable_memory_saver=False)
        kv = MHATokenToKVPool(size=kv_tokens, page_size=1, dtype=torch.float16, head_num=1, head_dim=4,
                              layer_num=1, device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(size=kv_tokens, dtype=torch.float16, device="cpu", kvcache=kv,
                                                need_sort=False)
        self.cache = UnifiedRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.allocator, page_size=1,
            tree_components=(ComponentType.FULL,), eviction_policy=policy, eviction_policy_config=config,
            tree_core_backend="python"))  # our policies get pbkv_python whatever is asked; LRU gets SGLang's
        self.runtime = self.cache.tree_core.eviction_strategy.runtime if policy in plugin.PLUGIN_POLICIES else None
        self.paths: dict[str, set] = {}
        self._rid = 0

    def serve(self, prompt, output, tag=None, kv_hints=None, label=None, prefill=None):
        """Admit (match, lock, allocate), run, finish and release one request; returns its matched length.
        `prefill(req)`: what happens between the request's arrival and its release (hidden states)."""
        self._rid += 1
        params = SamplingParams(max_new_tokens=len(output), custom_params={"pbkv": tag} if tag is not None else None)
        req = Req(rid=f"r{self._rid}", origin_input_text="", origin_input_ids=array("q", prompt),
                  sampling_params=params, kv_hints=kv_hints)
        if prefill is not None:
            prefill(req)
        self.req_pool.alloc([req])
        match = match_kv_cache(req, self.cache)  # the scheduler's match: also sets what the request had cached
        prefix, total = match.device_prefix_len, len(prompt) + len(output)
        req.last_node, req.lock = match.last_device_node, self.cache.lock(match.last_device_node)
        row = req.kv.req_pool_idx
        self.req_pool.write((row, slice(0, prefix)), self.cache.path_device_indices(match.last_device_node))
        self.req_pool.write((row, slice(prefix, total)), self.allocator.alloc(total - prefix))
        req.kv.cache_protected_len = prefix
        req.kv.kv_committed_len = req.kv.kv_allocated_len = total
        req.output_ids = array("q", output)
        req.finished_reason, req.finished_len = FINISH_LENGTH(length=len(output)), len(output)
        release_kv_cache(req, self.cache, checkpoint=True)  # checkpoint into the tree, unlock, on_release
        if label is not None:
            self.paths.setdefault(label, set()).update(self.path_ids(req.last_node))
        return prefix

    def path_ids(self, node_id):
        node, ids = self.cache.tree_core.node_by_id(node_id), []
        while node is not self.cache.tree_core.root_node:
            ids.append(node.id)
            node = node.parent
        return ids

    def step(self):
        """The plugin's per-step work, as its hook on Scheduler.get_next_batch_to_run runs it (a stand-in
        scheduler: the hook reads only its tree_cache; an idle step has no batch)."""
        plugin.after_next_batch(NextBatchPlan(batch_to_run=None, running_batch=None),
                                types.SimpleNamespace(tree_cache=self.cache))

    def eviction_order(self):
        """Evict one leaf at a time; the labels in the order their first node left the cache."""
        order, arena = [], self.cache.tree_core._node_arena
        while self.cache.evictable_size() > 0:
            self.cache.evict(EvictParams(num_tokens=1))
            for label, ids in self.paths.items():
                if label not in order and any(i not in arena for i in ids):
                    order.append(label)
        return order


def tag(workflow, agent, step=0, end=False):
    return {"workflow_id": workflow, "agent": agent, "step": step, "workflow_end": end}


def prompt(first, n=8):
    return list(range(first, first + n))


def three_workflows(serving):
    """A (agent a, predicted to call a again: high score), then B (agent b, predicted to end: low score),
    then C (its last call: retired). LRU would evict A first, then B, then C."""
    serving.serve(prompt(100), [1, 2], tag("A", "a"), label="A")
    serving.step()
    serving.serve(prompt(200), [1, 2], tag("B", "b"), label="B")
    serving.step()
    serving.serve(prompt(300), [1, 2], tag("C", "a", end=True), label="C")
    serving.step()


# -------------------------------------------------------------------- registration


def test_entry_point_is_listed_and_loading_it_registers_pbkv():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "pbkv"]
    assert ep.value == "serving_integration.server.plugin:register"
    for name in plugin.PLUGIN_POLICIES:  # undo the module fixture's
        _EVICTION_POLICY_FACTORIES.pop(name)                                            # load_plugins, then load
        RADIX_EVICTION_POLICY_CHOICES.remove(name)
    for name in ("fifo", "mru", "filo"):  # SGLang's own, which the plugin adds to the flag's choices
        RADIX_EVICTION_POLICY_CHOICES.remove(name)
    ep.load()()  # what load_plugins does with it
    ep.load()()  # SGLang may load it in a process more than once
    from sglang.srt.mem_cache.evict_policy import FIFOStrategy

    from serving_integration.server.strategies import (KVFlowForkStrategy, KVFlowNoLifecycleStrategy, KVFlowStrategy,
                                                       LifecycleLRUStrategy, LRUPrefetchStrategy, PBKVStrategy,
                                                       PBKVTimeStrategy)

    assert _EVICTION_POLICY_FACTORIES["pbkv"] is PBKVStrategy
    assert _EVICTION_POLICY_FACTORIES["pbkv_lae"] is LifecycleLRUStrategy
    assert _EVICTION_POLICY_FACTORIES["kvflow_ideal"] is KVFlowStrategy
    assert _EVICTION_POLICY_FACTORIES["kvflow_nolae"] is KVFlowNoLifecycleStrategy
    assert _EVICTION_POLICY_FACTORIES["kvflow"] is KVFlowForkStrategy
    assert _EVICTION_POLICY_FACTORIES["lru_prefetch"] is LRUPrefetchStrategy
    assert _EVICTION_POLICY_FACTORIES["pbkv_time"] is PBKVTimeStrategy
    # every policy the registry marks as the plugin's
    assert set(plugin.PLUGIN_POLICIES) == {"pbkv", "pbkv_time", "pbkv_lae", "kvflow", "kvflow_ideal", "kvflow_nolae",
                                           "continuum", "lru_prefetch"}
    assert _EVICTION_POLICY_FACTORIES["fifo"] is FIFOStrategy  # SGLang's own stays
    assert {"pbkv", "pbkv_lae", "kvflow_ideal", "kvflow_nolae", "fifo", "mru", "filo"} <= set(
        RADIX_EVICTION_POLICY_CHOICES)
    assert RADIX_EVICTION_POLICY_CHOICES.count("fifo") == 1
    assert RADIX_EVICTION_POLICY_CHOICES.count("pbkv") == 1
    assert "pbkv_python" in tree_core_registry.registered_tree_core_backends()
    for target in ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint_into_tree",
                   "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.on_release",
                   "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
                   "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
                   "sglang.srt.mem_cache.unified_cache.tree_core_registry.select_tree_core_backend"):
        assert target in HookRegistry._patched, target


def test_radix_eviction_policy_pbkv_parses_in_server_args(checkpoint):
    config = {"checkpoint": checkpoint, "gamma": 0.7, "prefetch": "conservative"}
    argv = ["--model-path", "dummy", "--enable-hierarchical-cache", "--radix-eviction-policy", "pbkv",
            "--radix-eviction-policy-config", json.dumps(config)]
    server_args = prepare_server_args(argv)  # what sglang.launch_server does after load_plugins()
    assert server_args.radix_eviction_policy == "pbkv" and server_args.enable_hierarchical_cache
    assert server_args.radix_eviction_policy_config == config
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(argv).radix_eviction_policy == "pbkv"  # the bare argparser too
    with pytest.raises(SystemExit):  # argparse still refuses names nobody registered
        parser.parse_args(["--model-path", "dummy", "--radix-eviction-policy", "pbkv_typo"])
    strategy = get_eviction_strategy("pbkv", config)  # what the tree core does at startup
    assert strategy.runtime.predictor is not None and strategy.runtime.ledger.gamma == 0.7
    with pytest.raises(TypeError, match="bogus"):  # an unknown key fails at startup, as for SGLang's policies
        get_eviction_strategy("pbkv", {"bogus": 1})


def test_our_policies_get_the_python_tree_core_even_when_rust_is_asked_for():
    def params(policy, backend=None):
        return CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1,
                               eviction_policy=policy, tree_core_backend=backend)

    for policy in ("pbkv", "pbkv_lae", "kvflow", "kvflow_ideal", "kvflow_nolae", "lru_prefetch"):
        assert tree_core_registry.select_tree_core_backend(params(policy, "rust")) == "pbkv_python"
        assert tree_core_registry.select_tree_core_backend(params(policy)) == "pbkv_python"
    assert tree_core_registry.select_tree_core_backend(params("lru", "python")) == "python"
    serving = Serving("pbkv_lae")
    assert serving.cache._tree_core_backend == "pbkv_python"
    assert type(serving.cache.tree_core).__name__ == "WorkflowTreeCore"


# -------------------------------------------------------------------- eviction order in SGLang's cache


def test_unified_radix_cache_evicts_in_pbkv_order(checkpoint):
    serving = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0})
    three_workflows(serving)
    ledger = serving.runtime.ledger
    a_node, b_node = (max(serving.paths[w]) for w in "AB")
    assert ledger.is_retired(max(serving.paths["C"])) and not ledger.is_retired(a_node)
    assert ledger.score(a_node) > ledger.score(b_node) > 0  # a is predicted again; b is predicted to end
    assert serving.runtime.stats["predictor_calls"] == 2 and not serving.runtime.degraded
    assert serving.eviction_order() == ["C", "B", "A"]  # retired first, then low score before high

    baseline = Serving("lru")
    three_workflows(baseline)
    assert baseline.eviction_order() == ["A", "B", "C"]  # the same calls under SGLang's LRU


def test_pbkv_time_in_the_plugin_keeps_the_front_of_sglangs_waiting_queue(checkpoint):
    """A, B, C each predicted to call agent a next; then A's next call enters SGLang's waiting queue,
    then B's. pbkv_time keeps the queue's front: C (not queued) goes first, then B, then A, where
    pbkv, which scores the three alike, evicts by LRU: A, B, C. The queued call's path is read from
    the tree without touching it, and its tokens reach the policy with the time it came."""
    def queue(serving, workflow, first):
        req = Req(rid=f"q{workflow}", origin_input_text="", origin_input_ids=array("q", prompt(first) + [1, 2, 9]),
                  sampling_params=SamplingParams(max_new_tokens=1, custom_params={"pbkv": tag(workflow, "a", 1)}))
        plugin.after_request_queued(None, types.SimpleNamespace(tree_cache=serving.cache), req)

    orders = {}
    for policy in ("pbkv_time", "pbkv"):
        serving = Serving(policy, {"checkpoint": checkpoint, "predictor_timeout_s": 0, "shadow_block_tokens": 4})
        clock = iter(range(100))
        serving.runtime.clock = lambda: float(next(clock))
        for workflow, first in (("A", 100), ("B", 200), ("C", 300)):
            serving.serve(prompt(first), [1, 2], tag(workflow, "a"), label=workflow)
            serving.step()
        last_access = {n.id: n.last_access_time for n in serving.cache.tree_core._node_arena.values()}
        queue(serving, "A", 100)
        queue(serving, "B", 200)
        assert {n.id: n.last_access_time for n in serving.cache.tree_core._node_arena.values()} == last_access
        if policy == "pbkv_time":
            assert set(serving.runtime.policy.queued_path) == {"A", "B"}
            assert set(serving.runtime.policy.queued_path["A"]) == serving.paths["A"]
            assert serving.runtime.stats["calls_queued"] == 2
            judge = serving.runtime.policy.judge  # outcome trust (the default): its shadows hear of the queue too
            assert set(judge.queued_keys) == {"A", "B"} and all(judge.queued_keys.values())
        orders[policy] = serving.eviction_order()
    assert orders == {"pbkv_time": ["C", "B", "A"], "pbkv": ["A", "B", "C"]}


def test_accuracy_trust_in_the_plugin_falls_back_when_predictions_miss(checkpoint):
    serving = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0, "trust": "accuracy",
                               "trust_window": 1})
    serving.serve(prompt(10), [1, 2], tag("W", "a"))
    serving.step()  # predicted: after a, a again (3 of 4)
    serving.serve(prompt(10) + [1, 2, 3], [4], tag("W", "b", step=1))  # but b comes
    runtime = serving.runtime
    assert runtime.stats["trust_switches"] == 1 and not runtime.policy.trusted
    assert runtime.snapshot()["trusted"] is False and runtime.snapshot()["prediction_quality"] < 0.4
    three_workflows(serving)
    assert serving.eviction_order() == ["C", "A", "B"]  # lifecycle-aware LRU, not PBKV's C, B, A
    always = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0, "trust": "always"})
    always.serve(prompt(10), [1, 2], tag("W", "a"))
    always.step()
    always.serve(prompt(10) + [1, 2, 3], [4], tag("W", "b", step=1))
    three_workflows(always)
    assert always.runtime.policy.trusted and always.eviction_order() == ["C", "B", "A"]


def test_continuum_pins_a_programs_cache_through_its_tool_call_in_sglangs_cache():
    """A's second call finishes with a tool call to follow: pinned for the TTL its cost model gives
    (2 s, the one tool time seen), so B's newer cache goes first; once the TTL has passed, LRU again."""
    for steps_at, order in ((3.0, ["B", "A"]), (5.0, ["A", "B"])):
        serving = Serving("continuum", {"prefill_tokens_per_s": 10.0})
        now = [0.0]
        serving.runtime.clock = lambda: now[0]
        serving.step()  # the plugin reads the GPU pool's size (256 tokens)
        assert serving.runtime.pool_tokens == 256
        serving.serve(prompt(100), [1, 2], tag("A", "a"), label="A")  # no tool time seen yet: no pin
        assert not serving.runtime.policy.pins
        now[0] = 2.0
        serving.serve(prompt(100) + [1, 2, 3], [4], tag("A", "a", step=1), label="A")
        assert serving.runtime.policy.tool_times == {"a": [2.0]} and serving.runtime.policy.pins["A"][0] == 4.0
        now[0] = 3.0
        serving.serve(prompt(200), [1, 2], tag("B", "b", end=True), label="B")  # B's last call: no pin
        now[0] = steps_at
        serving.step()
        assert serving.eviction_order() == order


@pytest.mark.parametrize("policy", ["pbkv", "pbkv_time"])
def test_outcome_trust_in_the_plugin_feeds_its_shadows_and_reports_what_it_follows(checkpoint, policy):
    serving = Serving(policy, {"checkpoint": checkpoint, "predictor_timeout_s": 0, "outcome_sample": 1.0,
                               "shadow_block_tokens": 4})
    assert serving.runtime.policy.trust == "outcome"  # the default
    serving.serve(prompt(10), [1, 2], tag("W", "a"))  # 8 prompt tokens: 2 blocks; with the output, 3
    serving.step()
    serving.serve(prompt(10) + [1, 2, 3], [4], tag("W", "a", step=1))  # its first 2 blocks are held
    judge = serving.runtime.policy.judge
    assert judge.score_shadow.capacity == 256  # the device pool's tokens x outcome_sample
    # 3 blocks of the first call, its 2 prompt blocks matched by the second, whose last block (3
    # prompt tokens and its output token) is held once it finishes: 4 keys
    assert sorted(judge.lru_shadow.held) == sorted(judge.score_shadow.held) and len(judge.entries) == 4
    assert not judge.locked  # both calls finished: nothing of theirs is locked
    trust = serving.runtime.snapshot()["trust"]
    assert trust["following"] == policy and trust["trust_switches"] == 0 and trust["shadow_sampled_calls"] == 2
    assert trust["shadow_hit_tokens_pbkv"] == trust["shadow_hit_tokens_lae"] == 8
    assert judge.score_shadow.reserved == judge.lru_shadow.reserved == 0  # the real cache had what they had
    assert not judge.host_tier  # no HiCache controller on this cache
    assert serving.runtime.stats[f"calls_following_{policy}"] == 2 and serving.runtime.snapshot()["trusted"] is True


def test_the_judge_hears_what_sglang_matched_on_the_device_and_in_all(checkpoint):
    # outcome_real_weight counts the real cache's GPU hits: SGLang's Req must carry both the whole
    # match (num_matched_prefix_tokens) and its host part (host_hit_length) once the scheduler matched it
    serving = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0})
    serving.serve(prompt(10), [1, 2], tag("W", "a"))
    req = Req(rid="m", origin_input_text="", origin_input_ids=array("q", prompt(10) + [1, 2, 3]),
              sampling_params=SamplingParams(max_new_tokens=1))
    serving.req_pool.alloc([req])
    match = match_kv_cache(req, serving.cache)
    assert match.device_prefix_len == len(prompt(10)) + 2  # the first call's prompt and output
    assert runtime_module.matched_tokens(req) == (match.device_prefix_len, match.device_prefix_len)  # no host tier
    req.host_hit_length = 3  # what a HiCache match would add from the host
    req.num_matched_prefix_tokens += 3
    assert runtime_module.matched_tokens(req) == (match.device_prefix_len + 3, match.device_prefix_len)


def test_lifecycle_lru_evicts_retired_then_lru():
    serving = Serving("pbkv_lae")
    three_workflows(serving)
    assert serving.runtime.predictor is None and not serving.runtime.degraded  # pbkv_lae needs no predictor
    assert serving.eviction_order() == ["C", "A", "B"]


def test_an_end_signal_request_after_the_last_call_retires_the_workflow():
    from serving_integration.cache.workflow_tags import end_signal_tag

    serving = Serving("pbkv_lae")
    serving.serve(prompt(100), [1, 2], tag("A", "a"), label="A")
    serving.serve(prompt(200), [1, 2], tag("B", "b"), label="B")
    serving.step()
    assert not any(serving.runtime.ledger.is_retired(n) for n in serving.paths["A"])
    serving.serve([5], [1], end_signal_tag("A", "a").as_payload(), label="end")
    serving.step()
    runtime = serving.runtime
    assert list(runtime.workflows) == ["B"] and runtime.stats["end_signals"] == 1
    assert runtime.stats["workflows_ended"] == 1 and runtime.stats["calls_finished"] == 2  # the signal is no call
    assert all(runtime.ledger.is_retired(n) for n in serving.paths["A"] | serving.paths["end"])
    assert set(serving.eviction_order()[:2]) == {"A", "end"}  # retired cache first, B (live) last


def test_node_splits_keep_the_bookkeeping(checkpoint):
    serving = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0})
    serving.serve(prompt(100, 8), [1, 2], tag("A", "a"), label="A")
    a_nodes = set(serving.paths["A"])
    # D shares A's first 4 tokens: SGLang splits A's prompt node; the new prefix node gets a new id
    serving.serve(prompt(100, 4) + [7, 7, 7], [3], tag("D", "b"), label="D")
    ledger, tree = serving.runtime.ledger, serving.cache.tree_core
    (shared,) = [n for n in serving.paths["D"] if tree.node_by_id(n).key.token_ids[0] == 100]
    assert shared not in a_nodes and len(tree.node_by_id(shared).key) == 4
    serving.paths["A"].add(shared)
    assert ledger.users[shared] == {"A": {"a": None}, "D": {"b": None}}
    assert shared in ledger.nodes_of["A"] and shared in ledger.nodes_of["D"]
    serving.runtime.end_workflow("D")
    assert not ledger.is_retired(shared)  # A still lives on the shared prefix
    d_only = serving.paths["D"] - serving.paths["A"]
    assert d_only and all(ledger.is_retired(n) for n in d_only)
    serving.paths["D"] = d_only
    assert serving.eviction_order() == ["D", "A"]
    assert not ledger.users and not ledger.nodes_of["A"]  # deleted nodes are forgotten


# -------------------------------------------------------------------- fallbacks and robustness


# Fault injection around the real predictor: it raises, hangs past the timeout, or (corrupted weights)
# returns NaN.
class RaisingSource(ModelSource):
    def predict(self, workflows):
        raise RuntimeError("predictor exploded")


class SlowSource(ModelSource):
    def predict(self, workflows):
        time.sleep(0.5)
        return super().predict(workflows)


def nan_source(checkpoint):
    from models import load_predictor

    predictor = load_predictor(checkpoint)
    predictor.table.fill_(math.nan)  # corrupted weights: the real predictor returns NaN
    return ModelSource(predictor)


@pytest.mark.parametrize("fault", ["error", "nan", "timeout"])
def test_failing_predictor_falls_back_to_lifecycle_lru_and_is_counted(checkpoint, fault):
    serving = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0.1})
    runtime = serving.runtime
    good = runtime.predictor.source
    model = good.inner.predictor  # the checkpoint, under the default online backoff
    faulty = {"error": RaisingSource(model), "nan": nan_source(checkpoint), "timeout": SlowSource(model)}[fault]
    serving.serve(prompt(100), [1, 2], tag("A", "a"), label="A")
    serving.step()  # a good round for A
    runtime.predictor = GuardedPredictor(faulty, runtime.stats, runtime.config.predictor_timeout_s)
    serving.serve(prompt(200), [1, 2], tag("B", "b"), label="B")
    serving.step()  # B's round fails
    serving.serve(prompt(300), [1, 2], tag("C", "a", end=True), label="C")
    assert runtime.degraded
    assert runtime.stats[f"predictor_{fault}"] == 1 and runtime.stats["fallback_rounds"] == 1
    assert serving.eviction_order() == ["C", "A", "B"]  # lifecycle-aware LRU, not PBKV's C, B, A
    assert runtime.stats["fallback_priorities"] > 0
    if fault == "timeout":  # the late call still runs: the next round falls back at once
        serving.serve(prompt(400), [1], tag("E", "a"))
        serving.step()
        assert runtime.stats["predictor_timeout"] == 2
        time.sleep(0.6)
    runtime.predictor = GuardedPredictor(good, runtime.stats, None)
    serving.serve(prompt(500), [1], tag("F", "a"))
    serving.step()
    assert not runtime.degraded  # a good round restores PBKV's order


def test_pbkv_times_in_the_plugin_come_from_the_checkpoint_and_failing_ones_are_counted():
    """pbkv_time's times: the predictor's median time until each next call, [B, K] seconds; a source
    whose times raise or are not finite gives None (that round orders without times) and is counted."""
    from models.timing import TimeSpec, agent_table
    from serving_integration.server.runtime import LiveWorkflow, PluginStats

    sequences, gaps = [[1, 1, 2]] * 8, [[0.0, 3.0, 30.0]] * 8
    spec = TimeSpec([0.1, 0.5, 0.9], 0.1, "tool_time", agent_table(sequences, gaps, len(AGENTS) + 1, 2,
                                                                     [0.1, 0.5, 0.9], 5), min_samples=5, paths=2000)
    timed = MarkovPredictor.from_sequences(AGENTS, 2, sequences, time=spec, gaps=gaps, order=1)
    stats = PluginStats()
    guarded = GuardedPredictor(ModelSource(timed), stats, None)
    live = [LiveWorkflow("w", agents=["a"]), LiveWorkflow("v", agents=["a", "a"])]
    seconds = guarded.predict_times(live)
    _, quantiles = timed.predict_when([WorkflowPrefix(w.agents) for w in live])
    assert seconds.shape == (2, 2) and seconds.tolist() == quantiles[..., 1].double().tolist()  # the median level
    assert (seconds > 0).all()
    def raising(workflows):
        raise RuntimeError("time head exploded")

    for fault in (raising, lambda workflows: np.full((len(workflows), 2), np.nan)):
        broken = ModelSource(timed)
        broken.times_uncached = fault
        assert GuardedPredictor(broken, stats, None).predict_times([LiveWorkflow("w", agents=["a"])]) is None
    assert stats["predictor_times_failed"] == 2


def test_unreadable_checkpoint_runs_as_lifecycle_lru(tmp_path):
    bad = tmp_path / "predictor.pt"
    bad.write_bytes(b"not a checkpoint")
    serving = Serving("pbkv", {"checkpoint": str(bad)})
    assert serving.runtime.predictor is None and serving.runtime.degraded
    assert serving.runtime.stats["predictor_unavailable"] == 1
    three_workflows(serving)
    assert serving.runtime.stats["fallback_rounds"] == 2
    assert serving.eviction_order() == ["C", "A", "B"]


def test_bad_or_missing_metadata_is_tolerated_and_counted(checkpoint):
    serving = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0})
    hints = decode_kv_hints_envelope({"protocol_version": "1", "message_id": "m", "actions": [
        {"action_id": "x", "action_type": "pbkv.workflow", "action_version": "1",
         "payload": {"workflow_id": "H", "agent": "a", "step": 0}}]})
    serving.serve(prompt(100), [1], kv_hints=hints, label="H")  # kv_hints carry the tag
    serving.serve(prompt(200), [1], label="anonymous")  # no metadata
    serving.serve(prompt(300), [1], {"workflow_id": 7, "agent": "a"}, label="bad")  # malformed
    serving.serve(prompt(400), [1], {"workflow_id": "W", "agent": "a", "step": -1}, label="bad2")
    serving.serve(prompt(500), [1], "not an object", label="bad3")
    serving.step()
    stats = serving.runtime.stats
    assert stats["requests_tagged"] == 1 and stats["metadata_missing"] == 1 and stats["metadata_bad"] == 3
    assert list(serving.runtime.workflows) == ["H"]
    assert serving.serve(prompt(200), [1]) == 8  # untracked requests still share the cache
    assert serving.eviction_order()[-1] == "H"  # unowned cache counts as retired: it goes first


class ExplodingHints:
    @property
    def actions(self):
        raise RuntimeError("a plugin bug")


def test_a_failing_hook_never_reaches_sglang(checkpoint):
    serving = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0})
    serving.serve(prompt(100), [1, 2], kv_hints=ExplodingHints(), label="X")  # release_kv_cache completes
    assert serving.runtime.stats["hook_errors"] == 2  # checkpoint and release hooks, both swallowed
    assert serving.serve(prompt(100), [1, 2]) == 8  # and the request's prompt is in the tree
    state = types.SimpleNamespace(internal_state={})
    plugin.after_internal_state(state, types.SimpleNamespace(tree_cache=serving.cache))
    assert state.internal_state["pbkv"]["counters"]["hook_errors"] == 2


def test_workflows_without_an_end_signal_retire_after_their_ttl(checkpoint):
    serving = Serving("pbkv", {"checkpoint": checkpoint, "predictor_timeout_s": 0, "workflow_ttl_s": 0.05})
    serving.serve(prompt(100), [1], tag("A", "a"), label="A")
    time.sleep(0.1)
    serving.step()
    assert serving.runtime.stats["workflows_expired"] == 1
    assert all(serving.runtime.ledger.is_retired(n) for n in serving.paths["A"])


# -------------------------------------------------------------------- hidden states


@pytest.fixture(scope="module")
def hidden_checkpoint(tmp_path_factory):
    """A graphsage predictor that reads 16-dim hidden states through a fixed projection to 8."""
    from models.graph import CallGraph
    from models.graphsage import GraphSAGEPredictor
    from models.text import TextSpec

    spec = TextSpec("hidden", 8, hidden_size=16, projection_seed=5)
    predictor = GraphSAGEPredictor(AGENTS, 2, graph=CallGraph.from_sequences([[1, 1, 2]], 3).to_dict(),
                                   text=spec.to_dict(), identity=False, dim=8, hidden=16)
    return str(save_predictor(predictor, tmp_path_factory.mktemp("hidden") / "predictor.pt"))


def prefill_with_hidden(serving, vector, store=True):
    """What the scheduler does for a request with the plugin's hidden_state on: queue it (the plugin's
    hook asks for its hidden state), then SGLang's own _append_prefill_hidden_states (hooked by the
    plugin) on a forward output holding `vector` as the request's last prefill row."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    owner = types.SimpleNamespace(tree_cache=serving.cache)
    seen = {}

    def prefill(req):
        plugin.after_request_queued(None, owner, req)
        seen["asked"] = (req.return_hidden_states, req.return_hidden_states_mode)
        if req.return_hidden_states:
            output = types.SimpleNamespace(hidden_states=torch.tensor([vector], dtype=torch.float32))
            SchedulerBatchResultProcessor._append_prefill_hidden_states(
                owner, req=req, logits_output=output, hidden_state_offset=0,
                capture_hidden_mode=CaptureHiddenMode.LAST, extend_input_len=len(req.origin_input_ids), store=store)
        seen["after"] = (req.return_hidden_states, list(req.hidden_states), req.customized_info)
    return prefill, seen


def test_hidden_states_are_captured_projected_and_predicted_with(hidden_checkpoint):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from models import WorkflowPrefix, load_predictor

    serving = Serving("pbkv", {"checkpoint": hidden_checkpoint, "hidden_state": True, "predictor_timeout_s": 0,
                               "online_backoff": False})
    runtime, vector = serving.runtime, [0.25 * i - 1.0 for i in range(16)]
    prefill, seen = prefill_with_hidden(serving, vector)
    serving.serve(prompt(100), [1, 2], {**tag("A", "a"), "return_hidden": True}, prefill=prefill)
    assert seen["asked"] == ("last", CaptureHiddenMode.LAST)  # the flag a client's return_hidden_states sets
    flag, stored, info = seen["after"]
    assert flag is False and stored == []  # cleared again: no capture in decode, none in the response
    assert info == {"pbkv_hidden": [pytest.approx(vector)]}  # sent back: the tag asked
    predictor = load_predictor(hidden_checkpoint)
    projected = predictor.project_hidden(torch.tensor([vector]))[0]
    kept = runtime.workflows["A"].hidden  # 8 float32 values: the predictor's input, as the plugin keeps it
    assert kept.dtype == "float32" and list(kept) == pytest.approx(projected.tolist())
    serving.step()
    assert runtime.stats["hidden_captured"] == 1 and runtime.stats["predicted_with_hidden"] == 1
    expected = predictor.predict([WorkflowPrefix(["a"], "", vector)])  # the raw vector, projected inside
    without = predictor.predict([WorkflowPrefix(["a"], "", None)])
    assert not torch.allclose(expected, without)  # the hidden state changes the prediction
    assert runtime.predictor.predict([runtime.workflows["A"]]) == pytest.approx(expected)
    state = types.SimpleNamespace(internal_state={})
    plugin.after_internal_state(state, types.SimpleNamespace(tree_cache=serving.cache,
                                                             model_config=types.SimpleNamespace(hidden_size=16)))
    hidden = state.internal_state["pbkv"]["hidden"]
    assert (hidden["size"], hidden["input_size"], hidden["cost_ms"]["n"]) == (16, 8, 1)
    assert hidden["cost_ms"]["max"] > 0 and state.internal_state["pbkv"]["model"]["hidden_size"] == 16

    # a request without return_hidden gets nothing back; an end signal and untagged requests ask for nothing
    prefill, seen = prefill_with_hidden(serving, vector)
    serving.serve(prompt(200), [1], tag("B", "b"), prefill=prefill)
    assert seen["after"][2] is None
    for other in ({**tag("A", "a", end=True), "end_signal": True}, None):
        prefill, seen = prefill_with_hidden(serving, vector)
        serving.serve(prompt(300), [1], other, prefill=prefill)
        assert seen["asked"] == (False, CaptureHiddenMode.NULL)
    assert runtime.stats["hidden_captured"] == 2
    serving.serve(prompt(400), [1], {**tag("C", "a"), "return_hidden": "yes"})  # not a boolean
    assert runtime.stats["metadata_bad"] == 1
    from serving_integration.cache.workflow_tags import WorkflowTag, tag_from_payload

    asking = WorkflowTag("W", "a", 1, return_hidden=True)
    assert tag_from_payload(asking.as_payload()) == asking and "return_hidden" not in WorkflowTag("W", "a").as_payload()


@pytest.mark.parametrize("fault", ["nan", "wrong size", "not captured"])
def test_a_failed_capture_is_counted_and_predicted_without(hidden_checkpoint, fault):
    serving = Serving("pbkv", {"checkpoint": hidden_checkpoint, "hidden_state": True, "predictor_timeout_s": 0})
    vector = {"nan": [math.nan] * 16, "wrong size": [1.0] * 5, "not captured": [1.0] * 16}[fault]
    prefill, _ = prefill_with_hidden(serving, vector, store=fault != "not captured")
    serving.serve(prompt(100), [1, 2], tag("A", "a"), prefill=prefill)
    serving.step()
    stats = serving.runtime.stats
    assert stats["hidden_captured"] == 0 and stats["hidden_missing"] == 1
    assert stats["hidden_capture_failed"] == (fault != "not captured")
    assert stats["predictor_calls"] == 1 and stats["predicted_with_hidden"] == 0 and stats["hook_errors"] == 0
    assert serving.runtime.workflows["A"].hidden is None


def test_launch_adds_sglangs_hidden_state_flags(hidden_checkpoint, capsys):
    assert launch.main(["--model-path", "m", "--policy", "pbkv", "--checkpoint", hidden_checkpoint]) == 2
    assert "pass --hidden-state" in capsys.readouterr().err
    assert launch.main(["--model-path", "m", "--policy", "pbkv", "--checkpoint", hidden_checkpoint,
                        "--hidden-state", "--hidden-layer", "1", "--dry-run"]) == 0
    cmd = capsys.readouterr().out
    config = json.loads(cmd.split("--radix-eviction-policy-config ")[1].split("' ")[0].strip("'"))
    assert config["hidden_state"] is True and config["hidden_layer"] == 1
    assert "--enable-return-hidden-states --return-hidden-states-mode last" in cmd
    assert "--return-aux-hidden-state-layer-ids 1" in cmd
    assert launch.main(["--model-path", "m", "--policy", "lru", "--hidden-state", "--dry-run"]) == 2
    capsys.readouterr()
    assert launch.main(["--cpu", "--policy", "pbkv_lae", "--hidden-state", "--hidden-layer", "1", "--dry-run"]) == 2
    assert "the model has 2 layers" in capsys.readouterr().err  # the tiny model: only layer 0 has an output to take
    assert launch.main(["--cpu", "--policy", "pbkv_lae", "--hidden-state", "--hidden-layer", "0", "--dry-run"]) == 0


def test_stats_file_and_kvflow_ideal_step_graph(tmp_path, hover_small):
    from data import store

    data_dir = tmp_path / "hover"
    store.save(store.build(hover_small), data_dir)
    stats_path = tmp_path / "stats.json"
    serving = Serving("kvflow_ideal", {"step_graph_traces": str(data_dir), "stats_path": str(stats_path),
                                 "predictor_timeout_s": 0})
    assert serving.runtime.predictor is not None and serving.runtime.prefetch.mode == "aggressive"
    serving.serve(prompt(100), [1], tag("A", "retriever"), label="A")
    serving.step()
    serving.serve(prompt(200), [1], tag("B", "verifier", end=True), label="B")
    serving.step()
    assert serving.eviction_order()[0] == "B"
    written = json.loads(stats_path.read_text())
    assert written["policy"] == "kvflow_ideal" and written["counters"]["predictor_calls"] == 1


# -------------------------------------------------------------------- the launcher


def test_launch_builds_a_valid_sglang_command(checkpoint, capsys):
    assert launch.main(["--model-path", "dummy", "--policy", "pbkv", "--checkpoint", checkpoint, "--dry-run",
                        "--", "--max-total-tokens", "4096"]) == 0
    cmd = launch.build_command(*launch.parse_args(["--model-path", "dummy", "--checkpoint", checkpoint,
                                                   "--policy-config", '{"predictor_timeout_s": 0.2}']))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    args = prepare_server_args(cmd[3:])
    assert args.enable_hierarchical_cache and args.radix_eviction_policy == "pbkv"
    assert args.radix_eviction_policy_config["predictor_timeout_s"] == 0.2
    assert get_eviction_strategy("pbkv", args.radix_eviction_policy_config).runtime.predictor is not None
    assert "--max-total-tokens 4096" in capsys.readouterr().out
    assert launch.main(["--model-path", "dummy", "--policy", "pbkv", "--dry-run"]) == 2  # no checkpoint
    assert launch.main(["--model-path", "dummy", "--policy", "lru", "--dry-run"]) == 0
    for policy in ("fifo", "mru", "filo", "slru", "priority"):  # SGLang's own strategies, by SGLang's own flag
        cmd = launch.build_command(*launch.parse_args(["--model-path", "dummy", "--policy", policy]))
        args = prepare_server_args(cmd[3:])
        assert args.radix_eviction_policy == policy and "--radix-eviction-policy-config" not in cmd
        assert type(get_eviction_strategy(policy)).__name__.lower() == f"{policy}strategy"


def test_launch_cpu_adds_the_cpu_flags_environment_and_support_path(tmp_path):
    args, extra = launch.parse_args(["--cpu", "--policy", "lru", "--tiny-model-dir", str(tmp_path / "tiny")])
    cmd = launch.build_command(args, extra)
    server = prepare_server_args(cmd[3:])
    assert server.device == "cpu" and server.attention_backend == "torch_native" and server.dtype == "float32"
    assert server.max_total_tokens == 32000 and server.enable_hierarchical_cache and server.disable_cuda_graph
    assert server.hicache_io_backend == "direct" and server.hicache_mem_layout == "layer_first"
    assert server.model_path == str((tmp_path / "tiny").resolve())
    env = launch.server_env(args, {"PYTHONPATH": "/elsewhere", "PYTHONPYCACHEPREFIX": "/tmp/x"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(launch.CPU_SUPPORT), str(launch.REPO), "/elsewhere"]
    assert "PYTHONPYCACHEPREFIX" not in env
    assert env["OMP_NUM_THREADS"] == "1"  # one compute thread unless asked (see launch's docstring)
    threads = launch.parse_args(["--cpu", "--cpu-threads", "2"])[0]
    assert launch.server_env(threads, {})["OMP_NUM_THREADS"] == "2"
    assert launch.server_env(launch.parse_args(["--model-path", "m"])[0], {"A": "1"}) == {"A": "1"}  # GPU: as is
    with pytest.raises(SystemExit):
        launch.parse_args(["--policy", "lru"])  # neither --model-path nor --cpu


# a stand-in for `launch`: uvicorn (as SGLang's HTTP server) answering 200 on the port it is given
ASGI_STAND_IN = """
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info")
"""


def test_a_local_server_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    """A free port picked for a LocalServer can be taken before the server binds it (in a cluster
    test, by another replica's connections); uvicorn then cannot bind, and the server is started
    again on a new free port instead of timing out. A port the caller chose is not moved."""
    import socket

    class StandIn(launch.LocalServer):
        def _listen_on(self, port):
            super()._listen_on(port)
            self.cmd = [sys.executable, "-c", ASGI_STAND_IN, str(port)]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy, real = taken.getsockname()[1], launch.free_port
        picks = iter([busy])
        monkeypatch.setattr(launch, "free_port", lambda: next(picks, None) or real())
        with StandIn([], log_path=tmp_path / "server.log", health_timeout_s=60) as server:
            assert server.port != busy and server.url.endswith(f":{server.port}")
            assert server.launch_args[-2:] == ["--port", str(server.port)]
        with pytest.raises(RuntimeError, match="failed before it was healthy"):
            with StandIn([], port=busy, log_path=tmp_path / "given.log", health_timeout_s=60):
                pass


def test_cpu_support_stand_in_and_hicache_transfer(monkeypatch):
    import importlib

    from serving_integration.server import compat

    monkeypatch.syspath_prepend(str(launch.CPU_SUPPORT))
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    stand_in = importlib.import_module("sgl_kernel")
    from sgl_kernel import copy_all_layer_kv_cache_cpu  # what sglang's cache_move imports at load time

    with pytest.raises(NotImplementedError, match="stand-in"):
        copy_all_layer_kv_cache_cpu()
    with pytest.raises(ImportError):
        importlib.import_module("sgl_kernel.scalar_type")  # sglang falls back on ImportError
    assert stand_in.__file__.startswith(str(launch.CPU_SUPPORT))
    monkeypatch.delitem(sys.modules, "sgl_kernel")
    src = [torch.arange(20.0).reshape(10, 2), torch.arange(20.0, 40.0).reshape(10, 2)]
    dst = [torch.zeros(6, 2), torch.zeros(6, 2)]
    compat.transfer_kv_direct(src, dst, torch.tensor([7, 2]), torch.tensor([0, 5]), page_size=1)
    assert dst[0][0].tolist() == [14.0, 15.0] and dst[1][5].tolist() == [24.0, 25.0] and dst[0][1:5].sum() == 0
    assert compat.apply_cpu_hicache_fixes() is (not torch.cuda.is_available())


# -------------------------------------------------------------------- kvflow and lru_prefetch in the plugin


def step_graph_dir(tmp_path, hover_small):
    from data import store

    data_dir = tmp_path / "hover"
    store.save(store.build(hover_small), data_dir)
    return str(data_dir)


def test_kvflow_evicts_in_the_forks_tiers_in_sglangs_cache(tmp_path, hover_small):
    """kvflow in SGLang's own cache: each call's agent recorded on its last node, the step graph's
    update merged by agent name, then the fork's tiers (an agent due later is evicted first, any
    step past hold_step - 1 in the first tier) with DFS order (here creation order) inside a tier."""
    serving = Serving("kvflow", {"step_graph_traces": step_graph_dir(tmp_path, hover_small), "predictor_timeout_s": 0})
    runtime, arena = serving.runtime, serving.cache.tree_core._node_arena
    assert runtime.predictor is not None and runtime.prefetch.mode == "kvflow" and not runtime.degraded
    agents = {"A": "verifier", "B": "retriever", "C": "summarizer"}
    for i, (label, agent) in enumerate(agents.items()):
        serving.serve(prompt(100 * (i + 1)), [1, 2], tag(label, agent), label=label)
        serving.step()
    policy = runtime.policy
    for label, agent in agents.items():  # the agent sits on the deepest node of its call's path
        deepest = max(serving.paths[label], key=lambda i: len(serving.path_ids(i)))
        assert policy.node_agents[deepest] == {agent: None} and deepest in policy.last_nodes[agent]
    step = policy.agent_step
    assert step["retriever"] > step["verifier"] == step["summarizer"] == 0  # from the hover graph
    tier = {label: -min(step.get(agent, policy.hold_step + 1), policy.hold_step - 1) for label, agent in agents.items()}
    expected = sorted(agents, key=lambda label: (tier[label], list(agents).index(label)))
    assert expected == ["B", "A", "C"] and serving.eviction_order() == expected  # LRU would give A, B, C


def test_lru_prefetch_evicts_as_lru_in_sglangs_cache():
    serving = Serving("lru_prefetch")
    assert serving.runtime.prefetch.mode == "last_call" and not serving.runtime.needs_predictions
    three_workflows(serving)
    assert serving.eviction_order() == ["A", "B", "C"]  # what SGLang's LRU gives for the same calls


def test_a_baselines_own_prefetch_is_refused_for_another_policy():
    from data.errors import ConfigError
    from serving_integration.server.runtime import PluginConfig, WorkflowRuntime

    with pytest.raises(ConfigError, match="prefetch=kvflow"):
        WorkflowRuntime("pbkv_lae", PluginConfig(prefetch="kvflow"))
    assert WorkflowRuntime("kvflow", PluginConfig(prefetch="none")).prefetch.mode == "none"


class HostNode:
    """The fields of SGLang's UnifiedTreeNode that the prefetcher and the baselines read."""

    def __init__(self, node_id, parent, tokens, on_device=True):
        self.id, self.parent, self.key, self.children = node_id, parent, [0] * tokens, {}
        self.creation_time = self.last_access_time = float(node_id)
        self.hit_count, self.priority = 0, 0
        self.evicted, self.backuped, self.load_back_pending_id = not on_device, True, None
        self.component_data = [types.SimpleNamespace(lock_ref=0)]  # ComponentType.FULL's


class HostCache:
    """A stand-in UnifiedRadixCache with HiCache: `free` device tokens, `evictable` unlocked ones, and
    load_back recorded (it loads the host-only path above the node, as SGLang's does)."""

    def __init__(self, nodes, free, evictable=0, leaves=()):
        self.tree_core = types.SimpleNamespace(_node_arena={n.id: n for n in nodes}, evictable_device_leaves=list(leaves))
        self.cache_controller = types.SimpleNamespace(ack_load_queue=[], mem_pool_host=None)
        self.free, self.evictable, self.loaded = free, evictable, []
        self.on_load = lambda: None  # what a test reads while SGLang's load_back would evict
        self.token_to_kv_pool_allocator = types.SimpleNamespace(available_size=lambda: self.free)

    def evictable_size(self):
        return self.evictable

    def load_back(self, node_id):
        node = self.tree_core._node_arena[node_id]
        self.loaded.append(node_id)
        self.on_load()
        while node is not None and node.evicted:
            node.evicted, self.free = False, self.free - len(node.key)
            node = node.parent
        return True

    def ready_to_load_host_cache(self):
        return 0


def call(runtime, rid, workflow, agent, node, finished=True):
    """One call of `workflow` whose path ends at `node`, as the plugin's hooks report it."""
    req = types.SimpleNamespace(rid=rid, kv_hints=None, origin_input_ids=[0] * 8, output_ids=[0] * 2,
                                finished=lambda: finished, sampling_params=types.SimpleNamespace(custom_params={
                                    "pbkv": {"workflow_id": workflow, "agent": agent, "step": 0,
                                             "workflow_end": False}}))
    runtime.on_cached(req, [node.id], node)
    if finished:
        runtime.on_finished(req)


PREFETCH_CONFIG = {"prefetch_reserve_tokens": 0, "kv_bytes_per_token": 5_000_000, "predictor_timeout_s": 0}
# 25 GB/s x 20 ms / 5 MB per token: 100 tokens a step


def kvflow_round(free):
    """Three workflows, one call each (agents a, b, c; a step graph a -> b -> c -> d), their cache
    then pushed to the host, and one step update: b, c and d are due at step 0, a is not due."""
    from serving_integration.cache.predictions import AgentStepGraph
    from serving_integration.server.prefetch import HostPrefetcher
    from serving_integration.server.runtime import PluginConfig, WorkflowRuntime

    runtime = WorkflowRuntime("kvflow", PluginConfig(**PREFETCH_CONFIG),
                              AgentStepGraph.from_traces([["a", "b", "c", "d"]] * 4, 3))
    root = HostNode(0, None, 0)
    n1, n2, n3 = HostNode(1, root, 5), HostNode(2, root, 20), HostNode(3, root, 5)
    for rid, (workflow, agent, node) in enumerate([("W1", "a", n1), ("W2", "b", n2), ("W3", "c", n3)]):
        call(runtime, f"r{rid}", workflow, agent, node)
    for node in (n1, n2, n3):
        node.evicted = True  # written through, then evicted from the device
    cache = HostCache([root, n1, n2, n3], free=free)
    runtime.run_predictions()  # the update: W1 -> b (step 0), W2 -> c (0), W3 -> d (0)
    return runtime, HostPrefetcher(runtime, cache), cache


def test_kvflow_prefetch_loads_the_due_agents_last_nodes_in_step_order_and_holds_them():
    runtime, prefetcher, cache = kvflow_round(free=30)
    policy = runtime.policy
    assert policy.agent_step == {"b": 0, "c": 0, "d": 0} and prefetcher.tokens_per_step == 100
    assert prefetcher.prefetch_once() == 25
    assert cache.loaded == [2, 3]  # b's last node, then c's; a is not due, so W1's cache stays on the host
    assert policy.hold(cache.tree_core._node_arena[2]) == policy.hold(cache.tree_core._node_arena[3]) == 1
    assert policy.priority(cache.tree_core._node_arena[2])[0] == -1  # held: evicted after every unheld tier
    assert runtime.stats["prefetched_tokens"] == 25 and runtime.stats["prefetch_rounds"] == 1
    assert prefetcher.prefetch_once() == 0  # one round per update


def test_kvflow_prefetch_ends_its_round_at_the_first_load_that_does_not_fit():
    runtime, prefetcher, cache = kvflow_round(free=15)  # b's 20 tokens do not fit (nothing evictable)
    assert prefetcher.prefetch_once() == 0 and cache.loaded == []  # c's 5 would: the fork stops anyway
    assert runtime.policy.pending == {} and runtime.stats["prefetch_rounds"] == 0
    runtime, prefetcher, cache = kvflow_round(free=15)
    cache.evictable = 10  # kvflow may evict any unlocked cache for its loads (SGLang's load_back does)
    assert prefetcher.prefetch_once() == 25 and cache.loaded == [2, 3]


def test_lru_prefetch_loads_the_longest_waiting_workflows_last_nodes_into_free_and_retired_space():
    from serving_integration.server.prefetch import HostPrefetcher
    from serving_integration.server.runtime import PluginConfig, WorkflowRuntime

    runtime = WorkflowRuntime("lru_prefetch", PluginConfig(**PREFETCH_CONFIG))
    assert runtime.predictor is None and not runtime.degraded  # no predictor: none is needed
    root = HostNode(0, None, 0)
    nodes = {i: HostNode(i, root, 5) for i in (1, 2, 3, 4)}
    call(runtime, "r1", "W1", "a", nodes[1])
    call(runtime, "r2", "W1", "b", nodes[2])  # W1's latest agent
    call(runtime, "r3", "W2", "a", nodes[3])
    call(runtime, "r4", "W3", "a", nodes[4])
    call(runtime, "r5", "W3", "b", nodes[4], finished=False)  # W3's next call is in flight: not waiting
    for node in nodes.values():
        node.evicted = True
    live_leaf, retired_leaf = HostNode(5, root, 100), HostNode(6, root, 4)
    runtime.ledger.record_path([live_leaf.id], "W1", "a")  # W1's cache on the device; nobody's is the other leaf
    cache = HostCache([root, *nodes.values(), live_leaf, retired_leaf], free=8, evictable=1000,
                      leaves=[live_leaf, retired_leaf])
    prefetcher = HostPrefetcher(runtime, cache)
    assert prefetcher.room() == 12  # free space and the retired leaf, never the live one
    flags = []
    cache.on_load = lambda: flags.append(runtime.priority(live_leaf) == runtime.fallback.priority(live_leaf))
    assert prefetcher.prefetch_once() == 10
    assert cache.loaded == [2, 1] and flags == [True, True]  # W1 waited longest: its latest agent's node first;
    # SGLang made room in lifecycle-aware order (retired first); W2's does not fit any more
    assert not runtime.making_room_for_prefetch and runtime.stats["prefetched_tokens"] == 10
    assert runtime.priority(live_leaf) == runtime.policy.priority(live_leaf)  # LRU again outside the load
    cache.free = 50
    assert prefetcher.prefetch_once() == 5 and cache.loaded == [2, 1, 3]  # then W2's; never W3's


@pytest.mark.parametrize("partial", [False, True])
def test_partial_eviction_in_sglang_frees_a_victims_tail_for_counted_and_allocation_driven_walks(partial):
    """With `partial_eviction` the tree core splits the victim SGLang's walk picks and evicts only the
    tokens still needed; the prefix stays matchable. Both of SGLang's walks: count-driven
    (evict(EvictParams)) and allocation-driven (evict_for_alloc: the allocator's shortfall, which
    the walk reads after each victim, with a quota of everything evictable)."""
    serving = Serving("pbkv_lae", {"partial_eviction": partial})
    serving.serve(prompt(100, 12), [1, 2], tag("A", "a"), label="A")  # one 14-token node
    cache, runtime = serving.cache, serving.runtime
    assert cache.evict(EvictParams(num_tokens=5)).num_tokens_evicted == (5 if partial else 14)
    again = Req(rid="again", origin_input_text="", origin_input_ids=array("q", prompt(100, 12) + [1, 2]),
                sampling_params=SamplingParams(max_new_tokens=1))
    assert match_kv_cache(again, cache).device_prefix_len == (9 if partial else 0)
    assert runtime.stats["partial_evictions"] == (1 if partial else 0)
    assert (runtime.stats["eviction_requested_tokens"], runtime.stats["evicted_gpu_tokens"]) == \
        (5, 5 if partial else 14)  # as the simulator counts: asked for, freed
    # allocation-driven: fill the pool, then ask for 3 tokens more than are free
    serving.serve(prompt(300, 200), [1], tag("B", "a"), label="B")
    free = serving.allocator.available_size()
    evicted = cache.evict_for_alloc(EvictParams(num_tokens=3)).num_tokens_evicted
    assert (evicted == 3) == partial and serving.allocator.available_size() == free + evicted
    assert (runtime.stats["eviction_requested_tokens"], runtime.stats["evicted_gpu_tokens"]) == \
        (8, 8 if partial else 14 + evicted)  # the shortfall counts as asked for either way
    assert runtime.stats["partial_evictions"] == (2 if partial else 0) and not cache.tree_core.shortfall
