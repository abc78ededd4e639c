"""Each policy's eviction order on hand-built trees."""

import math
import types

import pytest
import torch

from serving_integration.cache.policies import (KVFlow, LFU, LRU, PBKV, TLRU, LifecycleLRU, Oracle, PBKVTime, Prefetch,
                                          WorkflowLedger, make_policy)
from serving_integration.simulator.radix import RadixTree

AGENTS = ["<unk>", "coder", "planner", "tester"]  # END is index 4


def one_hot(*steps):
    """[K, A+1] with the given agent (or "END") at each step."""
    probs = torch.zeros(len(steps), len(AGENTS) + 1)
    for k, a in enumerate(steps):
        probs[k, len(AGENTS) if a == "END" else AGENTS.index(a)] = 1.0
    return probs


def tree_with(policy, *keys, host_tokens=0):
    """A tree ordered by `policy` (with its callbacks) holding these keys, each a leaf; the leaves."""
    tree = RadixTree(10_000, host_tokens, priority=policy.priority, on_evict=policy.on_evict,
                     on_split=policy.on_split, on_delete=policy.forget)
    leaves = []
    for key in keys:
        tree.private_gpu += len(key)
        leaves.append(tree.insert(list(key), [1] * len(key))[1][-1])
        tree.private_gpu -= len(key)
    return tree, leaves


def eviction_order(tree):
    return ["".join(n.units) for n in tree.evict_gpu(10**9)]


def test_lru_and_lfu():
    tree, _ = tree_with(LRU(), "aa", "bb", "cc")
    tree.match(list("aa"), [1, 1])
    assert eviction_order(tree) == ["bb", "cc", "aa"]
    tree, _ = tree_with(LFU(), "aa", "bb", "cc")
    for _ in range(2):
        tree.insert(list("bb"), [1, 1])
    assert eviction_order(tree) == ["aa", "cc", "bb"]


def test_tlru_matches_sglangs_strategy():
    from serving_integration.server.compat import install_torchvision_guard

    install_torchvision_guard()
    import sglang.srt.mem_cache.evict_policy as evict_policy
    ours, theirs = TLRU(threshold=5, next_prompt_estimate=2), evict_policy.TLRUStrategy(5, 2)
    tree, leaves = tree_with(ours, "abcdefgh", "abxy", "q")
    for node in tree.nodes():
        sglang_node = types.SimpleNamespace(key=[0] * node.num_tokens, last_access_time=node.last_access_time,
                                            _tlru_history_len=node.max_depth_tokens,
                                            _tlru_cached_prefix_len=node.depth_tokens)
        assert ours.priority(node) == theirs.get_priority(sglang_node)
    # branch "abxy" needs only its first 4 + 2 - 5 = 1 token cached, so "xy" (tokens 3-4) is wholly
    # past its budget; "q" (1 + 2 - 5 < 0) needs nothing cached. Both go first, oldest first, and
    # only then, by recency, the long branch, whose budget (8 + 2 - 5 = 5) its tail still overlaps
    assert eviction_order(tree) == ["xy", "q", "cdefgh", "ab"]


def test_lifecycle_retired_first():
    ledger = WorkflowLedger()
    tree, (a, b) = tree_with(LifecycleLRU(ledger), "aa", "bb")
    for w, node in (("w1", a), ("w2", b)):
        ledger.start(w)
        ledger.record_access(node.id, w, "coder")
        tree.refresh(node)  # the ledger changed: re-rank the node (the simulator does this too)
        assert not ledger.is_retired(node.id)
    tree.match(list("aa"), [1, 1])  # a is now also the most recent
    tree.refresh_ids(ledger.end("w1"))
    assert eviction_order(tree) == ["aa", "bb"]


