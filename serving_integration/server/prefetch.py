"""Prefetch inside the SGLang scheduler: host-to-GPU `load_back` of cache that idle live
workflows are expected to read on their next call, PBKV's or a baseline's own.

It runs after the scheduler has chosen its next batch, and only when that batch is decode-only
(or the server is idle), so the copy overlaps a decode step and uses otherwise idle PCIe time.
The candidates (`policies.Prefetch`, the simulator's modes):
  * conservative, aggressive (PBKV's, kvflow_ideal's): host-only nodes of live workflows with no
    request in flight, ranked by the one-step (k = 1) score (`Prefetch.rank`);
  * kvflow (kvflow's own, baselines.KVFlowFork): what is left of the latest step update's round,
    each due agent's last nodes for steps 0 .. load_ahead_step in step order; a load that does
    not fit ends the round, and the topmost loaded node holds step + 1 (`on_prefetched`);
  * last_call (lru_prefetch's, baselines.LRUPrefetch): each waiting workflow's own last nodes,
    the workflow that has waited longest first.
The budget of one step is min(room, PCIe bandwidth x decode step time / KV bytes per token). The
room is the free GPU tokens (less `prefetch_reserve_tokens`) plus what the mode may displace:
aggressive and kvflow any unlocked cache (SGLang's `load_back` makes room in the eviction order,
kvflow's tiers under kvflow); conservative and last_call the retired evictable leaves, and while
such a load runs the runtime orders SGLang's eviction as lifecycle-aware LRU (retired first), so a
load never displaces a live workflow's cache whatever the policy's own order (lru_prefetch's is LRU).

Safety: a copy started here is not tied to a batch, so a later prefill that matched the freshly
loaded nodes could read them before they land. The prefetcher therefore hands its load's layer
counter to the next prefill batch that has none of its own (`hicache_consumer_index`), exactly as
SGLang does for the loads of the batch itself; a batch with its own load waits on a later copy on
the same stream, which finishes after ours. A new prefetch starts only when no host-to-GPU copy
is in flight, so SGLang's three layer counters are never exhausted.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from serving_integration.server.runtime import WorkflowRuntime

log = logging.getLogger(__name__)


class HostPrefetcher:
    """Prefetch for one UnifiedRadixCache with HiCache, driven once per scheduler step."""

    def __init__(self, runtime: WorkflowRuntime, cache):
        self.runtime, self.cache = runtime, cache
        self.tree = cache.tree_core
        self.pending_producer = -1  # layer counter of our copy in flight
        config = runtime.config
        bytes_per_token = config.kv_bytes_per_token or self._host_bytes_per_token()
        step_bytes = config.pcie_gbps * 1e9 * config.decode_step_ms / 1e3
        self.tokens_per_step = int(step_bytes // bytes_per_token) if bytes_per_token else 0
        if not self.tokens_per_step:
            log.warning("PBKV prefetch is off: no KV bytes per token known (set kv_bytes_per_token)")

    def _host_bytes_per_token(self) -> int:
        controller = self.cache.cache_controller
        host_pool = getattr(controller, "mem_pool_host", None)
        return int(getattr(host_pool, "size_per_token", 0) or 0)

    # ---------------------------------------------------------------- per scheduler step

    def on_scheduler_step(self, batch) -> None:
        controller = self.cache.cache_controller
        if controller is None or not self.runtime.prefetch.enabled:
            return
        self._guard_prefill(controller, batch)
        if self._decode_only(batch) and self.pending_producer < 0 and not controller.ack_load_queue:
            self.prefetch_once()

    @staticmethod
    def _decode_only(batch) -> bool:
        return batch is None or batch.forward_mode.is_decode_or_idle()

    def _guard_prefill(self, controller, batch) -> None:
        if self.pending_producer < 0:
            return
        if controller.layer_done_counter.events[self.pending_producer].finish_event.query():
            self.pending_producer = -1
        elif batch is not None and batch.forward_mode.is_extend() and batch.hicache_consumer_index < 0:
            batch.hicache_consumer_index = self.pending_producer
            self.runtime.stats.count("prefills_waiting_on_prefetch")

    # ---------------------------------------------------------------- one prefetch round

    def prefetch_once(self) -> int:
        """Start the host-to-GPU copies of the best candidates; returns the tokens queued."""
        prefetch = self.runtime.prefetch
        room, bandwidth, loaded_tokens = self.room(), self.tokens_per_step, 0
        for node, tag in self.ranked():
            path = self._evicted_path(node) if self._loadable(node) else []
            need = sum(len(n.key) for n in path)
            if not path or need > bandwidth - loaded_tokens:  # waits for a later step's budget
                continue
            if need > room - loaded_tokens or not self._load_back(node):
                if prefetch.stops_at_failure:  # kvflow: a load that does not fit ends its round
                    self.runtime.policy.on_prefetch_failed()
                    break
                continue
            loaded_tokens += need
            self.runtime.on_prefetched(path, tag)
        if loaded_tokens:
            self.pending_producer = self.cache.ready_to_load_host_cache()
            self.runtime.stats.count("prefetch_rounds")
        return loaded_tokens

    def _load_back(self, node) -> bool:
        """SGLang's load_back of the node's host-only path. It evicts in the eviction order to make
        room; a mode that may displace only retired cache has counted only free space and retired
        leaves as its room, and has SGLang evict in lifecycle-aware order meanwhile, so that the
        room is taken from retired cache whatever the policy's own order (lru_prefetch's is LRU)."""
        runtime = self.runtime
        runtime.prefetching, runtime.making_room_for_prefetch = True, not runtime.prefetch.evicts_live
        try:
            return self.cache.load_back(node.id)
        finally:
            runtime.prefetching = runtime.making_room_for_prefetch = False

    def ranked(self) -> list[tuple]:
        """(node, tag) in load order: a baseline's own order, else PBKV's ranking of the candidates."""
        if self.runtime.prefetch.policy_driven:
            return self.runtime.policy.prefetch_order(self.tree._node_arena, self.runtime.idle_workflows())
        return [(node, None) for node in self.runtime.prefetch.rank(self.candidates())]

    @staticmethod
    def _loadable(node) -> bool:
        """Off the GPU with a host copy, and no load of it in flight."""
        return node.evicted and node.backuped and node.load_back_pending_id is None

    def candidates(self) -> list:
        arena = self.tree._node_arena
        nodes = []
        for node_id in self.runtime.idle_workflow_nodes():
            node = arena.get(node_id)
            if node is not None and self._loadable(node):
                nodes.append(node)
        return nodes

    def room(self) -> int:
        """GPU tokens a prefetch may fill: free space, plus what the mode lets it displace."""
        prefetch = self.runtime.prefetch
        free = max(self.cache.token_to_kv_pool_allocator.available_size() - self.runtime.config.prefetch_reserve_tokens,
                   0)
        if prefetch.evicts_live:  # aggressive, kvflow: any unlocked cache, in the eviction order
            return free + self.cache.evictable_size()
        # conservative, last_call: only retired leaves (an under-estimate of all retired cache: safe)
        return free + sum(len(n.key) for n in self.tree.evictable_device_leaves
                          if prefetch.may_evict(n) and n.component_data[ComponentType.FULL].lock_ref == 0)

    def _evicted_path(self, node) -> list:
        """The host-only nodes from the deepest GPU ancestor down to `node` (what load_back copies)."""
        path = []
        while node is not None and node.evicted:
            path.append(node)
            node = node.parent
        return path[::-1]
