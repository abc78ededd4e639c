"""The baselines of cache/baselines.py: SGLang's strategies against SGLang's own classes, and each
workflow-aware baseline's eviction order on small hand-built trees (what goes first, and why)."""

import itertools
import random
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving_integration.cache.policies import POLICIES, SGLANG_POLICIES, KVFlow, WorkflowLedger, make_policy
from serving_integration.cache.baselines import FIFO, FILO, MRU, SLRU, Continuum, KVFlowFork, KVFlowNoLifecycle, \
    LRUPrefetch, Priority
from serving_integration.simulator.radix import RadixTree
from tests.cache.test_policies import AGENTS, one_hot
from tests.cache.test_policies import tree_with as policies_tree_with


def sglang_strategies():
    from serving_integration.server.compat import install_torchvision_guard

    install_torchvision_guard()
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES

    return _EVICTION_POLICY_FACTORIES


def tree_with(policy, *keys):
    return policies_tree_with(policy, *keys, host_tokens=10_000)


def eviction_order(tree, tokens=10**9):
    return ["".join(n.units) for n in tree.evict_gpu(tokens)]


# -------------------------------------------------------------------- SGLang's strategies


@pytest.mark.parametrize("ours", [FIFO, MRU, FILO, SLRU, Priority])
def test_sglang_strategies_order_hand_built_nodes_as_sglangs_classes(ours):
    """Random nodes (times, hit counts, request priorities with ties): our strategy and SGLang's
    class rank every pair the same way, and agree on every node's value."""
    theirs = sglang_strategies()[ours.name]()
    rng = random.Random(ours.name)
    nodes = [types.SimpleNamespace(id=i, last_access_time=float(rng.randint(0, 20)),
                                   creation_time=float(rng.randint(0, 20)), hit_count=rng.randint(0, 4),
                                   priority=rng.randint(-1, 2)) for i in range(60)]
    policy = ours()
    for a, b in itertools.combinations(nodes, 2):
        assert (policy.priority(a) < policy.priority(b)) == (_key(theirs.get_priority(a)) < _key(theirs.get_priority(b)))
        assert (policy.priority(a) == policy.priority(b)) == (_key(theirs.get_priority(a)) == _key(theirs.get_priority(b)))


def _key(value):
    return value if isinstance(value, tuple) else (value,)


def test_sglang_strategies_are_served_by_sglang_under_their_own_names():
    factories = sglang_strategies()
    for cls in (FIFO, MRU, FILO, SLRU, Priority):
        assert cls.served_by == "sglang" and cls.name in SGLANG_POLICIES and cls.name in factories


def test_fifo_filo_mru_slru_on_a_tree():
    # FIFO: the oldest node first; a split prefix keeps its node's creation time ("ab" splits "abcd")
    tree, _ = tree_with(FIFO(), "abcd", "xy", "abq")
    tree.match(list("abcd"), [1] * 4)  # recency does not matter to FIFO
    assert eviction_order(tree) == ["cd", "xy", "q", "ab"]
    tree, _ = tree_with(FILO(), "aa", "bb", "cc")
    assert eviction_order(tree) == ["cc", "bb", "aa"]
    tree, _ = tree_with(MRU(), "aa", "bb", "cc")
    tree.match(list("aa"), [1, 1])
    assert eviction_order(tree) == ["aa", "cc", "bb"]
    # SLRU: "bb" hit twice is protected, so it goes last although it is the most recent
    tree, _ = tree_with(SLRU(), "aa", "bb", "cc")
    tree.insert(list("bb"), [1, 1])
    assert eviction_order(tree) == ["aa", "cc", "bb"]


# -------------------------------------------------------------------- KVFlow as the fork runs it


def fork_setup(**options):
    ledger = WorkflowLedger()
    policy = KVFlowFork(ledger, **options)
    return ledger, policy


def cache(tree, policy, ledger, workflow, agent, key):
    """A call of `agent` in `workflow` whose prompt is `key`: matched, then cached (the fork records
    the agent on the request's last node)."""
    ledger.start(workflow)
    path = tree.match(list(key), [1] * len(key))
    policy.on_cached(path[-1] if path else None, workflow, agent, False)
    tree.private_gpu += len(key)
    path = tree.insert(list(key), [1] * len(key))[1]
    tree.private_gpu -= len(key)
    policy.on_cached(path[-1], workflow, agent, True)
    return path[-1]


