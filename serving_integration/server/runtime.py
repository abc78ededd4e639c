"""What the PBKV plugin keeps inside one SGLang scheduler process, apart from SGLang itself.

`WorkflowRuntime` owns the `WorkflowLedger` and the eviction policy of policies.py (the same
objects the simulator uses), follows the live workflows from the metadata their requests carry,
batches the predictor over the calls that finished since the last scheduler step, and falls back
to lifecycle-aware LRU whenever a prediction cannot be trusted. Nothing here imports SGLang: the
SGLang side (strategies.py, plugin.py, prefetch.py) calls in with node ids and nodes.

Robustness: a predictor that raises (anything, SystemExit and KeyboardInterrupt included, unless
the scheduler process itself is stopping: see `SchedulerShutdown`), runs past its timeout or
returns a tensor that is not a distribution (wrong shape for the configured horizon and agents,
non-finite, outside [0, 1], rows not summing to 1) turns that round's decision into lifecycle-aware LRU (`LifecycleLRU`, retired cache first, then
LRU) until a later round succeeds; every such round is counted. Missing or malformed request
metadata is counted and the request is served as an anonymous one (its cache is unowned, hence
evicted like retired cache). A workflow that never sends its end signal is retired after
`workflow_ttl_s` without calls, and at most `max_live_workflows` are followed at once (the
longest-silent one is retired first), so clients cannot grow the ledger without bound.

Hidden states (`hidden_state`): the plugin (plugin.py) asks SGLang's own forward pass for each
tagged request's hidden state at its last prefill token (the per-request `return_hidden_states`
path), and hands it here: `on_hidden` projects it to the predictor's input size when the
checkpoint carries a projection and keeps it for the request's workflow, whose next prediction
uses it as `WorkflowPrefix.hidden`. A request whose capture failed is counted
(`hidden_capture_failed`, `hidden_missing`) and predicted without it, as training calls without a
hidden vector are (zeros); the server is never stopped by it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import queue
import signal
import sys
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from data.atomic import atomic_file
from data.errors import ConfigError
from data.knobs import above, at_least, knob, nonempty, one_of, shown
from serving_integration.cache.config import POLICY_PREFETCH_MODES, TRUST_MODES, ContinuumConfig, KvflowConfig, \
    OnlineBackoffConfig, PbkvConfig
from serving_integration.cache.policies import PLUGIN_POLICIES, STEP_GRAPH_POLICIES, LifecycleLRU, Prefetch, \
    WorkflowLedger, make_policy
from serving_integration.cache.predictions import PredictionSource, predict_times, tell_finished
from serving_integration.cache.workflow_tags import BadTag, WorkflowTag, tag_of_request

log = logging.getLogger(__name__)

DEFAULT_PREFETCH = {"pbkv": "conservative", "pbkv_time": "none", "pbkv_lae": "none", "kvflow_ideal": "aggressive",
                    "kvflow_nolae": "aggressive", "continuum": "none", "kvflow": "kvflow", "lru_prefetch": "last_call"}
MAX_REMEMBERED_REQUESTS = 65536  # tags of requests in flight; older entries are dropped first
RECENT_TAGS = 256  # the last tags the runtime acted on, reported by snapshot() (what reached the policy)
HIDDEN_COSTS = 4096  # per-request hidden-state costs kept for snapshot()'s summary


@dataclass(frozen=True)
class PluginConfig(PbkvConfig, KvflowConfig, ContinuumConfig, OnlineBackoffConfig):
    """`--radix-eviction-policy-config '{json}'` of the plugin's policies (policies.PLUGIN_POLICIES): the
    policies' own knobs (serving_integration/cache/config.py, the simulator reads the same classes;
    `horizon` is K of the KVFlows' step graph, a checkpoint brings its own) plus the server-only ones
    below. An unknown key fails at server start (TypeError naming it), as SGLang's own policies do;
    a value out of range fails there too (one line naming it)."""

    checkpoint: Optional[str] = knob(None, "train.py predictor.pt (pbkv, pbkv_time; optional for pbkv_lae prefetch)")
    step_graph_traces: Optional[str] = knob(None, "kvflow, kvflow_ideal, kvflow_nolae: dataset dir whose train "
                                           "split gives the step graph")
    prefetch: Optional[str] = knob(None, "none | conservative | aggressive, or a baseline's own: kvflow (kvflow's), "
                                   "last_call (lru_prefetch's); null: the policy's default (pbkv conservative, "
                                   "pbkv_lae none, kvflow_ideal aggressive, kvflow kvflow, lru_prefetch last_call)",
                                   one_of(Prefetch.MODES))
    predictor_device: str = knob("cpu", "torch device of the predictor", nonempty)
    predictor_timeout_s: Optional[float] = knob(0.05, "a prediction round slower than this falls back (null or 0: "
                                                "no timeout, needed for TP > 1, see docs/serving.md)", at_least(0))
    pcie_gbps: float = knob(25.0, "host-to-GPU bandwidth the prefetch budget assumes", above(0))
    decode_step_ms: float = knob(20.0, "decode step time the prefetch budget assumes", above(0))
    kv_bytes_per_token: Optional[int] = knob(None, "KV bytes per token (null: read from the host pool)", at_least(1))
    prefetch_reserve_tokens: int = knob(256, "free GPU tokens prefetch always leaves to decode", at_least(0))
    workflow_ttl_s: float = knob(3600.0, "retire a workflow silent this long (a lost end signal); 0: never",
                                 at_least(0))
    max_live_workflows: int = knob(10000, "ledger bound: past it the longest-silent workflow with no request in "
                                   "flight is retired (counted, logged)", at_least(1))
    hidden_state: bool = knob(False, "capture each tagged request's hidden state at its last prefill token from "
                                     "SGLang's forward pass (the launcher adds --enable-return-hidden-states "
                                     "--return-hidden-states-mode last) for the predictor and for clients whose "
                                     "tag asks for it (return_hidden)")
    hidden_layer: Optional[int] = knob(None, "null: the final layer (after the last norm: what the LM head reads); "
                                             "L: the output of decoder layer L, 0 <= L < layers - 1 (SGLang's aux "
                                             "hidden-state capture, whose flags the launcher adds)", at_least(0))
    stats_path: Optional[str] = knob(None, "JSON file the counters are written to")
    stats_interval_s: float = knob(10.0, "seconds between writes of stats_path", at_least(0))
    prefill_tokens_per_s: float = knob(10000.0, "continuum: prefill speed its TTL's reload cost assumes", above(0))
    partial_eviction: bool = knob(False, "evict only the tail of a victim node, the fewest whole pages that free the "
                                  "tokens still needed (the rest stays, in the victim's place in the order), not "
                                  "the whole node as SGLang 0.5.23 does (the simulator's sim.partial_eviction, "
                                  "whose unit is a prompt unit)")
    shadow_block_tokens: int = knob(256, "pbkv trust=outcome: the shadow caches name a prompt's content in blocks "
                                    "of this many tokens (chained hashes of the token ids)", at_least(1))

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.trust, str):
            raise ConfigError(f"trust={shown(self.trust)}: the plugin runs one mode ({', '.join(TRUST_MODES)})")
        if self.hidden_layer is not None and not self.hidden_state:
            raise ConfigError(f"hidden_layer={self.hidden_layer}: needs hidden_state=true")


class PluginStats:
    """Named counters, readable as one flat dict (server_info, the stats file, the logs)."""

    def __init__(self):
        self.counts: Counter = Counter()

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def as_dict(self) -> dict:
        return dict(sorted(self.counts.items()))


@dataclass(eq=False)
class LiveWorkflow:
    """A live workflow as the predictor sees it (the `predictions.LiveWorkflow` protocol)."""

    id: str
    task: str = ""
    agents: list[str] = field(default_factory=list)  # agents of its finished calls, in order
    hidden: Any = None  # its latest call's hidden state (float32 array of the predictor's input size), if read
    running: set = field(default_factory=set)  # rids of its requests in flight
    last_seen: float = 0.0


class DaemonWorker:
    """One daemon thread running submitted calls in order. Unlike a ThreadPoolExecutor, a predictor
    stuck forever cannot hold up the scheduler process's exit."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001  (handed to the waiting scheduler thread)
                future.set_exception(e)


