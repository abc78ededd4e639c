"""The policies of policies.py as SGLang 0.5.23 eviction strategies, and the Python tree core
that keeps their bookkeeping right.

SGLang orders GPU->host demotion and host deletion with `EvictionStrategy.get_priority(node)`
(smaller first, a min-heap over evictable leaves; mem_cache/evict_policy.py). Each strategy here
has that one ordering method and hands it to the `WorkflowRuntime`, i.e. to the policy object of
policies.py that the simulator uses too. The strategy is built by SGLang from
`--radix-eviction-policy NAME --radix-eviction-policy-config '{json}'` (the json is the
strategy's keyword arguments, see `PluginConfig`).

PBKV's bookkeeping lives outside the tree nodes (a node split copies only the fields SGLang
knows), keyed by node id. `WorkflowTreeCore` is SGLang's Python tree core (`UnifiedTreeCore`)
plus three notifications: a split (the new prefix node inherits the old node's users), a node
deletion (forget it) and a device eviction (KVFlow's parents inherit); and, with the plugin's
`partial_eviction`, the victim's tail only: its eviction walk splits each victim so that the
suffix it evicts holds the pages still needed, the prefix staying in the victim's place in the
order. The compiled Rust core accepts only built-in policy names, so the plugin selects this core
whenever one of these policies is chosen (plugin.py).
"""

from __future__ import annotations

import logging
from typing import ClassVar

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

from serving_integration.server.runtime import WorkflowRuntime

log = logging.getLogger(__name__)

TREE_CORE_BACKEND = "pbkv_python"  # name under SGLang's register_tree_core_backend


class WorkflowEvictionStrategy(EvictionStrategy):
    policy_name: ClassVar[str]

    def __init__(self, **config):
        self.runtime = WorkflowRuntime.from_config(self.policy_name, **config)

    def get_priority(self, node):
        return self.runtime.priority(node)


class PBKVStrategy(WorkflowEvictionStrategy):
    """Retired cache first, then active cache by ascending lookahead reuse score, LRU ties."""

    policy_name = "pbkv"


class PBKVTimeStrategy(WorkflowEvictionStrategy):
    """PBKV's score with each read discounted by when it is expected; the waiting calls known."""

    policy_name = "pbkv_time"


class LifecycleLRUStrategy(WorkflowEvictionStrategy):
    """Retired cache first, then LRU (PBKV without predictions)."""

    policy_name = "pbkv_lae"


class KVFlowStrategy(WorkflowEvictionStrategy):
    """Idealised KVFlow: larger steps-to-execution first, from a static agent step graph."""

    policy_name = "kvflow_ideal"


class KVFlowNoLifecycleStrategy(WorkflowEvictionStrategy):
    """Idealised KVFlow without the lifecycle signal (retired cache held like an unknown agent's)."""

    policy_name = "kvflow_nolae"


class KVFlowForkStrategy(WorkflowEvictionStrategy):
    """KVFlow as its public code runs it: tiered passes over hold priorities, DFS order within a tier
    (its prefetch of each due agent's last nodes: prefetch.py, mode kvflow)."""

    policy_name = "kvflow"


class ContinuumStrategy(WorkflowEvictionStrategy):
    """Continuum's tool-call TTL pin: a program's cache pinned through its tool call, then LRU."""

    policy_name = "continuum"


class LRUPrefetchStrategy(WorkflowEvictionStrategy):
    """LRU, with prefetch of each waiting workflow's own last nodes (prefetch.py, mode last_call)."""

    policy_name = "lru_prefetch"


STRATEGIES: dict[str, type[WorkflowEvictionStrategy]] = {
    cls.policy_name: cls for cls in (PBKVStrategy, PBKVTimeStrategy, LifecycleLRUStrategy, KVFlowForkStrategy,
                                     KVFlowStrategy, KVFlowNoLifecycleStrategy, ContinuumStrategy, LRUPrefetchStrategy)
}


def runtime_of(cache) -> WorkflowRuntime | None:
    """The runtime of a radix cache (or tree core) using one of these policies, else None."""
    tree_core = getattr(cache, "tree_core", cache)
    strategy = getattr(tree_core, "eviction_strategy", None)
    return strategy.runtime if isinstance(strategy, WorkflowEvictionStrategy) else None