def test_kvflow_tiers_then_dfs_order_within_a_tier():
    """hold_step 4: passes evict hold priority >= 3, then 2, then 1, then anything; within a pass the
    leaves go in DFS order (children in insertion order), not by recency."""
    ledger, policy = fork_setup(hold_step=4)
    tree = RadixTree(10_000, 10_000, priority=policy.priority, on_evict=policy.on_evict, on_split=policy.on_split,
                     on_delete=policy.forget)
    nodes = {a: cache(tree, policy, ledger, "w", a, key)
             for a, key in (("coder", "cc"), ("planner", "pp"), ("tester", "tt"), ("writer", "ww"), ("idle", "ii"))}
    # steps-to-execution k (ours, >= 1) is the fork's step k - 1: coder runs next (step 0)
    named = policy.on_steps(["w"], [{"coder": 1, "planner": 2, "tester": 3, "writer": 5}])
    # writer's step 4 and the missing agents' hold_step + 1 are both past the cap: only three tiers moved
    assert sorted(named) == sorted(nodes[a].id for a in ("coder", "planner", "tester"))
    tree.reprioritize_ids(named)
    assert policy.hold(nodes["coder"]) == 0 and policy.hold(nodes["planner"]) == 1
    assert policy.hold(nodes["tester"]) == 2
    assert policy.hold(nodes["writer"]) == 4 and policy.hold(nodes["idle"]) == 5  # missing: hold_step + 1
    tree.match(list("ww"), [1, 1])  # recency does not reorder a tier
    # first pass (>= 3): writer and idle, in DFS order (writer's node was inserted first); then
    # tester (2), planner (1), and coder, due next, only in the last pass
    assert eviction_order(tree) == ["ww", "ii", "tt", "pp", "cc"]


def test_kvflow_without_holding_is_dfs_order_alone():
    ledger, policy = fork_setup(holding=False)
    tree = RadixTree(10_000, 10_000, priority=policy.priority, on_split=policy.on_split, on_delete=policy.forget)
    for a, key in (("coder", "cc"), ("planner", "pp")):
        cache(tree, policy, ledger, "w", a, key)
    policy.on_steps(["w"], [{"coder": 1, "planner": 5}])
    tree.reprioritize()
    assert eviction_order(tree) == ["cc", "pp"]  # the agent due next goes first: the fork's default


def test_kvflow_keys_agents_globally_and_keeps_them_after_the_workflow_ends():
    """agent_key=role: a retired workflow's coder cache is held like the live workflow's coder, due
    next; no lifecycle signal. agent_key=workflow separates them."""
    for key, retired_first in (("role", False), ("workflow", True)):
        ledger, policy = fork_setup(agent_key=key)
        tree = RadixTree(10_000, 10_000, priority=policy.priority, on_split=policy.on_split, on_delete=policy.forget)
        old = cache(tree, policy, ledger, "w1", "coder", "oo")
        cache(tree, policy, ledger, "w2", "coder", "cc")
        cache(tree, policy, ledger, "w2", "planner", "pp")
        ledger.end("w1")
        policy.on_steps(["w2"], [{"coder": 1, "planner": 4}])
        tree.reprioritize()
        assert (policy.hold(old) == 5) == retired_first
        order = eviction_order(tree)
        assert order == (["oo", "pp", "cc"] if retired_first else ["pp", "oo", "cc"]), key


def test_kvflow_split_prefix_copies_agents_and_parent_inherits_on_eviction():
    ledger, policy = fork_setup()
    tree = RadixTree(10_000, 10_000, priority=policy.priority, on_evict=policy.on_evict, on_split=policy.on_split,
                     on_delete=policy.forget)
    cache(tree, policy, ledger, "w", "coder", "abcd")
    leaf = cache(tree, policy, ledger, "w", "planner", "abxy")
    prefix = leaf.parent
    assert "".join(prefix.units) == "ab" and set(policy.node_agents[prefix.id]) == {"coder"}
    policy.on_steps(["w"], [{"coder": 1, "planner": 2}])
    tree.reprioritize()
    assert policy.hold(prefix) == 0
    # evicting both children: the prefix inherits the larger hold priority (planner's 1)
    eviction_order(tree, 4)
    assert policy.hold(prefix) == 1