class SchedulerShutdown:
    """Whether the scheduler process itself is stopping, which is when a SystemExit or
    KeyboardInterrupt seen around the predictor belongs to the scheduler and is re-raised.

    The process stops on a signal: SIGINT/SIGTERM/SIGQUIT whose Python handler (SGLang's, or
    Python's default for SIGINT) raises in the main thread. Each such handler is wrapped once
    (on the main thread, when a predictor is called) to set a flag first; a signal whose action is
    the OS default ends the process without any exception. Interpreter finalisation counts too.
    Any other SystemExit/KeyboardInterrupt is the predictor's own (a bug, or a hostile checkpoint)."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGQUIT") if hasattr(signal, name))
    _flag = threading.Event()
    _wrappers: dict = {}

    @classmethod
    def watch(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in cls.SIGNALS:
            current = signal.getsignal(sig)
            if not callable(current) or current is cls._wrappers.get(sig):
                continue

            def wrapper(signum, frame, previous=current):
                cls._flag.set()
                return previous(signum, frame)
            cls._wrappers[sig] = wrapper
            signal.signal(sig, wrapper)

    @classmethod
    def stopping(cls) -> bool:
        return cls._flag.is_set() or sys.is_finalizing()


class GuardedPredictor:
    """A prediction source that cannot take the scheduler down: every call returns a valid
    [B, K, A+1] tensor or None, and says why in the counters when it is None.

    With a timeout the source runs on one worker thread; a call still running from a timed-out
    round makes the next rounds fall back at once instead of queueing behind it."""

    def __init__(self, source: PredictionSource, stats: PluginStats, timeout_s: float | None):
        self.source, self.stats = source, stats
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self._worker = DaemonWorker("pbkv-predictor") if self.timeout_s else None
        self._late: concurrent.futures.Future | None = None

    def warm_up(self, agent: str) -> None:
        """One untimed call at server start, so lazy loading (a text encoder, first-call caches) does
        not make the first real rounds time out."""
        SchedulerShutdown.watch()
        try:
            self.source.predict([LiveWorkflow("warm-up", agents=[agent])])
        except BaseException as e:  # noqa: BLE001  (a predictor that cannot even warm up still falls back per round)
            if isinstance(e, (SystemExit, KeyboardInterrupt)) and SchedulerShutdown.stopping():
                raise
            self.stats.count("predictor_warm_up_failed")
            log.warning("PBKV predictor failed its warm-up call: %s: %s", type(e).__name__, e)

    @property
    def agent_names(self) -> list[str]:
        return self.source.agent_names

    def predict(self, workflows: list) -> torch.Tensor | None:
        if self._late is not None and not self._late.done():
            return self._failed("timeout", "the previous call is still running")
        self._late = None
        SchedulerShutdown.watch()
        try:
            probs = self._call(workflows)
        except TimeoutError:
            return self._failed("timeout", f"no answer within {self.timeout_s}s")
        except BaseException as e:  # noqa: BLE001  (nothing the predictor raises may reach the scheduler)
            if isinstance(e, (SystemExit, KeyboardInterrupt)) and SchedulerShutdown.stopping():
                raise  # the scheduler's own shutdown
            return self._failed("error", f"{type(e).__name__}: {e}")
        problem = self._problem(probs, len(workflows))
        if problem:
            return self._failed(*problem)
        self.stats.count("predictor_calls")
        self.stats.count("predicted_workflows", len(workflows))
        return probs

    def predict_times(self, workflows: list):
        """[B, K] median seconds until each next call (pbkv_time), or None: the source gives none, or
        they failed (counted, and the round orders without times). Untimed: a time head is one more
        head on the same network, and a call that raises is caught."""
        try:
            seconds = predict_times(self.source, workflows)
            if seconds is None:
                return None
            seconds = np.asarray(seconds, dtype=np.float64)
            if seconds.shape != (len(workflows), self.source.horizon) or not np.isfinite(seconds).all():
                raise ValueError(f"expected finite [{len(workflows)}, {self.source.horizon}] seconds, got "
                                 f"{seconds.shape}")
            return seconds
        except Exception as e:  # noqa: BLE001  (nothing the predictor raises may reach the scheduler)
            self.stats.count("predictor_times_failed")
            if self.stats["predictor_times_failed"] in (1, 10, 100) or self.stats["predictor_times_failed"] % 1000 == 0:
                log.warning("PBKV predictor times failed (%s: %s); this round orders without them", type(e).__name__, e)
            return None

    def _call(self, workflows):
        if self._worker is None:
            return self.source.predict(workflows)
        future = self._worker.submit(self.source.predict, workflows)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._late = future
            raise TimeoutError from None

    SUM_TOLERANCE = 1e-3  # |sum of a row - 1|: float32 softmax and noise mixing stay far inside it

    def _problem(self, probs, batch: int) -> tuple[str, str] | None:
        """Why `probs` is not [B, K, A+1] distributions (K: the source's configured horizon), or None."""
        horizon = getattr(self.source, "horizon", None)
        expected = (batch, horizon, len(self.source.agent_names) + 1)
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        if (not isinstance(probs, torch.Tensor) or probs.dim() != 3 or not probs.is_floating_point()
                or (probs.shape[0], probs.shape[2]) != (expected[0], expected[2])
                or (horizon is not None and probs.shape[1] != horizon)):
            return "invalid", f"expected [B={expected[0]}, K={horizon}, {expected[2]}] probabilities, got {shape}"
        if not torch.isfinite(probs).all():
            return "nan", "non-finite probabilities"
        if (probs < 0).any() or (probs > 1).any():
            return "invalid", "probabilities outside [0, 1]"
        if probs.numel() and ((probs.sum(dim=-1, dtype=torch.float64) - 1).abs() > self.SUM_TOLERANCE).any():
            return "invalid", "rows that do not sum to 1"
        return None

    def _failed(self, reason: str, detail: str) -> None:
        self.stats.count(f"predictor_{reason}")
        if self.stats[f"predictor_{reason}"] in (1, 10, 100) or self.stats[f"predictor_{reason}"] % 1000 == 0:
            log.warning("PBKV predictor %s (%s); this round falls back to lifecycle-aware LRU", reason, detail)
        return None


def matched_tokens(req) -> tuple[int | None, int | None]:
    """(GPU and host, GPU) tokens of the request's prompt SGLang's tree had at admission (None where
    this SGLang does not say): `num_matched_prefix_tokens` counts the device prefix and the host
    hit together, `host_hit_length` the host part."""
    matched = getattr(req, "num_matched_prefix_tokens", None)
    host = getattr(req, "host_hit_length", None)
    return matched, None if matched is None or host is None else matched - host


def build_prediction_source(policy: str, config: PluginConfig, stats: PluginStats) -> PredictionSource | None:
    """pbkv: the train.py checkpoint; kvflow_ideal: the agent step graph of a trace dataset (the graph its
    meta.json declares, else its train split's transitions). A source
    that cannot be built is logged and counted; the policy then runs as lifecycle-aware LRU."""
    try:
        if policy in STEP_GRAPH_POLICIES and config.step_graph_traces:
            from data import store
            from serving_integration.cache.predictions import AgentStepGraph
            from serving_integration.cache.workload import workflows_from_rows

            dataset = store.load(config.step_graph_traces)
            train = workflows_from_rows(dataset.rows("train"))
            return AgentStepGraph.for_dataset(dataset.meta, [[c.agent for c in w.calls] for w in train], config.horizon)
        if policy not in STEP_GRAPH_POLICIES and config.checkpoint:
            from models import load_predictor
            from serving_integration.cache.predictions import ModelSource, OnlineBackoff

            source = ModelSource(load_predictor(config.checkpoint, device=config.predictor_device))
            return OnlineBackoff(source, config.online_beta) if config.online_backoff else source
    except Exception as e:  # noqa: BLE001
        stats.count("predictor_unavailable")
        log.error("PBKV: no predictions for %s (%s: %s); it runs as lifecycle-aware LRU", policy, type(e).__name__, e)
        return None
    if policy in ("pbkv", "pbkv_time", *STEP_GRAPH_POLICIES):
        stats.count("predictor_unavailable")
        log.error("PBKV: %s has no %s; it runs as lifecycle-aware LRU", policy,
                  "step_graph_traces" if policy in STEP_GRAPH_POLICIES else "checkpoint")
    return None


def model_of(source):
    """The models.Predictor behind a prediction source (through OnlineBackoff's `inner`), or None."""
    while source is not None and not hasattr(source, "predictor"):
        source = getattr(source, "inner", None)
    return getattr(source, "predictor", None)


def cost_summary(costs_ms) -> dict | None:
    """n, mean, p50, p99 and max of per-request costs in milliseconds; None without any."""
    if not costs_ms:
        return None
    values = sorted(costs_ms)
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "mean": sum(values) / len(values), "p50": at(0.5), "p99": at(0.99), "max": values[-1]}


