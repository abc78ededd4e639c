"""The router in front of the simulated replicas: where each call of a workflow is served.

A routing policy is a small class with one method, `choose(wf, call, servers, now)`, returning
the index of a server; `route` records where each workflow went (its home replica, and a
migration whenever a call leaves its workflow's previous replica). A server offers `load` (its
requests in flight, as sglang-router counts a worker's load), `tree` (its radix cache, read with
`peek`, which touches nothing) and `ledger` (the workflow ledger its eviction policy keeps).

Policies (docs/cluster.md):
    none         one server (sim.replicas=1)
    round_robin  sglang-router's round_robin: calls in turn
    cache_aware  sglang-router's cache_aware: an approximate radix tree of the prompts routed to
                 each worker (the router's own record, not the worker's cache); if the load is
                 imbalanced, (max - min) > balance_abs_threshold and max > balance_rel_threshold
                 x min, the least loaded worker; else the worker with the longest matched prefix
                 if matched / prompt > cache_threshold, else the least loaded. Every routed prompt
                 is inserted into its worker's tree; every eviction_interval_s the trees are cut
                 back, least recently used first, to max_tree_size characters (counted here as
                 tokens x chars_per_token). Defaults are sglang-router's (cache/config.py CacheAwareConfig).
    sticky       sglang-router's manual policy keyed by the workflow id (x-smg-routing-key):
                 a new key goes to the least loaded worker (--assignment-mode min_load; the
                 default there is random), and every
                 later call of the workflow to the same worker.
    pbkv         the call goes to the replica where its workflow's cached prefix (either tier)
                 plus the predicted reuse of the workflow's cached context is largest, among the
                 replicas whose load stays within the bound
                     load + 1 <= load_factor x (total load + 1) / replicas + load_slack;
                 a workflow whose replica is over the bound migrates to the best one within it.
                 The predicted reuse weighs each cache node the workflow used on a replica by the
                 PBKV value of the agents that used it, v_w[a] = sum_k gamma^(k-1) s_w^(k)
                 P_w^(k)[a] (the same numbers the pbkv eviction policy scores with,
                 serving_integration/cache/policies.py WorkflowLedger).
Ties go to the workflow's current replica, then the least loaded, then the lowest index.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from serving_integration.cache.workload import prefix_keys
from serving_integration.cache.config import CacheAwareConfig, PbkvRoutingConfig
from serving_integration.cache.trust import agents_value


def least_loaded(servers: Sequence) -> int:
    return min(range(len(servers)), key=lambda i: (servers[i].load, i))


class PromptRecord:
    """The prompt prefixes routed to one worker (prefix key -> its unit's tokens, least recently
    routed first), cut back to `max_tokens` least recent first by `evict`: sglang-router's
    approximate tree (cache_aware), and all a client knows of a real replica's cache (ClientReplica)."""

    def __init__(self, max_tokens: float = float("inf")):
        self.keys: OrderedDict = OrderedDict()
        self.size, self.max_tokens = 0, max_tokens

    def matched_units(self, keys: Sequence) -> int:
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def matched_tokens(self, keys: Sequence, lens: Sequence[int]) -> int:
        return sum(lens[: self.matched_units(keys)])

    def insert(self, keys: Sequence, lens: Sequence[int]) -> None:
        for key, tokens in zip(reversed(keys), reversed(lens)):  # the root end most recent
            if key in self.keys:
                self.keys.move_to_end(key)
            else:
                self.keys[key] = tokens
                self.size += tokens

    def evict(self) -> None:
        while self.size > self.max_tokens and self.keys:
            self.size -= self.keys.popitem(last=False)[1]


class ClientReplica:
    """A real replica as a client routing to it sees it (the bench's pbkv routing): `load`, its
    requests the client has in flight; `tree.peek`, the longest prefix of a prompt that the client
    sent there (PromptRecord, cut back to the replica's device + host capacity, least recent first);
    no ledger values (the predictions live in the replica's scheduler), so `PBKVRouting` scores a
    replica by that prefix alone, under the same load bound."""

    class _Tree:
        def __init__(self, record: PromptRecord):
            self.record, self.by_id = record, {}

        def peek(self, units: Sequence) -> tuple[int, int]:
            n = self.record.matched_units(prefix_keys(units))
            return n, n

    class _Ledger:
        nodes_of: dict = {}
        users: dict = {}
        reuse_value: dict = {}

    def __init__(self, capacity_tokens: float = float("inf")):
        self.load = 0
        self.record = PromptRecord(capacity_tokens)
        self.tree, self.ledger = self._Tree(self.record), self._Ledger()

    def sent(self, call) -> None:
        """A call's prompt was sent here."""
        self.record.insert(call.keys, call.lens)
        self.record.evict()