def test_kvflow_last_nodes_and_its_prefetch_round():
    """The fork's agent_to_last_nodes: the deepest nodes an agent reached (an ancestor is replaced).
    Its prefetch: agents due at steps 0 .. load_ahead_step in step order, once per update; a loaded
    node holds step + 1 until the next update."""
    ledger, policy = fork_setup(load_ahead_step=1)
    tree = RadixTree(10_000, 10_000, priority=policy.priority, on_evict=policy.on_evict, on_split=policy.on_split,
                     on_delete=policy.forget)
    first = cache(tree, policy, ledger, "w", "coder", "ab")
    deeper = cache(tree, policy, ledger, "w", "coder", "abcd")
    assert list(policy.last_nodes["coder"]) == [deeper.id] and first.id not in policy.last_nodes["coder"]
    planner = cache(tree, policy, ledger, "w", "planner", "pp")
    tester = cache(tree, policy, ledger, "w", "tester", "tt")
    tree.evict_gpu(10**9)  # everything to the host
    policy.on_steps(["w"], [{"planner": 2, "coder": 1, "tester": 3}])
    order = policy.prefetch_order(tree.by_id, ["w"])
    assert [(n, s) for n, s in order] == [(deeper, 0), (planner, 1)]  # tester's step 2 > load_ahead_step
    policy.on_prefetched([planner], 1)
    assert policy.hold(planner) == 2 and [n for n, _ in policy.prefetch_order(tree.by_id, ["w"])] == [deeper]
    policy.on_prefetch_failed()  # a load that does not fit ends the round
    assert policy.prefetch_order(tree.by_id, ["w"]) == []
    policy.on_steps(["w"], [{"planner": 2, "coder": 1}])
    assert policy.hold(planner) == 1 and tester.id not in policy.pending  # a new version; tester is not due


@pytest.mark.parametrize("hicache_ratio", [2.0, 0.0])
def test_kvflow_step_update_leaves_the_heaps_as_a_rebuild_would(hicache_ratio):
    """The simulator re-ranks only the nodes a step update names (not the whole tree): on a replay
    with the fork's prefetch, after every update that changes the order each evictable node's
    entry in the heaps holds the priority a rebuild of the whole tree would give it. (This replay
    checks the tiers and holds; a split above an evictable leaf, which lengthens its DFS position,
    it does not produce: the regime step's tau-bench replay at 0.5x and 64 live did, and its
    summary is the rebuild's.)"""
    from data.generators import Hover
    from serving_integration.cache.predictions import AgentStepGraph
    from serving_integration.cache.workload import workflows_from_rows
    from serving_integration.simulator.engine import SimConfig, Simulator
    from tests.simulator.test_simulator import H100

    workflows = workflows_from_rows(Hover().generate(60, seed=3).calls)
    graph = AgentStepGraph.from_traces([[c.agent for c in w.calls] for w in workflows], 3)
    sim = Simulator(workflows, SimConfig(gpu_tokens=20_000, concurrency=8, hicache_ratio=hicache_ratio), H100,
                    policy="kvflow", predictions=graph, prefetch="kvflow")
    seen = {"updates": 0, "named": 0}

    class CheckedTree(RadixTree):  # the tree is an extension type when compiled: checked in a subclass
        def reprioritize_ids(self, node_ids):
            node_ids = list(node_ids)
            super().reprioritize_ids(node_ids)
            if not node_ids:
                return
            held = {entry[-2]: entry[:-2] for entry in self._gpu_heap}  # (*priority, entry number, node)
            for node in self.nodes():
                if self.gpu_evictable(node):
                    assert held[node._gpu_entry] == self.priority(node), f"{node}: a stale priority in the heap"
            seen["updates"] += 1
            seen["named"] += len(node_ids)

    server, empty = sim.servers[0], sim.servers[0].tree
    server.tree = CheckedTree(empty.gpu_capacity, empty.host_capacity, priority=empty.priority,
                              on_delete=empty.on_delete, on_split=empty.on_split, on_evict=empty.on_evict,
                              partial_eviction=empty.partial_eviction)
    sim.run()
    assert seen["updates"] > 100 and seen["named"] > 0  # the replay re-ranked nodes


