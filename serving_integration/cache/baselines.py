"""Baselines as their authors run them, registered into policies.POLICIES (one registry).

SGLang's own strategies (0.5.23, mem_cache/evict_policy.py), written as SGLang writes them: each
is one `priority(node)` over the fields SGLang's TreeNode has (`last_access_time`,
`creation_time`, `hit_count`, `priority`); tests/cache/test_baselines.py checks each against
SGLang's class on hand-built nodes.

    fifo      creation time (a split prefix keeps its node's)             FIFOStrategy
    mru       newest access first                                         MRUStrategy
    filo      newest creation first                                       FILOStrategy
    slru      (hit count >= protected_threshold, last access)             SLRUStrategy
    priority  (request priority, last access)                             PriorityStrategy

Workflow-aware baselines (the simulator and the SGLang plugin, server/; docs/baselines/):

    kvflow        KVFlow as its public code runs it (github.com/PanZaifeng/KVFlow, an SGLang fork):
                  tiered passes over hold priorities, DFS order within a tier, agents keyed
                  globally, its step 0-2 prefetch that may evict and protects what it loaded
                  (docs/baselines/kvflow.md, line by line against the fork's files)
    kvflow_nolae  the idealised KVFlow (policies.KVFlow, `kvflow_ideal`) without its lifecycle
                  signal: cache of retired workflows counts as an agent outside the step graph
    lru_prefetch  LRU, and prefetch of each waiting workflow's own last nodes (one per agent), the
                  one that waited longest first (no predictor): what plain prefetch gains
    continuum     Continuum's tool-call TTL pin (arXiv 2511.02230): a program's KV is kept through
                  its tool call for a TTL from a cost model, then released; LRU otherwise
                  (docs/baselines/continuum.md)
"""

from __future__ import annotations


from typing import Any, Iterable

import numpy as np

from serving_integration.cache.config import ContinuumConfig, KvflowConfig
from serving_integration.cache.policies import EvictionPolicy, KVFlow, WorkflowLedger, _LedgerPolicy, on_gpu, \
    register

# -------------------------------------------------------------------- SGLang's own strategies


class FIFO(EvictionPolicy):
    name = "fifo"

    def priority(self, node):
        return (node.creation_time,)


class MRU(EvictionPolicy):
    name = "mru"

    def priority(self, node):
        return (-node.last_access_time,)


class FILO(EvictionPolicy):
    name = "filo"

    def priority(self, node):
        return (-node.creation_time,)


class SLRU(EvictionPolicy):
    """Segmented LRU: the probationary segment (hit count below the threshold) goes first."""

    name = "slru"

    def __init__(self, protected_threshold: int = 2):  # SGLang's default
        self.protected_threshold = protected_threshold

    def priority(self, node):
        return (1 if node.hit_count >= self.protected_threshold else 0, node.last_access_time)


class Priority(EvictionPolicy):
    """Lower request priority first, then LRU. The replayed traces carry no request priority (every
    node's is 0), so on them it orders as LRU."""

    name = "priority"

    def priority(self, node):
        return (node.priority, node.last_access_time)


# -------------------------------------------------------------------- KVFlow, ablation of the idealised one


class KVFlowNoLifecycle(KVFlow):
    """kvflow_ideal without the lifecycle signal: a node no live workflow uses (its workflows
    retired) gets hold_step + 1, as an agent outside the step graph does, not "never needed"."""

    name = "kvflow_nolae"

    def steps(self, node) -> float:
        return min(super().steps(node), self.hold_step + 1)