def test_pbkv_score_of_a_prefix_shared_by_two_workflows():
    ledger = WorkflowLedger(gamma=0.5)
    policy = PBKV(ledger)
    tree, (shared, only_w2, retired) = tree_with(policy, "sp", "xy", "zz")
    shared_prefix = tree.by_key[shared.key_id]
    for w in ("w1", "w2", "w3"):
        ledger.start(w)
    ledger.record_access(shared.id, "w1", "planner")
    ledger.record_access(shared.id, "w2", "coder")
    ledger.record_access(only_w2.id, "w2", "tester")
    ledger.record_access(retired.id, "w3", "coder")
    probs = torch.stack([
        torch.tensor([[0.0, 0.2, 0.6, 0.1, 0.1], [0.0, 0.5, 0.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0, 0.0]]),
        torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]),
    ])
    ledger.set_predictions(["w1", "w2"], AGENTS, probs)
    # w1 on planner: 1 * 0.6 + 0.5 * (1 - 0.1) * 0.0 + 0.25 * (0.9 * 0.5) * 1.0 = 0.7125
    # w2 on coder:   1 * 0.7 + 0 + 0 = 0.7;  w2 on tester: 0.3 + 0.5 * 1.0 = 0.8
    assert ledger.score(shared_prefix.id) == pytest.approx(0.7125 + 0.7)
    assert ledger.score(only_w2.id) == pytest.approx(0.8)
    tree.refresh_ids(ledger.end("w3"))
    tree.refresh_many(tree.nodes())
    # retired first, then the lower score, and the shared prefix last
    assert eviction_order(tree) == ["zz", "xy", "sp"]


def test_kvflow_steps_to_execution_and_inheritance():
    ledger = WorkflowLedger()
    policy = KVFlow(ledger, hold_step=3)
    tree, (soon, later, unknown) = tree_with(policy, "ab", "ac", "dd")
    parent = soon.parent
    ledger.start("w")
    ledger.record_access(soon.id, "w", "coder")
    ledger.record_access(later.id, "w", "tester")
    ledger.record_access(unknown.id, "w", "planner")
    ledger.set_predictions(["w"], AGENTS, one_hot("coder", "coder", "tester")[None])
    assert ledger.steps_to_execution(soon.id, 3) == 1
    assert ledger.steps_to_execution(later.id, 3) == 3
    assert ledger.steps_to_execution(unknown.id, 3) == 4  # not in the next K steps: hold_step + 1
    tree.refresh_many(tree.nodes())
    order = tree.evict_gpu(10**9)
    assert ["".join(n.units) for n in order][:3] == ["dd", "c", "b"]
    assert order[-1] is parent and policy._inherited.get(parent.id) is None  # inherited 3 then 1, evicted


def test_oracle_evicts_furthest_next_use():
    distance = {}
    ledger = WorkflowLedger()
    tree, (a, b, c, d) = tree_with(Oracle(ledger, lambda node: distance.get(node.id, math.inf)), "aa", "bb", "cc", "dd")
    distance.update({a.id: 5, b.id: 1, d.id: 5})
    ledger.start("w")
    ledger.record_access(a.id, "w", "coder")
    ledger.set_predictions(["w"], AGENTS, one_hot("coder", "END", "END")[None])
    tree.refresh_many(tree.nodes())
    # never used again first; of two used equally far ahead, the one with the lower score
    assert eviction_order(tree) == ["cc", "dd", "aa", "bb"]


def test_prefetch_modes():
    ledger = WorkflowLedger()
    ledger.start("w")
    ledger.record_access(1, "w", "coder")
    live, retired = types.SimpleNamespace(id=1), types.SimpleNamespace(id=2)
    assert Prefetch("conservative", ledger).may_evict(retired) and not Prefetch("conservative", ledger).may_evict(live)
    assert Prefetch("aggressive", ledger).may_evict(live)
    ledger.set_predictions(["w"], AGENTS, one_hot("coder", "END", "END")[None])
    assert Prefetch("conservative", ledger).rank([retired, live]) == [live]
    with pytest.raises(ValueError, match="prefetch must be one of"):
        Prefetch("eager", ledger)
    with pytest.raises(ValueError, match="simulator only"):
        make_policy("oracle", ledger)


