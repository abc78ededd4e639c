"""KV pruning in the simulator: budgets, protected spans, and how each layout reaches the cache."""

import pytest

from data.generators import SweBench
from serving_integration.experiments.intentkv_replay import LAYOUTS, prune_workflows
from serving_integration.cache.workload import workflows_from_rows


@pytest.fixture(scope="module")
def workflows():
    return workflows_from_rows(SweBench().generate(8, seed=4).calls)


@pytest.mark.parametrize("method", ["intent", "streaming_llm", "h2o", "snapkv"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_budget_and_protected_spans(workflows, method, layout):
    budget = 6000
    pruned = prune_workflows(workflows, method, budget, layout, chunk_tokens=64)
    for original, w in zip(workflows, pruned):
        for before, after in zip(original.calls, w.calls):
            first, last = before.lens[0], before.lens[-1]
            assert after.prompt_tokens <= max(budget, first + last)  # only protected spans may exceed it
            if before.prompt_tokens <= budget:
                assert after.prompt_tokens == before.prompt_tokens  # nothing to prune
            if layout == "sentinel":  # the full sequence stays the key; dropped chunks hold no KV
                assert sum(after.lens[: -(-first // 64)]) == first  # system prefix kept whole


def same_agent_pairs(w):
    """(earlier call, later call) of the same agent, hence the same system prompt."""
    last = {}
    for call in w.calls:
        if call.agent in last:
            yield last[call.agent], call
        last[call.agent] = call


def test_sentinel_keeps_every_earlier_prefix_and_compaction_loses_it(workflows):
    sentinel = prune_workflows(workflows, "intent", 4000, "sentinel")
    compaction = prune_workflows(workflows, "intent", 4000, "compaction")
    pairs = broken = 0
    for s_w, c_w in zip(sentinel, compaction):
        for prev, cur in same_agent_pairs(s_w):
            assert cur.units[: len(prev.units)] == prev.units
            pairs += 1
        broken += sum(cur.units[: len(prev.units)] != prev.units for prev, cur in same_agent_pairs(c_w))
    assert pairs > 0 and broken > 0


def test_unknown_method_or_layout(workflows):
    with pytest.raises(ValueError, match="kv.method"):
        prune_workflows(workflows, "random", 4000, "sentinel")
    with pytest.raises(ValueError, match="kv.layouts"):
        prune_workflows(workflows, "intent", 4000, "paged")