class WorkflowRuntime:
    """Ledger, policy, predictor and workflow lifecycle of one radix cache."""

    def __init__(self, policy_name: str, config: PluginConfig, source: PredictionSource | None = None,
                 clock: Callable[[], float] = time.monotonic, stats: PluginStats | None = None):
        if policy_name not in PLUGIN_POLICIES:
            raise ValueError(f"the PBKV plugin serves {', '.join(PLUGIN_POLICIES)}; got {policy_name!r}")
        self.policy_name, self.config, self.clock = policy_name, config, clock
        self.stats = stats or PluginStats()
        self.ledger = WorkflowLedger(config.gamma)
        prefetch = config.prefetch or DEFAULT_PREFETCH[policy_name]
        if prefetch in POLICY_PREFETCH_MODES and prefetch != DEFAULT_PREFETCH[policy_name]:
            raise ConfigError(f"prefetch={prefetch}: the prefetch of another policy; {policy_name} takes none, "
                              f"conservative, aggressive or its own ({DEFAULT_PREFETCH[policy_name]})")
        options = (config.options(policy_name) if policy_name in STEP_GRAPH_POLICIES else
                   config.trust_options(config.trust) if policy_name == "pbkv" else
                   config.time_options(config.trust) if policy_name == "pbkv_time" else
                   config.continuum_options() if policy_name == "continuum" else {})
        self.policy = make_policy(policy_name, self.ledger, **options)
        self.pool_tokens: int | None = None  # the GPU pool's size, read at the first scheduler step
        self.call_paths: OrderedDict[Any, list[int]] = OrderedDict()  # rid -> its path (continuum's pin)
        self.fallback = LifecycleLRU(self.ledger)
        self.prefetch = Prefetch(prefetch, self.ledger)
        self.predictor = GuardedPredictor(source, self.stats, config.predictor_timeout_s) if source else None
        if self.predictor is not None:
            self.predictor.warm_up(source.agent_names[-1])
        # predictions are needed by the order itself (pbkv, the KVFlows) or to rank prefetch candidates
        # (lru_prefetch's own prefetch ranks without any)
        self.needs_predictions = self.policy.uses_predictions or self.prefetch.uses_predictions
        self.degraded = self.needs_predictions and self.predictor is None
        # live workflows, least recently seen first (a call moves its workflow to the end)
        self.workflows: OrderedDict[str, LiveWorkflow] = OrderedDict()
        self.to_predict: dict[str, None] = {}  # workflows with a call finished since the last round
        self.tags: OrderedDict[Any, WorkflowTag | None] = OrderedDict()  # rid -> tag, requests in flight
        self.prefetched: dict[int, int] = {}  # node id -> prefetched tokens not yet read
        self.prefetcher = None  # set by the plugin on the first scheduler step with HiCache
        # while a prefetch that may displace only retired cache loads (its room: free space and retired
        # leaves), SGLang's load_back makes that room in lifecycle-aware order (retired first)
        self.making_room_for_prefetch = False
        self.prefetching = False  # a prefetch load is making room: its evictions are not an admission's
        self.recent_tags: deque = deque(maxlen=RECENT_TAGS)  # tags of finished calls, as the ledger saw them
        # hidden states: the predictor that reads them (None: it does not), the vectors of requests
        # whose prefill finished (rid -> vector of the predictor's input size; None: captured, but no
        # predictor reads it), per-request costs
        model = model_of(source)
        self.hidden_reader = model if model is not None and getattr(model, "uses_hidden", False) else None
        self.hidden_of: OrderedDict[Any, Any] = OrderedDict()
        self.hidden_costs_ms: deque = deque(maxlen=HIDDEN_COSTS)
        self.hidden_size: int | None = None  # of the vectors SGLang returned
        self._stats_written = -math.inf
        self._ttl_checked = -math.inf

    def attach(self, cache) -> None:
        """The radix cache this runtime orders, seen from a hook: the tokens it may hold now reach the
        policy (the outcome shadows hold outcome_sample x them): the device pool's free tokens and
        the tree's, i.e. the pool less what running requests hold outside the tree, as the
        simulator tells it."""
        allocator = getattr(cache, "token_to_kv_pool_allocator", None)
        try:
            tokens = allocator.available_size() + cache.evictable_size() + cache.protected_size()
        except (AttributeError, TypeError):  # a cache without these counters: its pool's size
            tokens = getattr(allocator, "size", None)
        if isinstance(tokens, int) and tokens > 0:
            self.policy.set_capacity(tokens, host_tier=getattr(cache, "cache_controller", None) is not None)

    def _shadow_keys(self, workflow_id: str, tokens) -> tuple[list, list]:
        """The content keys the outcome shadows need of a call of this workflow: none unless the
        policy (pbkv, pbkv_time) judges by outcome and samples the workflow (the tokens are hashed
        only then)."""
        judge = getattr(self.policy, "judge", None)
        if getattr(judge, "mode", None) != "outcome" or not judge.is_sampled(workflow_id):
            return [], []
        return self.content_keys(tokens)

    def content_keys(self, tokens) -> tuple[list, list]:
        """A token sequence as the outcome shadows name it: chained hashes of its blocks of
        `shadow_block_tokens` tokens (the same prefix gives the same keys whatever the tree's
        node boundaries), and each block's tokens."""
        block, keys, sizes, key = self.config.shadow_block_tokens, [], [], 0
        tokens = list(tokens or ())
        for start in range(0, len(tokens), block):
            piece = tuple(tokens[start:start + block])
            key = hash((key, piece))
            keys.append(key)
            sizes.append(len(piece))
        return keys, sizes

    @classmethod
    def from_config(cls, policy_name: str, **config) -> "WorkflowRuntime":
        cfg = PluginConfig(**config)
        stats = PluginStats()
        source = build_prediction_source(policy_name, cfg, stats)
        return cls(policy_name, cfg, source, stats=stats)

    # ---------------------------------------------------------------- eviction order

    def priority(self, node) -> tuple:
        """The order SGLang's eviction heaps use: the policy's, or lifecycle-aware LRU while the
        latest prediction round failed. Within one eviction pass the mode cannot change (rounds
        run between passes, on the scheduler thread), so one heap never mixes the two orders."""
        if self.making_room_for_prefetch:  # prefetch.py: only retired cache may go, and it goes first
            return self.fallback.priority(node)
        if self.degraded and self.policy.uses_predictions:
            self.stats.count("fallback_priorities")
            return self.fallback.priority(node)
        return self.policy.priority(node)

    # ---------------------------------------------------------------- request events

    def tag_of(self, req) -> WorkflowTag | None:
        """The request's tag, parsed once per request; missing and bad metadata are counted."""
        rid = getattr(req, "rid", None)
        if rid in self.tags:
            return self.tags[rid]
        try:
            tag = tag_of_request(req)
            self.stats.count("requests_tagged" if tag else "metadata_missing")
        except BadTag as e:
            tag = None
            self.stats.count("metadata_bad")
            if self.stats["metadata_bad"] in (1, 10, 100) or self.stats["metadata_bad"] % 1000 == 0:
                log.warning("PBKV: request %s has malformed workflow metadata (%s); served untracked", rid, e)
        self.tags[rid] = tag
        while len(self.tags) > MAX_REMEMBERED_REQUESTS:
            self.tags.popitem(last=False)
        return tag

    def on_cached(self, req, path_node_ids: list[int], last_node=None) -> None:
        """The request's tokens are in the tree along `path_node_ids` (SGLang's checkpoint, deepest node
        first), ending at `last_node` (SGLang's node; the baselines record it: kvflow an agent's last
        nodes, at every checkpoint as the fork at match and caching; lru_prefetch a finished call's)."""
        tag = self.tag_of(req)
        if tag is None or tag.end_signal:  # an end signal's tokens belong to no agent call
            return
        wf = self._live(tag)
        self.call_paths[req.rid] = list(path_node_ids)
        while len(self.call_paths) > MAX_REMEMBERED_REQUESTS:
            self.call_paths.popitem(last=False)
        if req.rid not in wf.running:  # the call's first checkpoint: it has arrived
            wf.running.add(req.rid)
            self.policy.on_time(self.clock())  # continuum: the clock its tool times are read from
            keys, sizes = self._shadow_keys(wf.id, getattr(req, "origin_input_ids", None))
            if self.policy.observe_call(wf.id, tag.agent, keys, sizes, *matched_tokens(req)):
                self.stats.count("trust_switches")  # SGLang rebuilds its heap on every pass
            report = self.policy.trust_report()
            if report is not None:
                self.stats.count(f"calls_following_{report['following']}")
        self.ledger.record_path(path_node_ids, wf.id, tag.agent)
        if last_node is not None:
            self.policy.on_cached(last_node, wf.id, tag.agent, bool(req.finished()))
        for node_id in path_node_ids:
            if node_id in self.prefetched:  # prefetched, and read before it was evicted
                self.stats.count("prefetch_used_tokens", self.prefetched.pop(node_id))

    def on_queued(self, req, tree_core) -> None:
        """A request entered the waiting queue (pbkv_time reads the queue): a tagged agent call's
        cached path on the GPU, matched without touching the tree (SGLang's read-only
        match_full_device_prefix), reaches the policy with the time it came."""
        if not self.policy.reads_queue:
            return
        tag = self.tag_of(req)
        if tag is None or tag.end_signal:
            return
        wf = self._live(tag)
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(req.origin_input_ids, getattr(req, "extra_key", None), is_bigram=tree_core.is_eagle,
                       cache_salt=getattr(req, "cache_salt", None))  # as SGLang keys the request's prompt
        _, last, _ = tree_core.match_full_device_prefix(key)
        keys, _ = self._shadow_keys(wf.id, req.origin_input_ids)  # for the outcome judge's shadows
        self.policy.on_queued(wf.id, tag.agent, tree_core.path_node_ids(last), self.clock(), keys)
        self.stats.count("calls_queued")

    def on_finished(self, req) -> None:
        """A call finished: its workflow is predicted in the next round, or retired if it was the last."""
        tag = self.tag_of(req)
        self.tags.pop(getattr(req, "rid", None), None)
        if tag is None:
            return
        if tag.end_signal:  # sent after the workflow's last call returned
            self.stats.count("end_signals")
            if tag.workflow_id in self.workflows:
                self.end_workflow(tag.workflow_id)
            return
        wf = self._live(tag)
        wf.running.discard(req.rid)
        wf.agents.append(tag.agent)
        if self.config.hidden_state:
            if req.rid not in self.hidden_of:
                self.stats.count("hidden_missing")  # predicted without it (zeros, as in training)
            wf.hidden = self.hidden_of.pop(req.rid, None)
        keys, sizes = self._shadow_keys(wf.id, list(getattr(req, "origin_input_ids", None) or ())
                                        + list(getattr(req, "output_ids", None) or ()))
        if keys:
            self.policy.observe_insert(wf.id, tag.agent, keys, sizes)
        self.recent_tags.append({"workflow_id": tag.workflow_id, "agent": tag.agent, "step": tag.step,
                                 "workflow_end": tag.workflow_end, "nodes": len(self.ledger.nodes_of.get(wf.id, {}))})
        self.stats.count("calls_finished")
        self.policy.on_time(self.clock())  # continuum: pin the call's cache through its tool call
        self.policy.on_call_finished(wf.id, tag.agent, self.call_paths.pop(req.rid, []),
                                     len(req.origin_input_ids) + len(req.output_ids), not tag.workflow_end)
        if tag.workflow_end:
            self.end_workflow(wf.id)
        else:
            self.to_predict[wf.id] = None

    def wants_hidden(self, req) -> bool:
        """Whether the request's hidden state is to be captured: a tagged agent call (no end signal)."""
        if not self.config.hidden_state:
            return False
        tag = self.tag_of(req)
        return tag is not None and not tag.end_signal

    def on_hidden(self, req, hidden, copy_s: float = 0.0) -> list[float] | None:
        """SGLang's hidden state of the request's last prefill token (a list of floats; None: the
        capture failed), and the seconds SGLang spent copying it to the host. Kept for the request's
        workflow, projected to the predictor's input size if the checkpoint has a projection; returns
        the vector as captured when the request's tag asks for it back (return_hidden), else None."""
        began = time.perf_counter()
        try:
            raw = torch.as_tensor(hidden, dtype=torch.float32).view(1, -1)
            if raw.shape[1] == 0 or not torch.isfinite(raw).all():
                raise ValueError(f"{raw.shape[1]} values, finite: {bool(torch.isfinite(raw).all())}")
            kept = self.hidden_reader.project_hidden(raw) if self.hidden_reader is not None else raw
        except (TypeError, ValueError, RuntimeError) as e:
            self.stats.count("hidden_capture_failed")
            if self.stats["hidden_capture_failed"] in (1, 10, 100) or self.stats["hidden_capture_failed"] % 1000 == 0:
                log.warning("PBKV: no hidden state for request %s (%s); its workflow is predicted without it",
                            getattr(req, "rid", None), e)
            return None
        # kept only for a predictor that reads it, as float32 (4 bytes a value, not a list's 32)
        self.hidden_of[req.rid] = kept[0].numpy().copy() if self.hidden_reader is not None else None
        while len(self.hidden_of) > MAX_REMEMBERED_REQUESTS:
            self.hidden_of.popitem(last=False)
        self.hidden_size = raw.shape[1]
        self.stats.count("hidden_captured")
        self.hidden_costs_ms.append(1000.0 * (copy_s + time.perf_counter() - began))
        tag = self.tag_of(req)
        return raw[0].tolist() if tag is not None and tag.return_hidden else None

    def end_workflow(self, workflow_id: str) -> None:
        self.ledger.end(workflow_id)
        wf = self.workflows.pop(workflow_id, None)
        if wf is not None and self.predictor is not None:
            tell_finished(self.predictor.source, wf)
        self.to_predict.pop(workflow_id, None)
        self.stats.count("workflows_ended")

    def _live(self, tag: WorkflowTag) -> LiveWorkflow:
        wf = self.workflows.get(tag.workflow_id)
        if wf is None:
            wf = self.workflows[tag.workflow_id] = LiveWorkflow(tag.workflow_id, task=tag.task)
            self.ledger.start(wf.id)
            self.stats.count("workflows_started")
            self._bound_live_workflows(keep=wf.id)
        else:
            self.workflows.move_to_end(wf.id)
        if tag.task and not wf.task:
            wf.task = tag.task
        wf.last_seen = self.clock()
        return wf

    def _bound_live_workflows(self, keep: str) -> None:
        """Keep at most `max_live_workflows` live: clients that never send an end signal cannot grow
        the ledger past it. The longest-silent workflow without a request in flight is retired first
        (its cache becomes retired cache, as after a lost end signal's TTL); only when every live
        workflow has one in flight is the longest-silent of those retired."""
        while len(self.workflows) > self.config.max_live_workflows:
            victim = (next((w for w in self.workflows.values() if w.id != keep and not w.running), None)
                      or next(w for w in self.workflows.values() if w.id != keep))
            self.end_workflow(victim.id)
            self.stats.count("workflows_evicted_by_bound")
            evicted = self.stats["workflows_evicted_by_bound"]
            if evicted in (1, 10, 100) or evicted % 1000 == 0:
                log.warning("PBKV: %d live workflows reached max_live_workflows=%d; retired %d so far, "
                            "longest silent first", len(self.workflows) + 1, self.config.max_live_workflows, evicted)

    # ---------------------------------------------------------------- scheduler steps

    def attach_cache(self, cache) -> None:
        """The radix cache's GPU pool, read once: continuum's TTL weighs memory by its share of it.
        SGLang builds its eviction heap anew on every pass, so a pin's change needs no refresh."""
        if self.pool_tokens is not None:
            return
        size = getattr(getattr(cache, "token_to_kv_pool_allocator", None), "size", None)
        if isinstance(size, int) and size > 0:
            self.pool_tokens = size
            self.policy.attach(size, lambda new, cached: new / self.config.prefill_tokens_per_s)

    def on_scheduler_step(self) -> None:
        self.policy.on_time(self.clock())  # continuum: expired pins
        self.run_predictions()
        self.retire_silent_workflows()
        self.maybe_write_stats()

    def run_predictions(self) -> None:
        """One batched predictor call over the workflows whose call finished since the last round."""
        batch = [self.workflows[w] for w in self.to_predict if w in self.workflows]
        self.to_predict.clear()
        if not batch or not self.needs_predictions:
            return
        if self.predictor is None:
            self.stats.count("fallback_rounds")
            return
        probs = self.predictor.predict(batch)
        if probs is None:
            self.degraded = True
            self.stats.count("fallback_rounds")
            return
        graph_steps = getattr(self.predictor.source, "steps_to_execution", None)  # the KVFlows' step graph
        ids, steps = [w.id for w in batch], graph_steps(batch) if graph_steps else None
        self.ledger.set_predictions(ids, self.predictor.agent_names, probs, steps)
        if self.policy.reads_times:  # pbkv_time: the probabilities of each step and the times until them
            self.policy.on_predictions(ids, self.predictor.agent_names, probs, self.predictor.predict_times(batch),
                                       self.clock())
        self.policy.on_steps(ids, steps)  # kvflow: a step update, and its prefetch round (SGLang re-heaps per pass)
        self.degraded = False
        if self.hidden_reader is not None:
            self.stats.count("predicted_with_hidden", sum(w.hidden is not None for w in batch))

    def retire_silent_workflows(self) -> None:
        now = self.clock()
        if self.config.workflow_ttl_s <= 0 or now - self._ttl_checked < min(1.0, self.config.workflow_ttl_s):
            return
        self._ttl_checked = now
        deadline = now - self.config.workflow_ttl_s
        for wf in [w for w in self.workflows.values() if not w.running and w.last_seen < deadline]:
            self.end_workflow(wf.id)
            self.stats.count("workflows_expired")

    # ---------------------------------------------------------------- tree events

    def on_split(self, prefix, suffix) -> None:
        """A node split: the new prefix node was used by everyone who used the old node."""
        self.ledger.split(prefix.id, suffix.id)
        self.policy.on_split(prefix, suffix)
        if suffix.id in self.prefetched:
            self.prefetched[prefix.id] = len(prefix.key)
            self.prefetched[suffix.id] = len(suffix.key)

    def on_device_evict(self, node) -> None:
        self.policy.on_evict(node)
        self.prefetched.pop(node.id, None)

    def on_delete(self, node) -> None:
        self.ledger.forget(node.id)
        self.policy.forget(node)
        self.prefetched.pop(node.id, None)

    def forget_all_nodes(self) -> None:
        """The tree was reset (flush_cache): no node id is valid any more."""
        for node_id in list(self.ledger.users):
            self.ledger.forget(node_id)
        self.policy.forget_all()
        self.prefetched.clear()

    def on_prefetched(self, path, tag=None) -> None:
        """A prefetch candidate's host-only path (topmost node first) is being loaded; `tag` is what
        a baseline's own prefetch order gave with it (kvflow: the step its hold priority follows)."""
        for node in path:
            self.prefetched[node.id] = len(node.key)
            self.stats.count("prefetched_tokens", len(node.key))
        if self.prefetch.policy_driven:
            self.policy.on_prefetched(path, tag)

    def idle_workflows(self) -> list[str]:
        """Live workflows with no request in flight, least recently seen first."""
        return [wf.id for wf in self.workflows.values() if not wf.running]

    def idle_workflow_nodes(self) -> list[int]:
        """Node ids used by live workflows with no request in flight (prefetch candidates)."""
        ids: dict[int, None] = {}
        for wf in self.workflows.values():
            if not wf.running:
                ids.update(self.ledger.nodes_of.get(wf.id, {}))
        return list(ids)

    # ---------------------------------------------------------------- reporting

    def snapshot(self) -> dict:
        counts = self.stats.as_dict()
        prefetched = counts.get("prefetched_tokens", 0)
        trust = self.policy.trust_report()
        return {"policy": self.policy_name, "prefetch": self.prefetch.mode, "degraded": self.degraded,
                "trusted": self.policy.trusted if trust else None,
                "prediction_quality": trust.get("prediction_quality") if trust else None, "trust": trust,
                "has_predictor": self.predictor is not None, "live_workflows": len(self.workflows),
                "prefetch_precision": counts.get("prefetch_used_tokens", 0) / prefetched if prefetched else None,
                "config": asdict(self.config), "counters": counts, "recent_tags": list(self.recent_tags),
                "hidden": {"size": self.hidden_size, "predictor_reads": self.hidden_reader is not None,
                           "input_size": self.hidden_reader.text_spec.dim if self.hidden_reader is not None else None,
                           "cost_ms": cost_summary(self.hidden_costs_ms)}}

    def maybe_write_stats(self, force: bool = False) -> None:
        path = self.config.stats_path
        now = self.clock()
        if not path or (not force and now - self._stats_written < self.config.stats_interval_s):
            return
        self._stats_written = now
        try:
            with atomic_file(path) as tmp:
                tmp.write_text(json.dumps(self.snapshot(), indent=2))
        except OSError as e:
            self.stats.count("stats_write_errors")
            log.warning("PBKV: cannot write stats to %s: %s", path, e)
