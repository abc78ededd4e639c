"""The PBKV plugin for stock SGLang 0.5.23, loaded through the `sglang.srt.plugins` entry point
(pyproject.toml). SGLang calls `register()` in the launcher and again in every scheduler process
(`sglang.srt.plugins.load_plugins`), then applies the hooks registered here.

What it registers:
  * on a machine without CUDA, compat.apply_cpu_hicache_fixes (HiCache's host pool on a CPU);
  * the eviction policies `pbkv`, `pbkv_time`, `pbkv_lae`, `kvflow`, `kvflow_ideal`, `kvflow_nolae`, `continuum`,
    `lru_prefetch` (strategies.py, wrapping cache/policies.py and cache/baselines.py): into
    `mem_cache.utils._EVICTION_POLICY_FACTORIES` and the
    `--radix-eviction-policy` choices, with SGLang's own strategies its CLI leaves out (fifo, mru,
    filo), so that the launcher passes each of SGLang's policies by its own flag;
  * the tree core `pbkv_python` (SGLang's Python core + split/delete/evict notifications), and a
    hook on `select_tree_core_backend` that picks it whenever one of these policies is selected
    (the compiled Rust core accepts only built-in policy names);
  * hooks (HookRegistry, AFTER) that feed the runtime:
      UnifiedRadixCache.checkpoint_into_tree   the request's path is in the tree: record accesses
      UnifiedRadixCache.on_release             a call finished: queue its workflow's prediction,
                                               or retire the workflow on its last call
      Scheduler.get_next_batch_to_run          once per scheduler step: the batched predictor
                                               round, retirement of silent workflows, prefetch
                                               (prefetch.py: PBKV's ranking, or kvflow's and
                                               lru_prefetch's own order)
      Scheduler.get_internal_state             the plugin's counters under "pbkv" in /server_info
      Scheduler._add_request_to_queue          pbkv_time: the waiting call's cached path; with
                                               `hidden_state`: a tagged request asks SGLang's
                                               forward for its last prefill token's hidden state
                                               (Req.return_hidden_states = "last", as a client could)
  * AROUND UnifiedRadixCache._evict_components: an allocation-driven walk's shortfall (the
    allocator's target less its available size, read after every victim) reaches the tree core,
    which counts it as asked for and, with `partial_eviction`, evicts only the tail of a victim
    that holds more than it;
  * AROUND SchedulerBatchResultProcessor._append_prefill_hidden_states: SGLang has copied that
    hidden state to the host; the runtime takes it (timed), the request's flag is cleared again (no
    capture during its decode, nothing in its response unless its tag asks: meta_info.pbkv_hidden)

Every hook is a no-op for caches using other policies, and none can raise into SGLang: an
exception inside a hook is logged and counted (`hook_errors`), and the original call's result
stands.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter

from serving_integration.cache.policies import PLUGIN_POLICIES
from serving_integration.cache.workflow_tags import HIDDEN_RESPONSE_KEY

log = logging.getLogger(__name__)

HOOK_ERRORS: Counter = Counter()  # failures per hook in this process (also counted on the runtime, if any)

_CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_TREE_CORE_SELECTION = "sglang.srt.mem_cache.unified_cache.tree_core_registry.select_tree_core_backend"
_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"

_registered = False


def register() -> None:
    """The entry point. Idempotent: SGLang may call it more than once per process."""
    global _registered
    from serving_integration.server.compat import apply_cpu_hicache_fixes, install_torchvision_guard

    install_torchvision_guard()  # a no-op where torchvision loads (a full GPU install)
    apply_cpu_hicache_fixes()  # a no-op where CUDA is available
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES, add_radix_eviction_policy_choices
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (register_tree_core_backend,
                                                                        registered_tree_core_backends)
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from serving_integration.server.strategies import STRATEGIES, TREE_CORE_BACKEND, workflow_tree_core_factory

    for name, strategy in STRATEGIES.items():
        _EVICTION_POLICY_FACTORIES.setdefault(name, strategy)
    add_radix_eviction_policy_choices([n for n in (*STRATEGIES, *_EVICTION_POLICY_FACTORIES)
                                       if n not in RADIX_EVICTION_POLICY_CHOICES])
    if TREE_CORE_BACKEND not in registered_tree_core_backends():
        register_tree_core_backend(TREE_CORE_BACKEND, workflow_tree_core_factory)
    if _registered:
        return
    _registered = True
    HookRegistry.register(_TREE_CORE_SELECTION, select_workflow_tree_core, HookType.AROUND)
    HookRegistry.register(f"{_CACHE}.checkpoint_into_tree", after_checkpoint, HookType.AFTER)
    HookRegistry.register(f"{_CACHE}.on_release", after_release, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.get_next_batch_to_run", after_next_batch, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.get_internal_state", after_internal_state, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}._add_request_to_queue", after_request_queued, HookType.AFTER)
    HookRegistry.register(f"{_RESULTS}._append_prefill_hidden_states", around_prefill_hidden, HookType.AROUND)
    HookRegistry.register(f"{_CACHE}._evict_components", around_evict_components, HookType.AROUND)


# -------------------------------------------------------------------- hooks


def select_workflow_tree_core(original, params):
    """AROUND select_tree_core_backend: our policies need the Python core with notifications."""
    name = original(params)
    if (getattr(params, "eviction_policy", None) or "").lower() in PLUGIN_POLICIES:
        from serving_integration.server.strategies import TREE_CORE_BACKEND

        if name != TREE_CORE_BACKEND:
            log.info("PBKV: policy %s uses the Python tree core %s (was %s)", params.eviction_policy,
                     TREE_CORE_BACKEND, name)
        return TREE_CORE_BACKEND
    return name


def _never_raises(hook):
    """An AFTER hook that keeps the original result and swallows (and counts) its own errors."""

    @functools.wraps(hook)
    def guarded(result, owner, *args, **kwargs):
        try:
            hook(result, owner, *args, **kwargs)
        except Exception:  # noqa: BLE001  (the plugin must never take the server down)
            HOOK_ERRORS[hook.__name__] += 1
            runtime = _runtime(owner)
            if runtime is not None:
                runtime.stats.count("hook_errors")
            if HOOK_ERRORS[hook.__name__] in (1, 10, 100) or HOOK_ERRORS[hook.__name__] % 1000 == 0:
                log.exception("PBKV: hook %s failed (%d times); the server continues",
                              hook.__name__, HOOK_ERRORS[hook.__name__])
        return None  # None: HookRegistry keeps the original result

    return guarded


def _runtime(owner):
    from serving_integration.server.strategies import runtime_of

    cache = getattr(owner, "tree_cache", owner)  # a Scheduler holds the cache as tree_cache
    return runtime_of(cache) if cache is not None else None


@_never_raises
def after_checkpoint(result, cache, req, *args, **kwargs):
    runtime = _runtime(cache)
    if runtime is not None and getattr(req, "last_node", None) is not None:
        runtime.attach(cache)
        runtime.on_cached(req, cache.tree_core.path_node_ids(req.last_node), cache.tree_core.node_of(req.last_node))


@_never_raises
def after_release(result, cache, req, *args, **kwargs):
    runtime = _runtime(cache)
    if runtime is not None and req.finished():
        runtime.attach(cache)
        runtime.on_finished(req)


@_never_raises
def after_next_batch(plan, scheduler, *args, **kwargs):
    runtime = _runtime(scheduler)
    if runtime is None:
        return
    runtime.attach_cache(scheduler.tree_cache)
    runtime.on_scheduler_step()
    prefetcher = _prefetcher(runtime, scheduler.tree_cache)
    if prefetcher is not None:
        prefetcher.on_scheduler_step(plan.batch_to_run)


@_never_raises
def after_internal_state(output, scheduler, *args, **kwargs):
    runtime = _runtime(scheduler)
    state = getattr(output, "internal_state", None)
    if runtime is not None and isinstance(state, dict):
        state["pbkv"] = runtime.snapshot()
        config = getattr(scheduler, "model_config", None)  # what collected traces record of the model
        state["pbkv"]["model"] = {"path": getattr(getattr(scheduler, "server_args", None), "model_path", None),
                                  "hidden_size": getattr(config, "hidden_size", None)}


def around_evict_components(original, cache, *args, **kwargs):
    """An eviction walk: where SGLang's allocator drives the walk toward an available-size target
    (evict_for_alloc), the tree core reads the target's shortfall while the walk runs
    (strategies.WorkflowTreeCore.shortfall): the tokens still needed, which partial eviction splits
    a victim to and the eviction counters count as asked for."""
    core = None
    try:
        runtime = _runtime(cache)
        targets = kwargs.get("available_size_targets", args[2] if len(args) > 2 else None)
        if runtime is not None and targets:
            from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

            target = targets.get(ComponentType.FULL)
            if target is not None:
                component, size = target
                core = cache.tree_core
                core.shortfall = lambda: size - cache._component_available_size(component)
    except Exception:  # noqa: BLE001  (the walk runs as SGLang's, whole nodes)
        HOOK_ERRORS["around_evict_components"] += 1
        core = None
        if HOOK_ERRORS["around_evict_components"] in (1, 10, 100):
            log.exception("PBKV: reading the eviction target failed; this walk evicts whole nodes")
    try:
        return original(cache, *args, **kwargs)
    finally:
        if core is not None:
            core.shortfall = None


# -------------------------------------------------------------------- hidden states

_ASKED = "_pbkv_asked_hidden"  # set on a Req whose hidden-state flag the plugin turned on


@_never_raises
def after_request_queued(result, scheduler, req, *args, **kwargs):
    """A request entered the waiting queue (also again after a retraction): pbkv_time hears of it
    (WorkflowRuntime.on_queued); with `hidden_state`, a tagged agent call asks
    for its last prefill token's hidden state, through the flag a client's `return_hidden_states:
    "last"` sets. A request whose client asked itself keeps its own flag (and its response)."""
    runtime = _runtime(scheduler)
    if runtime is None:
        return
    runtime.on_queued(req, scheduler.tree_cache.tree_core)
    if req.return_hidden_states or not runtime.wants_hidden(req):
        return
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    req.return_hidden_states, req.return_hidden_states_mode = "last", CaptureHiddenMode.LAST
    setattr(req, _ASKED, True)


def around_prefill_hidden(original, processor, *args, **kwargs):
    """SGLang stores one request's prefill hidden state (`req.hidden_states`, copied to the host with
    .cpu().tolist()); on the final chunk (`store`) the runtime takes it. The copy is timed here."""
    began = time.perf_counter()
    result = original(processor, *args, **kwargs)
    copy_s = time.perf_counter() - began
    try:
        req = kwargs.get("req")
        if req is not None and kwargs.get("store", True) and req.return_hidden_states:
            _take_hidden(_runtime(processor), req, copy_s)
    except Exception:  # noqa: BLE001  (SGLang's own result stands)
        HOOK_ERRORS["around_prefill_hidden"] += 1
        runtime = _runtime(processor)
        if runtime is not None:
            runtime.stats.count("hook_errors")
        if HOOK_ERRORS["around_prefill_hidden"] in (1, 10, 100):
            log.exception("PBKV: taking a hidden state failed; the server continues")
    return result


def _take_hidden(runtime, req, copy_s: float) -> None:
    asked = getattr(req, _ASKED, False)
    if runtime is None or not (asked or runtime.wants_hidden(req)):
        return
    stored = req.hidden_states[-1] if req.hidden_states else None
    if stored and isinstance(stored[0], list):  # a client's return_hidden_states=True: every prompt token
        stored = stored[-1]
    if asked:  # the flag was ours: no capture in decode, nothing in the response
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        req.return_hidden_states, req.return_hidden_states_mode = False, CaptureHiddenMode.NULL
        req.hidden_states = []
        setattr(req, _ASKED, False)
    returned = runtime.on_hidden(req, stored, copy_s)
    if returned is not None:  # the tag asked for it: one entry, aligned with the first output token
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[HIDDEN_RESPONSE_KEY] = [returned]


def _prefetcher(runtime, cache):
    """The runtime's prefetcher, built on first use (it needs the cache's HiCache controller)."""
    if not runtime.prefetch.enabled or getattr(cache, "cache_controller", None) is None:
        return None
    prefetcher = getattr(runtime, "prefetcher", None)
    if prefetcher is None:
        from serving_integration.server.prefetch import HostPrefetcher

        prefetcher = runtime.prefetcher = HostPrefetcher(runtime, cache)
    return prefetcher