class KVFlowFork(_LedgerPolicy):
    """KVFlow as github.com/PanZaifeng/KVFlow runs it (docs/baselines/kvflow.md, each rule against
    the fork's lines).

    State, as the fork keeps it: `node_agents` (TreeNode.agents: the agents whose request ended at
    a node, copied to a split's prefix), `last_nodes` (AgentManager.agent_to_last_nodes: per agent
    the deepest nodes its requests reached), the latest step update `agent_step` / `step_agents`
    (update_dict_agent / update_dict_timestep; step 0 = the agent that runs next), and `held`: hold
    priorities set since that update by a prefetch (step + 1) or inherited from an evicted child.

    Hold priority of a node (AgentManager.get_node_hold_priority): `held`, else the smallest step of
    its agents, an agent missing from the update counting hold_step + 1 (and a leaf at the update
    1000: either way the first tier), a node with no agents hold_step + 2. Eviction
    (HiRadixCache.evict): passes for steps = hold_step - 1 ... 1, each evicting nodes of hold priority
    >= steps, then one pass over everything; within a pass, leaves in DFS order. As one priority:
    (-min(hold, hold_step - 1), DFS position), the DFS position being the path's creation times
    (children in insertion order; a split prefix keeps the slot and creation time of its node).
    Without `holding` (the fork's default, --enable-holding off) the order is DFS alone.

    Agents are keyed by name across workflows, as the fork's global agent id: the step of an agent
    is the smallest over the live workflows (SScheduler DefaultPolicy.integrate_agents), and the
    cache of a retired workflow keeps its agents (TreeNode.agents is never cleared)."""

    name = "kvflow"
    uses_predictions = True
    reads_step_graph = True

    def __init__(self, ledger: WorkflowLedger, hold_step: int = KvflowConfig.hold_step,
                 load_ahead_step: int = KvflowConfig.load_ahead_step, holding: bool = KvflowConfig.holding,
                 agent_key: str = KvflowConfig.agent_key):
        super().__init__(ledger)
        self.hold_step, self.load_ahead_step, self.holding = hold_step, load_ahead_step, holding
        self.per_workflow = agent_key == "workflow"
        self.node_agents: dict[int, dict[str, None]] = {}
        self.agent_nodes: dict[str, dict[int, Any]] = {}  # node_agents inverted: agent -> node id -> node
        self.moved: dict[int, Any] = {}  # nodes split above since the last re-tiering: their DFS positions grew
        self.last_nodes: dict[str, dict[int, Any]] = {}  # agent -> node id -> node
        self.workflow_steps: dict[str, dict[str, int]] = {}  # workflow -> agent -> fork step
        self.agent_step: dict[str, int] = {}
        self.step_agents: dict[int, list[str]] = {}
        self.held: dict[int, int] = {}
        self.pending: dict[int, tuple[Any, int]] = {}  # node id -> (node, step): the round left to load

    # ---------------------------------------------------------------- the fork's order

    def hold(self, node) -> int:
        held = self.held.get(node.id)
        if held is not None:
            return held
        agents = self.node_agents.get(node.id)
        if not agents:
            return self.hold_step + 2
        return min(min(self.agent_step.get(a, self.hold_step + 1), self.hold_step + 1) for a in agents)

    @staticmethod
    def dfs_position(node) -> tuple:
        path = []
        while node.parent is not None:
            path.append(node.creation_time)
            node = node.parent
        return tuple(reversed(path))

    def priority(self, node):
        if not self.holding:
            return (self.dfs_position(node),)
        return (-min(self.hold(node), self.hold_step - 1), self.dfs_position(node))

    def on_evict(self, node):
        # HiRadixCache._evict_backuped / _evict_regular: the parent inherits the larger hold priority
        parent = getattr(node, "parent", None)
        if parent is not None and parent.parent is not None:
            self.held[parent.id] = max(self.hold(parent), self.hold(node))

    # ---------------------------------------------------------------- what the fork records

    def agent_id(self, workflow: str, agent: str) -> str:
        """The fork's req.agent_id: the agent's name (agent_key=role), or one id per workflow's agent."""
        return f"{workflow}\x1f{agent}" if self.per_workflow else agent

    def on_cached(self, node, workflow: str, agent: str, finished: bool) -> None:
        """A request's path ended at `node`: at its match (scheduler.py: the agent's last nodes) and
        when its KV is cached (_update_leaf_node_priority: the node's agents too)."""
        if node is None or node.parent is None:
            return
        agent = self.agent_id(workflow, agent)
        self._update_last_nodes(agent, node)
        if finished and agent not in self.node_agents.setdefault(node.id, {}):
            self.node_agents[node.id][agent] = None
            self.agent_nodes.setdefault(agent, {})[node.id] = node
            self.held.pop(node.id, None)  # hold_priority_version = -1: computed afresh

    def _update_last_nodes(self, agent: str, last) -> None:
        """RadixCache._update_agent_to_last_nodes: drop the nearest ancestor of `last` in the set;
        add `last` unless it is an ancestor of a node already there."""
        current = self.last_nodes.setdefault(agent, {})
        n = last.parent
        while n is not None and n.parent is not None:
            if n.id in current:
                del current[n.id]
                break
            n = n.parent
        for other in current.values():
            m = other
            while m is not None and m.parent is not None:
                if m is last:
                    return
                m = m.parent
        current[last.id] = last

    def on_split(self, prefix, suffix) -> None:
        if suffix.id in self.node_agents:  # _split_node: new_node.agents = deepcopy(child.agents)
            self.node_agents[prefix.id] = dict(self.node_agents[suffix.id])
            for agent in self.node_agents[prefix.id]:
                self.agent_nodes[agent][prefix.id] = prefix
        self.moved[suffix.id] = suffix

    def forget(self, node) -> None:
        for agent in self.node_agents.pop(node.id, ()):
            self.agent_nodes[agent].pop(node.id, None)
        self.moved.pop(node.id, None)
        self.held.pop(node.id, None)
        self.pending.pop(node.id, None)
        for nodes in self.last_nodes.values():
            nodes.pop(node.id, None)

    def forget_all(self) -> None:
        self.node_agents, self.agent_nodes, self.last_nodes, self.held, self.pending = {}, {}, {}, {}, {}
        self.moved = {}

    def on_steps(self, workflows: Iterable[str], steps: Iterable[dict[str, int]] | None) -> list[int]:
        """A step update (the fork's /v1/update, merged over workflows by the smallest step): our
        steps-to-execution k >= 1 is the fork's step k - 1. When it changes the order (new steps, or
        holds to drop) returns the nodes whose priority is to be computed again now: those held
        since the last update (a new version drops every hold), those of the agents whose step moved
        within the tiers (a node's tier is the smallest of its agents' steps capped at hold_step -
        1, so a move among the steps at or past the cap changes no tier), and every node below a
        split since then (its DFS position grew by the prefix's creation time). That is every node
        whose priority differs from the one the heaps hold, as a rebuild of the whole tree would
        find."""
        if steps is None:
            return []
        for w, given in zip(workflows, steps):
            self.workflow_steps[w] = {self.agent_id(w, a): k - 1 for a, k in given.items()}
        merged: dict[str, int] = {}
        for w in list(self.workflow_steps):
            if not self.ledger.is_live(w):
                del self.workflow_steps[w]
                continue
            for a, k in self.workflow_steps[w].items():
                merged[a] = min(merged.get(a, k), k)
        before, held = self.agent_step, self.held
        changed = merged != before or bool(held)
        self.agent_step, self.held = merged, {}  # a new version: cached hold priorities are stale
        self.step_agents = {}
        for a, k in merged.items():
            self.step_agents.setdefault(k, []).append(a)
        self.pending = self._dispatch()
        if not changed:
            return []
        nodes: dict[int, Any] = {}
        if self.holding:  # else DFS order alone: no step changes it
            cap, missing = self.hold_step - 1, self.hold_step + 1
            nodes.update(dict.fromkeys(held))
            for a in {**before, **merged}:
                if min(before.get(a, missing), cap) != min(merged.get(a, missing), cap):
                    nodes.update(self.agent_nodes.get(a, {}))
        moved, self.moved = self.moved, {}
        for top in moved.values():
            stack = [top]
            while stack:
                node = stack.pop()
                nodes[node.id] = node
                stack.extend(node.children.values())
        return list(nodes)

    # ---------------------------------------------------------------- its prefetch

    def _dispatch(self) -> dict[int, tuple[Any, int]]:
        """DispatchLoadTasks, run at each step update: for steps 0 .. load_ahead_step in order, each
        agent's last nodes that are off the GPU, with the step (their hold priority once loaded is
        step + 1). One round per update: loaded in the next decode-only and idle time."""
        out: dict[int, tuple[Any, int]] = {}
        for step in range(self.load_ahead_step + 1):
            for agent in self.step_agents.get(step, ()):
                for node in self.last_nodes.get(agent, {}).values():
                    if not on_gpu(node):
                        out.setdefault(node.id, (node, step))
        return out

    def prefetch_order(self, by_id: dict[int, Any], idle_workflows: Iterable[str]) -> list[tuple[Any, int]]:
        """What is left of the latest update's round (a node since deleted or loaded is dropped)."""
        for node_id in [i for i, (node, _) in self.pending.items() if by_id.get(i) is not node or on_gpu(node)]:
            del self.pending[node_id]
        return list(self.pending.values())

    def on_prefetched(self, path: list, step) -> None:
        """load_back(priority=step + 1): the topmost loaded node holds step + 1 until the next update."""
        if step is not None and path:
            self.held[path[0].id] = step + 1
        for node in path:
            self.pending.pop(node.id, None)

    def on_prefetch_failed(self) -> None:
        """A load that did not fit ends the round (DispatchLoadTasks' to_break)."""
        self.pending = {}