def test_kvflow_agent_step_graph_declared_pipeline_and_transitions():
    from data.generators import FinanceBench, Hover
    from serving_integration.cache.predictions import AgentStepGraph

    at = lambda *agents: types.SimpleNamespace(agents=list(agents))  # noqa: E731
    pipeline = AgentStepGraph(FinanceBench().agent_graph(), horizon=3)
    # after the first retriever call: two more retriever calls, then the analyst, the calculator, the writer
    assert pipeline.steps_of(at("retriever")) == {"retriever": 1, "analyst": 3, "calculator": 4, "writer": 6}
    assert pipeline.steps_of(at(*["retriever"] * 3)) == {"analyst": 1, "calculator": 2, "writer": 4}
    probs = pipeline.predict([at("retriever"), at(*["retriever"] * 3, "analyst", "calculator", "calculator")])
    names = pipeline.agent_names
    assert [names[i] for i in probs[0].argmax(-1).tolist()] == ["retriever", "retriever", "analyst"]
    assert names[probs[1, 0].argmax()] == "writer" and probs[1, 1:, -1].tolist() == [1.0, 1.0]  # then END

    hover = AgentStepGraph(Hover().agent_graph(), horizon=3)
    assert hover.steps_of(at("retriever", "summarizer")) == {"query_generator": 1, "verifier": 1, "retriever": 2,
                                                             "summarizer": 3}
    probs = hover.predict([at("retriever", "summarizer", "verifier")])
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 3))
    assert probs[0, 0, -1] == pytest.approx(0.5)  # the verifier ends the workflow or asks for one more hop

    # imported traces: every transition seen, not only the most frequent successor
    seen = AgentStepGraph.from_traces([["a", "b", "b", "c"], ["a", "b", "c"], ["a", "c"]], horizon=2)
    assert seen.graph["next"] == {"a": ["b", "c"], "b": ["b", "c"], "c": ["END"]} and seen.origin == "train transitions"
    assert AgentStepGraph.for_dataset({}, [["a", "b"]], 2).origin == "train transitions"
    assert AgentStepGraph.for_dataset({"agent_graph": Hover().agent_graph()}, [], 2).origin == "declared"
    with pytest.raises(ValueError, match="pipeline"):
        AgentStepGraph({"kind": "tree"}, 2)

    # the graph's steps replace the ones read off the predictions
    ledger = WorkflowLedger()
    ledger.start("w")
    ledger.record_access(7, "w", "analyst")
    ledger.set_predictions(["w"], names, pipeline.predict([at("retriever")]), pipeline.steps_to_execution([at("retriever")]))
    assert ledger.steps_to_execution(7, hold_step=5) == 3
def test_trust_meter_switches_with_hysteresis():
    from serving_integration.cache.trust import TrustMeter

    meter = TrustMeter(threshold=0.5, margin=0.1, window=4)
    assert meter.trusted  # trusted until calls show otherwise
    flips = [meter.update(0.0) for _ in range(4)]  # 0.75, 0.56, 0.42, 0.32: below 0.5 - 0.1 at the 4th
    assert meter.quality == pytest.approx(0.75 ** 4) and flips == [False, False, False, True] and not meter.trusted
    # back above threshold but inside the margin: still distrusted; above threshold + margin: trusted
    meter.quality = 0.55
    assert not meter.update(0.55) and not meter.trusted
    assert meter.update(1.0) and meter.trusted and meter.switches == 2
    with pytest.raises(ValueError, match="trust"):
        TrustMeter(threshold=0.95, margin=0.1)


def test_accuracy_trust_falls_back_to_lifecycle_lru_when_predictions_miss():
    ledger = WorkflowLedger(gamma=0.5)
    accuracy, always = PBKV(ledger, trust="accuracy", trust_window=2), PBKV(ledger, trust="always")
    with pytest.raises(ValueError, match="pbkv.trust"):
        PBKV(ledger, trust="sometimes")
    tree, (old, new) = tree_with(accuracy, "ab", "cd")
    ledger.start("w")
    ledger.record_access(old.id, "w", "planner")
    ledger.record_access(new.id, "w", "coder")
    # the predictor keeps saying planner (old's agent) is next; coder is what comes
    for _ in range(3):
        ledger.set_predictions(["w"], AGENTS, one_hot("planner", "END", "END")[None])
        assert ledger.check_prediction("w", "coder") == 0.0
        assert ledger.check_prediction("w", "coder") is None  # one test per prediction
    assert always.observe_call("w", "coder") is False and always.trusted  # the paper's policy never doubts
    ledger.set_predictions(["w"], AGENTS, one_hot("planner", "END", "END")[None])
    assert accuracy.trusted
    assert accuracy.observe_call("w", "coder") is False  # quality 0.5: inside the margin
    ledger.set_predictions(["w"], AGENTS, one_hot("planner", "END", "END")[None])
    assert accuracy.observe_call("w", "coder") is True and not accuracy.trusted  # 0.25 < 0.4: flipped
    # the trusting order keeps the predicted node; untrusted, it is lifecycle-aware LRU (older first)
    assert always.priority(old) > always.priority(new)
    assert accuracy.priority(old) < accuracy.priority(new)
    tree.reprioritize()
    assert eviction_order(tree) == ["ab", "cd"]


