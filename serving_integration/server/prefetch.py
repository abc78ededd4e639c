"""PBKV's prefetch inside the SGLang scheduler: host-to-GPU `load_back` of the cache that idle
live workflows are predicted to read on their next call.

It runs after the scheduler has chosen its next batch, and only when that batch is decode-only
(or the server is idle), so the copy overlaps a decode step and uses otherwise idle PCIe time.
Candidates are host-only nodes of live workflows with no request in flight, ranked by the
one-step (k = 1) score (`policies.Prefetch.rank`). The budget of one step is
min(room, PCIe bandwidth x decode step time / KV bytes per token), where the room is, in
conservative mode, the free GPU tokens plus retired evictable leaves (never active cache), and in
aggressive mode any unlocked cache. SGLang's `load_back` makes room in the eviction order, which
under these policies drains retired cache first, so a conservative load never displaces active
cache.

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
        candidates = self.candidates()
        if not candidates:
            return 0
        budget = min(self.room(), self.tokens_per_step)
        loaded_tokens, loaded_nodes = 0, []
        for node in self.runtime.prefetch.rank(candidates):
            path = self._evicted_path(node)
            need = sum(len(n.key) for n in path)
            if not path or need > budget - loaded_tokens:
                continue
            if self.cache.load_back(node.id):
                loaded_tokens += need
                loaded_nodes.extend(path)
        if loaded_nodes:
            self.pending_producer = self.cache.ready_to_load_host_cache()
            self.runtime.on_prefetched(loaded_nodes)
            self.runtime.stats.count("prefetch_rounds")
        return loaded_tokens

    def candidates(self) -> list:
        arena = self.tree._node_arena
        nodes = []
        for node_id in self.runtime.idle_workflow_nodes():
            node = arena.get(node_id)
            if node is not None and node.evicted and node.backuped and node.load_back_pending_id is None:
                nodes.append(node)
        return nodes

    def room(self) -> int:
        """GPU tokens a prefetch may fill: free space, plus what the mode lets it displace."""
        free = self.cache.token_to_kv_pool_allocator.available_size()
        if self.runtime.prefetch.mode == "aggressive":
            displaceable = self.cache.evictable_size()
        else:  # conservative: only retired leaves (an under-estimate of all retired cache: safe)
            displaceable = sum(len(n.key) for n in self.tree.evictable_device_leaves
                               if self.runtime.prefetch.may_evict(n)
                               and n.component_data[ComponentType.FULL].lock_ref == 0)
        return max(free - self.runtime.config.prefetch_reserve_tokens, 0) + displaceable

    def _evicted_path(self, node) -> list:
        """The host-only nodes from the deepest GPU ancestor down to `node` (what load_back copies)."""
        path = []
        while node is not None and node.evicted:
            path.append(node)
            node = node.parent
        return path[::-1]