# -------------------------------------------------------------------- LRU with plain prefetch


class LRUPrefetch(_LedgerPolicy):
    """LRU eviction; prefetch (Prefetch's policy-driven mode `last_call`, within the conservative
    mode's rules: free space and retired cache, decode-only and idle time) of each waiting
    workflow's own last nodes: per agent of the workflow, the deepest node that agent's last call
    cached (prompt and output). The workflow that has waited longest goes first (its next call is
    the most overdue), its agents by how recently each ran. No predictor: whichever agent comes
    next, its context is among them."""

    name = "lru_prefetch"

    def __init__(self, ledger: WorkflowLedger):
        super().__init__(ledger)
        self.last_nodes: dict[str, dict[str, Any]] = {}  # workflow -> agent -> its last call's last node
        self.last_of: dict[int, dict[tuple[str, str], None]] = {}  # node id -> the (workflow, agent) it is last of
        self.finished_at: dict[str, int] = {}  # workflow -> order of its last finished call
        self._calls = 0

    def priority(self, node):
        return (node.last_access_time,)

    def on_cached(self, node, workflow: str, agent: str, finished: bool) -> None:
        if finished and node is not None and node.parent is not None:
            agents = self.last_nodes.setdefault(workflow, {})
            before = agents.pop(agent, None)  # re-inserted last: the most recent agent
            if before is not None:
                self._unlink(before.id, (workflow, agent))
            agents[agent] = node
            self.last_of.setdefault(node.id, {})[(workflow, agent)] = None
            self._calls += 1
            self.finished_at[workflow] = self._calls

    def _unlink(self, node_id: int, holder: tuple[str, str]) -> None:
        holders = self.last_of.get(node_id)
        if holders is not None:
            holders.pop(holder, None)
            if not holders:
                del self.last_of[node_id]

    def forget(self, node) -> None:
        for workflow, agent in self.last_of.pop(node.id, ()):
            del self.last_nodes[workflow][agent]

    def forget_all(self) -> None:
        self.last_nodes = {w: {} for w in self.last_nodes}
        self.last_of = {}

    def prefetch_order(self, by_id: dict, idle_workflows: Iterable[str]) -> list[tuple[Any, None]]:
        waiting = sorted((w for w in idle_workflows if w in self.last_nodes and self.ledger.is_live(w)),
                         key=self.finished_at.__getitem__)
        order: list[tuple[Any, None]] = []
        for w in waiting:  # the newest node first (list.reverse: mypyc 2.4 fails on reversed() of an Any list)
            nodes = list(self.last_nodes[w].values())
            nodes.reverse()
            for node in nodes:
                if not on_gpu(node):
                    order.append((node, None))
        return order