class Router:
    name = "base"
    uses_predictions = False

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.home: dict[str, int] = {}  # workflow id -> replica of its last call
        self.migrations = 0  # calls routed away from their workflow's previous replica

    def choose(self, wf, call, servers: Sequence, now: float) -> int:
        raise NotImplementedError

    def route(self, wf, call, servers: Sequence, now: float) -> int:
        i = self.choose(wf, call, servers, now)
        previous = self.home.get(wf.id)
        if previous is not None and previous != i:
            self.migrations += 1
        self.home[wf.id] = i
        return i

    def forget(self, workflow: str) -> None:
        """The workflow ended."""
        self.home.pop(workflow, None)


class NoRouting(Router):
    name = "none"

    def __init__(self, replicas: int):
        if replicas != 1:
            raise ValueError(f"sim.replicas={replicas} needs a routing policy: set sim.routing to one of "
                             f"{', '.join(n for n in ROUTERS if n != 'none')}")
        super().__init__(replicas)

    def choose(self, wf, call, servers, now):
        return 0


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, replicas: int):
        super().__init__(replicas)
        self.next = 0

    def choose(self, wf, call, servers, now):
        i = self.next
        self.next = (i + 1) % len(servers)
        return i


class CacheAware(Router):
    name = "cache_aware"

    def __init__(self, replicas: int, **options):
        """`options`: CacheAwareConfig's fields (serving_integration/cache/config.py), checked there."""
        super().__init__(replicas)
        o = CacheAwareConfig(**options)
        self.cache_threshold = o.cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = o.balance_abs_threshold, o.balance_rel_threshold
        self.eviction_interval_s = o.eviction_interval_s
        self.max_tree_tokens = o.max_tree_size / o.chars_per_token
        self.trees = [PromptRecord(self.max_tree_tokens) for _ in range(replicas)]
        self.next_eviction = o.eviction_interval_s

    def imbalanced(self, loads: Sequence[int]) -> bool:
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def matched(self, worker: int, call) -> int:
        return self.trees[worker].matched_tokens(call.keys, call.lens)

    def choose(self, wf, call, servers, now):
        if self.eviction_interval_s > 0 and now >= self.next_eviction:
            self.evict()
            self.next_eviction = now + self.eviction_interval_s
        loads = [s.load for s in servers]
        if self.imbalanced(loads):
            i = least_loaded(servers)
        else:
            matched = [self.matched(w, call) for w in range(len(servers))]
            best = max(range(len(servers)), key=lambda w: (matched[w], -loads[w], -w))
            rate = matched[best] / call.prompt_tokens if call.prompt_tokens else 0.0
            i = best if rate > self.cache_threshold else least_loaded(servers)
        self.insert(i, call)
        return i

    def insert(self, worker: int, call) -> None:
        self.trees[worker].insert(call.keys, call.lens)

    def evict(self) -> None:
        for tree in self.trees:
            tree.evict()


class Sticky(Router):
    name = "sticky"

    def choose(self, wf, call, servers, now):
        i = self.home.get(wf.id)
        return least_loaded(servers) if i is None else i


class PBKVRouting(Router):
    name = "pbkv"
    uses_predictions = True

    def __init__(self, replicas: int, **options):
        """`options`: PbkvRoutingConfig's fields (serving_integration/cache/config.py), checked there
        (load_factor >= 1 and load_slack >= 1, else no replica may fit)."""
        super().__init__(replicas)
        o = PbkvRoutingConfig(**options)
        self.load_factor, self.load_slack = o.load_factor, o.load_slack

    def bound(self, total_load: int) -> float:
        """The most requests in flight a replica may have once this call is added."""
        return self.load_factor * (total_load + 1) / self.replicas + self.load_slack

    def score(self, server, wf, call, values: dict | None) -> float:
        gpu_units, cached_units = server.tree.peek(call.units)
        score = float(sum(call.lens[:cached_units]))
        if values:
            ledger, by_id = server.ledger, server.tree.by_id
            for node_id in ledger.nodes_of.get(wf.id, ()):
                node = by_id.get(node_id)
                if node is not None:
                    agents = ledger.users[node_id][wf.id]
                    score += node.num_tokens * agents_value(values, agents)
        return score

    def choose(self, wf, call, servers, now):
        loads = [s.load for s in servers]
        bound = self.bound(sum(loads))
        home = self.home.get(wf.id)
        values = servers[home].ledger.reuse_value.get(wf.id) if home is not None else None
        best, best_key = None, None
        for i, s in enumerate(servers):
            if loads[i] + 1 > bound:
                continue
            key = (self.score(s, wf, call, values), i == home, -loads[i], -i)
            if best_key is None or key > best_key:
                best, best_key = i, key
        return least_loaded(servers) if best is None else best


ROUTERS: dict[str, type[Router]] = {cls.name: cls for cls in (NoRouting, RoundRobin, CacheAware, Sticky, PBKVRouting)}


def make_router(name: str, replicas: int, **options) -> Router:
    cls = ROUTERS.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy '{name}'; choose from {', '.join(ROUTERS)}")
    return cls(replicas, **options)