# -------------------------------------------------------------------- KVFlow, idealised, without lifecycle


def test_kvflow_nolae_holds_retired_cache_like_an_agent_outside_the_graph():
    for cls, first in ((KVFlow, "rr"), (KVFlowNoLifecycle, "oo")):
        ledger = WorkflowLedger()
        policy = cls(ledger, hold_step=3)
        tree, (retired, outside, soon) = tree_with(policy, "rr", "oo", "ss")
        ledger.start("w1")
        ledger.start("w2")
        ledger.record_access(retired.id, "w1", "coder")
        ledger.record_access(outside.id, "w2", "planner")
        ledger.record_access(soon.id, "w2", "coder")
        ledger.set_predictions(["w2"], AGENTS, one_hot("coder", "END", "END")[None])
        ledger.end("w1")
        tree.match(list("rr"), [1, 1])  # the retired cache is the most recent
        tree.refresh_many(tree.nodes())
        # idealised: retired cache never needed, first; without lifecycle it ties with planner (4)
        # and LRU puts the older outside-graph node first
        assert eviction_order(tree)[0] == first, cls.name


# -------------------------------------------------------------------- LRU with plain prefetch


def test_lru_prefetch_orders_by_recency_and_prefetches_the_longest_waiting_workflows_last_nodes():
    ledger = WorkflowLedger()
    policy = LRUPrefetch(ledger)
    tree, (a, b, c, d) = tree_with(policy, "aa", "bb", "cc", "dd")
    tree.match(list("aa"), [1, 1])
    assert eviction_order(tree, 2) == ["bb"]
    ledger.start("w1")
    ledger.start("w2")
    policy.on_cached(c, "w1", "coder", True)
    policy.on_cached(d, "w1", "tester", True)  # w1's agents: tester ran last
    policy.on_cached(a, "w2", "coder", True)
    tree.evict_gpu(10**9)
    # w1's last call finished first: it has waited longest; its agents' last nodes, the latest first
    assert policy.prefetch_order(tree.by_id, ["w2", "w1"]) == [(d, None), (c, None), (a, None)]
    assert policy.prefetch_order(tree.by_id, ["w2"]) == [(a, None)]  # only the waiting ones
    policy.on_cached(c, "w1", "coder", True)  # coder ran again: now w1's latest, and w1 waited least
    assert policy.prefetch_order(tree.by_id, ["w1", "w2"]) == [(a, None), (c, None), (d, None)]
    ledger.end("w2")
    assert policy.prefetch_order(tree.by_id, ["w2", "w1"]) == [(c, None), (d, None)]


# -------------------------------------------------------------------- Continuum


def continuum(times=(1.0, 2.0, 3.0, 50.0), **options):
    ledger = WorkflowLedger()
    policy = Continuum(ledger, **options)
    policy.attach(10_000, lambda new, cached: new * 0.01)  # 10 ms a token: 1000 tokens reload in 10 s
    for t in times:  # seen after another agent's calls: a coder's TTL reads them all
        policy.record_tool_time("searcher", t)
    return ledger, policy


def test_continuum_ttl_is_the_expected_benefit_maximum_over_the_tool_time_cdf():
    _, policy = continuum()
    # 1000 tokens (share 0.1), reload 10 s: gain(t) = F(t) x 10 - 1.0 x 0.1 x E[min(T, t)]
    # t=1: 2.5 - 0.1; t=2: 5 - 0.175; t=3: 7.5 - 0.225; t=50: 10 - 1.4 -> 50 s
    assert policy.ttl("coder", 1000) == 50.0
    # memory dearer (2 s a second): t=1: 2.5 - 2; t=2: 5 - 3.5; t=3: 7.5 - 4.5; t=50: 10 - 28 -> 3 s
    _, policy = continuum(hold_cost=20.0)
    assert policy.ttl("coder", 1000) == 3.0
    _, policy = continuum(hold_cost=20.0, ttl_estimator="mean")  # the public code's: the mean, if it pays
    assert policy.ttl("coder", 1000) == 0.0  # 14 s held costs 28 s > 10 s of reload
    _, policy = continuum(ttl_estimator="mean")
    assert policy.ttl("coder", 1000) == 14.0
    _, policy = continuum(times=())
    assert policy.ttl("coder", 1000) == 0.0  # nothing seen yet: no pin