def test_reprioritize_rebuilds_the_heaps_in_the_new_order():
    from serving_integration.simulator.radix import audit

    order = {"key": lambda n: (n.last_access_time,)}
    tree = RadixTree(10_000, 0, priority=lambda n: order["key"](n))
    for key in ("ab", "cd", "ef"):
        tree.private_gpu += 2
        tree.insert(list(key), [1, 1])
        tree.private_gpu -= 2
    order["key"] = lambda n: (-n.last_access_time,)  # the policy switched: newest first now
    tree.reprioritize()
    audit(tree)
    assert eviction_order(tree) == ["ef", "cd", "ab"]


def reference_score(ledger, node_id):
    """Score(c) from its definition: users in first-use order, each one's agents in first-use order."""
    total = 0.0
    for w, agents in ledger.users.get(node_id, {}).items():
        values = ledger.reuse_value.get(w)
        if values:
            part = 0.0
            for a in agents:
                part += values.get(a, 0.0)
            total += part
    return total


def test_ledger_scores_stay_equal_to_their_definition_under_random_operations():
    import random

    rng = random.Random(0)
    agents = AGENTS[1:] + ["reviewer"]  # reviewer: an agent the predictions never name
    ledger, live, nodes, next_id, seen = WorkflowLedger(gamma=0.7), [], [], 1, 0
    for step in range(3000):
        op = rng.random()
        if op < 0.08 or not live:
            w = f"w{step}"
            ledger.start(w)
            live.append(w)
        elif op < 0.45:
            if not nodes or rng.random() < 0.3:
                nodes.append(next_id)
                next_id += 1
            ledger.record_access(rng.choice(nodes), rng.choice(live), rng.choice(agents))
        elif op < 0.55 and nodes:
            ledger.split(next_id, rng.choice(nodes))
            nodes.append(next_id)
            next_id += 1
        elif op < 0.62 and nodes:
            node = nodes.pop(rng.randrange(len(nodes)))
            ledger.forget(node)
        elif op < 0.68:
            ledger.end(live.pop(rng.randrange(len(live))))
        else:
            batch = rng.sample(live, rng.randint(1, min(3, len(live))))
            probs = torch.rand(len(batch), 3, len(AGENTS) + 1, generator=torch.Generator().manual_seed(step))
            before = {n: ledger.score(n) for n in nodes}
            changed = ledger.set_predictions(batch, AGENTS, probs / probs.sum(-1, keepdim=True))
            moved = {n for n in nodes if ledger.score(n) != before[n]}
            assert moved <= set(changed.scores)  # every node whose score moved is reported
        for n in nodes:
            assert ledger.score(n) == reference_score(ledger, n)  # the same float, not just close
            seen += n in ledger.users and len(ledger.users[n]) > 1
    assert seen > 100  # shared nodes (summed over several users) were checked too


def timed_setup(tau, *keys):
    """A pbkv_time policy over a tree holding these keys, workflow w<i> the only reader of the i-th (agent coder)."""
    ledger = WorkflowLedger(gamma=0.5)
    policy = PBKVTime(ledger, time_tau_s=tau)
    tree, leaves = tree_with(policy, *keys)
    for i, leaf in enumerate(leaves):
        ledger.start(f"w{i}")
        ledger.record_access(leaf.id, f"w{i}", "coder")
    return ledger, policy, tree, leaves


def predict(policy, tree, workflows, probs, seconds, now):
    tree.refresh_ids(policy.on_predictions(workflows, AGENTS, torch.stack(probs),
                                           None if seconds is None else torch.tensor(seconds, dtype=torch.float64),
                                           now))