class WorkflowTreeCore(UnifiedTreeCore):
    """SGLang's Python tree core, telling the runtime about splits, deletions and evictions, and
    evicting a victim's tail only where the plugin's `partial_eviction` asks.

    Partial eviction needs the tokens still needed when the walk picks a victim. A count-driven
    walk (`evict(EvictParams(num_tokens=n))`, cumulative reclaim quotas) has them: its quota less
    the tokens evicted so far. An allocation-driven one (`evict_for_alloc`: SGLang's allocator asks
    for a shortfall) runs with a quota of everything evictable and stops once the allocator's
    available size reaches its target, so the cache tells the core that target's shortfall for
    the walk (`shortfall`, set by the plugin's hook around `UnifiedRadixCache._evict_components`)."""

    shortfall = None  # during an allocation-driven walk: () -> FULL tokens still needed
    _walk_quota = 0  # the running walk's quota (evict_device_start)
    _walk_asked = False  # whether the running walk's tokens asked for are counted

    @property
    def runtime(self) -> WorkflowRuntime | None:
        return runtime_of(self)

    def node_of(self, node_id):
        """The node of an id, or None when it left the tree."""
        return self._node_arena.get(node_id)

    def path_node_ids(self, node_id) -> list[int]:
        """Ids of the nodes from `node_id` up to (not including) the root."""
        ids, node = [], self._node_arena.get(node_id)
        while node is not None and node is not self.root_node:
            ids.append(node.id)
            node = node.parent
        return ids

    def _split_node(self, key, child, split_len):
        new_node, action = super()._split_node(key, child, split_len)
        if self.runtime is not None:  # the new node is the prefix; child keeps its id as the suffix
            self.runtime.on_split(new_node, child)
        return new_node, action

    def _unregister_node(self, node):
        super()._unregister_node(node)
        if self.runtime is not None:
            self.runtime.on_delete(node)

    def evict_device_start(self, component_type, request_cnt):
        self._walk_quota, self._walk_asked = request_cnt, False
        super().evict_device_start(component_type, request_cnt)

    def evict_device_next_node(self, component_type, tracker):
        """The walk's next victim: split where `partial_eviction` asks, and, unless a prefetch load
        makes the room, counted as the simulator counts an admission's evictions: the tokens the
        walk was asked to free (`eviction_requested_tokens`, once per walk) and the tokens each
        victim frees (`evicted_gpu_tokens`)."""
        result = super().evict_device_next_node(component_type, tracker)
        runtime = self.runtime
        if result.node_id is None or component_type != ComponentType.FULL or runtime is None:
            return result
        counted = not runtime.prefetching
        if not counted and not runtime.config.partial_eviction:
            return result  # a prefetch load's room, taken whole: nothing to count or split
        try:
            need = self.shortfall() if self.shortfall is not None else \
                self._walk_quota - tracker.get(component_type, 0)
            if counted and not self._walk_asked:
                self._walk_asked = True
                runtime.stats.count("eviction_requested_tokens", max(need, 0))
            if runtime.config.partial_eviction:
                self._keep_prefix(self._node_arena[result.node_id], need, result.cache_actions, runtime)
            if counted:
                runtime.stats.count("evicted_gpu_tokens", len(self._node_arena[result.node_id].key))
        except Exception:  # noqa: BLE001  (never into SGLang: the victim goes whole)
            runtime.stats.count("hook_errors")
            log.exception("PBKV: splitting or counting an eviction victim failed; it is evicted whole")
        return result

    def _keep_prefix(self, victim, need: int, cache_actions: list, runtime) -> None:
        """Split `victim` so that it keeps only its tail of the fewest whole pages holding `need`
        tokens; the new prefix node stays, with the victim's access time (its place in the order),
        and the walk evicts the tail (the victim's id). A victim that is all needed stays whole."""
        page = self.page_size
        tail = -(-need // page) * page
        keep = len(victim.key) - tail
        if need <= 0 or keep <= 0:
            return
        last_access = victim.last_access_time
        prefix, action = self._split_node(victim.key, victim, keep)
        prefix.last_access_time = last_access
        if action is not None:
            cache_actions.append(action)
        runtime.stats.count("partial_evictions")
        runtime.stats.count("partial_eviction_kept_tokens", keep)

    def evict_device_leaf(self, node_id, is_write_back):
        node = self._node_arena.get(node_id)
        result = super().evict_device_leaf(node_id, is_write_back)
        if node is not None and result.backup_kv is None and self.runtime is not None:
            self.runtime.on_device_evict(node)  # a write-back leaf leaves the GPU in demote() instead
        return result

    def demote(self, node_id):
        node = self._node_arena.get(node_id)
        result = super().demote(node_id)
        if node is not None and self.runtime is not None:
            self.runtime.on_device_evict(node)
        return result

    def reset(self):
        super().reset()
        if getattr(self, "eviction_strategy", None) is not None and self.runtime is not None:
            self.runtime.forget_all_nodes()


def workflow_tree_core_factory(params, components) -> WorkflowTreeCore:
    """SGLang's TreeCoreFactory signature (tree_core_registry.register_tree_core_backend)."""
    return WorkflowTreeCore(params, components)