@settings(max_examples=200, deadline=None, derandomize=True)
@given(times=st.lists(st.floats(0.0, 400.0), min_size=1, max_size=40),
       tokens=st.integers(1, 30_000), hold_cost=st.floats(0.01, 50.0))
def test_continuum_ttl_is_what_a_scan_of_the_sorted_times_gives(times, tokens, hold_cost):
    """The TTL, computed on arrays kept sorted as the times come, is the one a scan of the sorted
    times for the first largest gain gives (the class docstring's formula, term by term), for an
    agent with times of its own and for one that falls back to all of them."""
    ledger = WorkflowLedger()
    policy = Continuum(ledger, hold_cost=hold_cost)
    policy.attach(10_000, lambda new, cached: new * 0.01)
    for i, t in enumerate(times):
        policy.record_tool_time("coder" if i % 2 else "searcher", t)
    for agent, seen in (("coder", policy.tool_times.get("coder") or times), ("planner", times)):
        reload_s, hold = tokens * 0.01, hold_cost * min(tokens / 10_000, 1.0)
        ordered, n = sorted(seen), len(seen)
        best, best_gain, below = 0.0, 0.0, 0.0
        for i, t in enumerate(ordered):
            below += t
            gain = (i + 1) / n * reload_s - hold * ((below + t * (n - i - 1)) / n)
            if gain > best_gain:
                best, best_gain = t, gain
        assert policy.ttl(agent, tokens) == min(best, policy.max_ttl_s)


def test_continuum_pin_expires_after_its_ttl_and_is_released_at_the_next_call():
    ledger, policy = continuum(times=(5.0,))
    tree, (mine, other) = tree_with(policy, "mm", "oo")
    ledger.start("w")
    ledger.start("v")
    policy.on_time(10.0)
    tree.refresh_ids(policy.on_call_finished("w", "coder", [mine.id], 1000, True))
    assert policy.is_pinned(mine.id) and policy.pins["w"][0] == 15.0
    assert eviction_order(tree, 2) == ["oo"]  # the older node is pinned: the newer one goes first
    tree, (mine, other) = tree_with(policy, "mm", "oo")  # fresh nodes, same policy
    tree.refresh_ids(policy.on_call_finished("w", "coder", [mine.id], 1000, True))
    tree.refresh_ids(policy.on_time(14.9))
    assert policy.is_pinned(mine.id)
    tree.refresh_ids(policy.on_time(15.0))  # the TTL has passed
    assert not policy.is_pinned(mine.id)
    assert eviction_order(tree, 2) == ["mm"]  # LRU again
    # released at the program's next call, and its tool time (3 s) joins the distribution
    tree, (mine, other) = tree_with(policy, "mm", "oo")
    policy.on_time(20.0)
    tree.refresh_ids(policy.on_call_finished("w", "coder", [mine.id], 1000, True))
    policy.on_time(23.0)
    policy.observe_call("w", "tester")
    assert not policy.is_pinned(mine.id) and policy.tool_times["coder"] == [3.0]
    assert mine.id in policy.on_time(23.0)  # the caller refreshes the released nodes
    # no pin after the last call, and a retired program's pin goes at once
    assert policy.on_call_finished("w", "coder", [mine.id], 1000, False) == []
    policy.on_call_finished("v", "coder", [other.id], 1000, True)
    ledger.end("v")
    assert other.id in policy.on_time(23.5) and not policy.is_pinned(other.id)


def test_every_baseline_is_in_the_one_registry():
    for name in ("fifo", "mru", "filo", "slru", "priority", "kvflow", "kvflow_ideal", "kvflow_nolae", "lru_prefetch",
                 "continuum"):
        assert name in POLICIES
        make_policy(name, WorkflowLedger())