# -------------------------------------------------------------------- Continuum


class Continuum(_LedgerPolicy):
    """Continuum's tool-call TTL pin (Li et al., arXiv 2511.02230), on LRU.

    When a program's call finishes and a tool call follows, the nodes the program used are pinned
    for a TTL: pinned nodes are evicted only after every unpinned one (a bias, not a lock: the
    simulator's memory can never be wedged). The pin is released when the program's next call
    arrives (the request then locks what it reads), when the TTL expires, or when the program ends.

    The TTL (paper, section 4: expected benefit over the empirical CDF F of the tool-call times
    seen so far, per agent whose call precedes the tool call, else over all):

        TTL = argmax over t in {0} u {observed times} of
              F(t) x reload_s  -  hold_cost x share x E[min(T, t)]

    reload_s: the prefill time of the program's context (the cost model's), share: its tokens
    over the GPU's, hold_cost: seconds of other programs' delay per GPU-share-second held.
    `ttl_estimator="mean"` is its public code's simplification (the mean tool time seen,
    docs/baselines/continuum.md), pinning only where that beats the hold cost."""

    name = "continuum"

    def __init__(self, ledger: WorkflowLedger, hold_cost: float = ContinuumConfig.hold_cost,
                 max_ttl_s: float = ContinuumConfig.max_ttl_s, ttl_estimator: str = ContinuumConfig.ttl_estimator):
        super().__init__(ledger)
        self.hold_cost, self.max_ttl_s, self.ttl_estimator = hold_cost, max_ttl_s, ttl_estimator
        self.gpu_tokens, self.prefill_s = 1, (lambda new, cached: 0.0)
        self.now = 0.0
        self.pins: dict[str, tuple[float, dict[int, None]]] = {}  # workflow -> (expiry, node ids)
        self.pinned: dict[int, int] = {}  # node id -> pins holding it
        self.tool_times: dict[str, list[float]] = {}  # agent before the tool call -> its times seen
        self.all_tool_times: list[float] = []
        # the same times sorted (the CDF's), kept as each comes: a TTL reads them at every finished call
        self.sorted_times: dict[str, np.ndarray] = {}
        self.all_sorted_times = np.empty(0)
        self.waiting: dict[str, tuple[float, str]] = {}  # workflow -> (its call finished at, agent)
        self.released: list[int] = []  # nodes whose pin was released since the last on_time

    def attach(self, gpu_tokens: int, prefill_s) -> None:
        self.gpu_tokens, self.prefill_s = max(gpu_tokens, 1), prefill_s

    # ---------------------------------------------------------------- the cost model

    def ttl(self, agent: str, context_tokens: int) -> float:
        """The pin's length for a program of `context_tokens` whose call of `agent` just finished."""
        times = self.tool_times.get(agent) or self.all_tool_times
        if not times or context_tokens <= 0:
            return 0.0
        reload_s = self.prefill_s(context_tokens, 0)
        hold = self.hold_cost * min(context_tokens / self.gpu_tokens, 1.0)
        if self.ttl_estimator == "mean":
            t = sum(times) / len(times)
            return min(t, self.max_ttl_s) if reload_s > hold * t else 0.0
        ts = self.sorted_times[agent] if agent in self.tool_times else self.all_sorted_times
        n = len(ts)
        below = np.cumsum(ts)  # E[min(T, t_i)] = (sum of times <= t_i + t_i x the count above) / n
        i = np.arange(n)
        gain = (i + 1) / n * reload_s - hold * ((below + ts * (n - i - 1)) / n)
        best = int(np.argmax(gain))  # the first of the largest
        return min(float(ts[best]), self.max_ttl_s) if gain[best] > 0.0 else 0.0

    def record_tool_time(self, agent: str, seconds: float) -> None:
        """A tool call that followed a call of `agent` took `seconds`."""
        self.tool_times.setdefault(agent, []).append(seconds)
        self.all_tool_times.append(seconds)
        ts = self.sorted_times.get(agent, self.all_sorted_times[:0])
        self.sorted_times[agent] = np.insert(ts, np.searchsorted(ts, seconds), seconds)
        self.all_sorted_times = np.insert(self.all_sorted_times, np.searchsorted(self.all_sorted_times, seconds),
                                          seconds)

    # ---------------------------------------------------------------- pins

    def is_pinned(self, node_id: int) -> bool:
        return node_id in self.pinned

    def priority(self, node):
        return (1 if node.id in self.pinned else 0, node.last_access_time)

    def on_call_finished(self, workflow, agent, node_ids, context_tokens, more_calls):
        changed = self._release(workflow)
        if not more_calls:
            return changed
        self.waiting[workflow] = (self.now, agent)
        ttl = self.ttl(agent, context_tokens)
        if ttl <= 0:
            return changed
        ids = dict.fromkeys(node_ids)
        self.pins[workflow] = (self.now + ttl, ids)
        for i in ids:
            self.pinned[i] = self.pinned.get(i, 0) + 1
        return changed + list(ids)

    def _release(self, workflow: str) -> list[int]:
        entry = self.pins.pop(workflow, None)
        if entry is None:
            return []
        for i in entry[1]:
            left = self.pinned.get(i, 0) - 1
            if left > 0:
                self.pinned[i] = left
            else:
                self.pinned.pop(i, None)
        return list(entry[1])

    def on_time(self, now: float) -> list[int]:
        """Time is `now`: pins whose TTL has passed are released, and so are those of programs the
        cache retired; the nodes whose priority changed."""
        self.now = now
        changed, self.released = self.released, []
        for w in [w for w, (expiry, _) in self.pins.items() if expiry <= now or not self.ledger.is_live(w)]:
            changed += self._release(w)
        return changed

    def observe_call(self, workflow, agent, keys=(), sizes=(), cached=None, gpu_cached=None):
        """The program's next call arrived: its tool time joins the TTL's distribution, and its pin is
        released (the request now locks what it reads; the caller refreshes those nodes)."""
        waited = self.waiting.pop(workflow, None)
        if waited is not None:
            since, before = waited
            self.record_tool_time(before, self.now - since)
        self.released += self._release(workflow)
        return False

    def forget(self, node) -> None:
        self.pinned.pop(node.id, None)


# -------------------------------------------------------------------- registration


BASELINES = (FIFO, MRU, FILO, SLRU, Priority, KVFlowFork, KVFlowNoLifecycle, LRUPrefetch, Continuum)
register(*BASELINES)