def test_pbkv_time_keeps_the_front_of_the_admission_queue():
    """Three workflows sure to call coder next: w0 and w1 queued (w0 first), w2's call not issued yet.
    Belady under FCFS: w2's context is read last (after both queued calls), then w1's; LRU would
    evict w0's first, the oldest, though its call is admitted next."""
    _, policy, tree, (a, b, c) = timed_setup(10.0, "aa", "bb", "cc")
    predict(policy, tree, ["w0", "w1"], [one_hot("coder", "END", "END")] * 2, None, now=0.0)
    predict(policy, tree, ["w2"], [one_hot("coder", "END", "END")], None, now=8.0)
    tree.refresh_ids(policy.on_queued("w0", "coder", [a.id], 3.0))
    tree.refresh_ids(policy.on_queued("w1", "coder", [b.id], 5.0))
    assert eviction_order(tree) == ["cc", "bb", "aa"]


def test_pbkv_time_trades_probability_against_time():
    """w0: coder next with probability 0.2, at once; w1: with 0.9, in 30 s. tau = 10 s: 0.9 e^-3 =
    0.045 < 0.2, w1's node goes first; tau = 1000 s: the probabilities decide, w0's goes first."""
    soon, later = torch.zeros(3, 5), torch.zeros(3, 5)
    soon[:, 4], later[:, 4] = 1.0, 1.0
    soon[0], later[0] = torch.tensor([0.0, 0.2, 0.0, 0.0, 0.8]), torch.tensor([0.0, 0.9, 0.0, 0.0, 0.1])
    for tau, order in ((10.0, ["bb", "aa"]), (1000.0, ["aa", "bb"])):
        _, policy, tree, _ = timed_setup(tau, "aa", "bb")
        predict(policy, tree, ["w0", "w1"], [soon, later], [[0.0, 0.0, 0.0], [30.0, 30.0, 30.0]], now=0.0)
        assert eviction_order(tree) == order


def test_pbkv_time_values_are_logarithms_that_neither_overflow_nor_underflow():
    """A week into a replay with tau = 0.01 s the discounts are e^(-6e7): kept as logarithms, the
    order is still the one of the times, and the shared node's value is the log-sum-exp of its two
    readers' terms."""
    ledger, policy, tree, (a, b) = timed_setup(0.01, "aa", "bb")
    week = 7 * 86400.0
    predict(policy, tree, ["w0", "w1"], [one_hot("coder", "END", "END")] * 2, [[1.0, 0, 0], [2.0, 0, 0]], now=week)
    x0, x1 = policy.log_value(a.id), policy.log_value(b.id)
    assert x0 == pytest.approx(-week / 0.01 - 100.0, abs=1e-6) and x1 == pytest.approx(x0 - 100.0, abs=1e-6)
    ledger.record_access(a.id, "w1", "coder")  # w1 reads a too: log(e^x0 + e^x1)
    assert policy.log_value(a.id) == pytest.approx(x0 + math.log1p(math.exp(-100.0)), abs=1e-6)
    assert eviction_order(tree) == ["bb", "aa"]


def test_pbkv_time_queued_call_is_step_one_and_its_path_survives_a_split():
    """While a call is queued its workflow's predicted step 1 is replaced by the call (the sum starts
    at k = 2), and a split of a node on the queued path keeps the queued term on both halves; once
    the call finishes, the term is gone."""
    ledger, policy, tree, (a,) = timed_setup(10.0, "abcd")
    predict(policy, tree, ["w0"], [one_hot("coder", "coder", "END")], None, now=0.0)
    before = policy.log_value(a.id)
    assert before == pytest.approx(math.log(1.0 + 0.5))  # steps 1 and 2, both coder
    policy.on_queued("w0", "coder", [a.id], 20.0)
    assert policy.log_value(a.id) == pytest.approx(math.log(math.exp(-2.0) + 0.5))  # the call at 20 s, step 2
    tree.private_gpu += 4
    tree.insert(list("abxy"), [1] * 4)  # splits "abcd" into "ab" + "cd"
    tree.private_gpu -= 4
    prefix = a.parent  # the split node keeps its id for the suffix
    assert prefix.units == ("a", "b") and set(policy.queued_on) == {a.id, prefix.id}
    policy.on_call_finished("w0", "coder", [], 4, True)
    assert policy.queued_on == {} and policy.log_value(a.id) == pytest.approx(math.log(0.5))
