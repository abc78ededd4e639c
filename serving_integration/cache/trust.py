"""When PBKV follows its own score order and when it falls back to lifecycle-aware LRU: the one
implementation of its trust modes, used by the pbkv and pbkv_time policy classes (policies.py
_JudgedPolicy) in the simulator and in the SGLang plugin. pbkv_time's outcome judge,
`TimeOutcomeTrust`, ranks its score shadow by pbkv_time's own value (below).

    always     the paper's policy: the score order, whatever happens.
    accuracy   `AccuracyTrust`: follow the score while the predictions are right often enough (the
               probability each workflow's latest prediction gave the agent that came next, a moving
               average with hysteresis, `TrustMeter`).
    outcome    `OutcomeTrust` (the default): follow whichever order would have had more GPU hits,
               measured online on shadow caches, with hysteresis.

Why outcome. Accurate next-agent predictions do not imply a better eviction order: the predicted
agent may re-read only a prefix that LRU keeps anyway, while the score keeps its private branch
that is never re-read in time; a wrong guess of the call order among many live workflows may cost
more than a right one gains. A policy that is safe to deploy decides by what it wins.

Shadow caches (set dueling, Qureshi et al., ISCA 2007: a few leader sets run each policy and the
followers take the winner; ARC's ghost lists, Megiddo and Modha, FAST 2003: metadata only, no
data). Two caches hold metadata only (content keys, token counts, each one's own keep order, no
KV): one ordered as PBKV's score (retired first, then ascending lookahead score, LRU ties), one as
lifecycle-aware LRU (retired first, then LRU). Both follow the real cache's life of each call of a
followed workflow. Admitted (`observe_call`): each shadow counts the tokens of its longest held
prefix of the prompt's content keys as hits (a key is a hit when it and every key before it is
held), and the prompt's keys are locked while the call runs, as its path is in the real tree.
Finished (`observe_insert`): its prompt and output are held, touched and unlocked, as the real
cache inserts them. Each shadow holds at most R x the tokens the cache may hold now (the GPU tokens
less what running requests hold outside the tree, `set_capacity`, told before every admission and
insert) and evicts by its own order. Neither depends on which order the real cache follows, so
neither is fed back its own choices. The decision compares the two hit rates over a moving window
of admitted calls and flips, with a margin, to the one that wins (`outcome_return_z`: a bar of its
own for the return to the score after a fallback; `outcome_cumulative`: the difference over every
sampled call since the last flip may flip the order too, so that a lead smaller than the window's
standard error but steady is not ignored; by default 0.5 and on, docs/serving.md section 10).

What the real server had of a prompt is in its tree while the call runs: with a host tier, a host
hit is loaded back at admission and the next call reads it from the GPU, so each shadow holds that
prefix from admission on (a shadow is a GPU cache in front of the server's host tier); without one,
what the real cache had and a shadow did not is recomputed outside that shadow, so its room
shrinks by it until the call finishes (`observe_call`'s `cached`, `set_capacity`'s `host_tier`).

Why admission, locks, running memory and the host tier matter: a shadow that held a prompt on
arrival, let other running calls' keys go (they came back free when those calls finished) and held
the full GPU size judged a different cache; one that read a host hit only at the call's finish and
left what running calls load back uncharged did too. On hover under adversarial predictions the
first put the score order 7.7 points ahead of lifecycle-aware LRU where the real cache put it 2.6
behind, the second 1.7 ahead with a host tier (docs/serving.md).

The eviction unit (`outcome_unit`). By default a shadow evicts one content key at a time, as a server
with partial eviction frees a victim's tail. SGLang evicts a leaf node whole (the simulator too, by
default), and key-by-key shadows then overestimate the hits of an order that keeps many long
contexts in part (Who&When at 121k GPU tokens: the score order's shadow 10.0% against its real
tree's 8.0%). With `outcome_unit=node` each shadow keeps the trie of its held keys (a key's parent
is the key before it in a prompt; chained keys have one) and evicts the lowest-ranked leaf key with
the ancestors that form one node with it in the server's tree: each the only held child of the one
above, up to a branch point, the end of a held sequence, or a lock. A branch point stays a
boundary once it has branched (nodes never merge again). The ancestor left above joins the order
once it is a leaf. Measured against the real trees (docs/serving.md, section 10): within half a
point on every workload tried, where key by key was up to 3 points above.

The sample. A workflow is followed when a seeded hash of its id falls below R = `outcome_sample`
(stable: the same workflows in every run and process). Sampling whole workflows rather than keys
keeps every followed prompt's prefix chain whole. A key read by two or more sampled workflows is
charged R x its tokens, its share of a key the real cache holds once for all its readers; both
shadows charge the same key the same. R = 1 (the default) follows every workflow: the shadows are
full size and nothing is estimated. Below 1 the hit counts are R times the trace's in expectation,
but a miniature cache over a few live workflows does not evict as the full one does; on replays
of a few hundred workflows it misjudged the order (docs/serving.md), so sampling is for servers
with many live workflows.

Cost: incremental, O(log n) per key touched. Each shadow's order is an indexed binary heap of its
keys' entries (`ShadowCache`): a change of a key's rank moves its entry in place, a locked key
leaves the order when it reaches the top and comes back when unlocked. A new prediction or a
retirement changes the ranks of one workflow's keys only: the ledger tells `revise(workflow)` and
the next eviction pass rescores those keys. A key's record also says which shadows hold it, at what
charge, and how many running calls read it, so a touched key costs one dict lookup (its record's). A
full shadow evicts down to (1 - `outcome_slack`) x its capacity. Unsampled calls cost one hash of
the workflow id.
A flip changes every node's priority at once: `observe_call` returns True and the simulator
re-heapifies (RadixTree.reprioritize), as the accuracy meter's flips do.
"""

from __future__ import annotations

import hashlib
import math
from math import exp, log  # compiled: the C library's, as trust.pxd declares (the same functions math calls)
from typing import Callable, Hashable, Protocol, Sequence

import cython

from serving_integration.cache.config import TrustConfig


class Ledger(Protocol):
    """What the accuracy meter reads of the WorkflowLedger (policies.py)."""

    def check_prediction(self, workflow: str, agent: str) -> float | None: ...


class TrustMeter:
    """How good the predictions have been, online: an exponential moving average (over about
    `window` calls) of the probability the last prediction gave the agent that came next. The
    predictions are trusted while it stays above `threshold - margin` and trusted again once it
    climbs above `threshold + margin` (hysteresis, so the order does not flap). It starts at 1:
    the predictions are trusted until calls show otherwise."""

    def __init__(self, threshold: float = TrustConfig.trust_threshold, margin: float = TrustConfig.trust_margin,
                 window: int = TrustConfig.trust_window):
        TrustConfig(trust_threshold=threshold, trust_margin=margin, trust_window=window)  # their ranges (ConfigError)
        self.threshold, self.margin, self.alpha = threshold, margin, 1.0 / window
        self.quality, self.trusted, self.observed, self.switches = 1.0, True, 0, 0

    def update(self, p: float) -> bool:
        """Fold in one observation; True when the trust decision flipped."""
        self.observed += 1
        self.quality += self.alpha * (p - self.quality)
        trusted = (self.quality >= self.threshold - self.margin if self.trusted
                   else self.quality > self.threshold + self.margin)
        flipped, self.trusted = trusted != self.trusted, trusted
        self.switches += flipped
        return flipped


class AccuracyTrust:
    """trust=accuracy: the TrustMeter fed each arriving call's check of its workflow's last prediction."""

    mode = "accuracy"

    def __init__(self, ledger: Ledger, options: TrustConfig, candidate: str = "pbkv"):
        self.ledger, self.candidate = ledger, candidate
        self.meter = TrustMeter(options.trust_threshold, options.trust_margin, options.trust_window)

    @property
    def trusted(self) -> bool:
        return self.meter.trusted

    @property
    def switches(self) -> int:
        return self.meter.switches

    def observe_call(self, workflow: str, agent: str, keys: Sequence = (), sizes: Sequence = (),
                     cached: int | None = None, gpu_cached: int | None = None) -> bool:
        p = self.ledger.check_prediction(workflow, agent)
        return p is not None and self.meter.update(p)

    def observe_insert(self, workflow: str, keys: Sequence, sizes: Sequence, agent: str | None = None) -> None:
        pass  # the meter reads predictions, not cache contents

    def report(self) -> dict:
        return {"trust": self.mode, "following": self.candidate if self.trusted else "pbkv_lae",
                "trust_switches": self.switches, "prediction_quality": self.meter.quality}


def sampled(workflow: str, share: float, seed: int) -> bool:
    """Whether a workflow is in the shadows' sample: a seeded hash of its id below `share` (the
    same answer in every process, unlike Python's salted hash of a str)."""
    digest = hashlib.blake2b(f"{seed}\x00{workflow}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < share * 2 ** 64


SAMPLED_MEMO = 65536  # workflows whose sampling is memoised at once (the hash costs about a microsecond)


@cython.locals(total=cython.double)
def agents_value(values: dict, agents: dict) -> float:
    """The sum of `values` over `agents` (0 for an agent without one): what one workflow, whose
    predictions' values are `values`, adds to a key or node it read with these agents (the
    shadows' entries, PBKV's score in policies.WorkflowLedger, policies.PBKVTime, the router's
    score). Added one by one in order, as sum() adds on Python 3.11 (a loop: the shadows call it
    from cpdef methods, which may hold no generator; compiled, over two dicts, as trust.pxd
    types them: every caller's are)."""
    total = 0.0
    for agent in agents:
        total += values.get(agent, 0.0)
    return total


@cython.locals(total=cython.double, part=cython.double)
def sum_parts(parts: dict) -> float:
    """The sum of a dict's float values, added to 0.0 one by one in order (what sum() gives on
    Python 3.11; 3.12's sum() of floats compensates), in a compiled loop rather than through the
    builtin's generic call."""
    total = 0.0
    for part in parts.values():
        total += part
    return total


class ShadowEntry:
    """One content key as the shadows know it: the key, its tokens, the live sampled workflows (and
    their agents) that read it, the first sampled workflow that did and whether another one did too,
    when it was last touched, its score (the sum of its live readers' v_w over their agents), and
    its place in each shadow's order (-1: not in it), which shadows hold it and at what charge (the
    same in both: `OutcomeTrust._hold` charges both at once), and the running calls that read it.
    The judge reads these fields where it would otherwise look the key up in a shadow's `held` or
    in a dict of locks: a key's hash and a lookup in a dict of every held key cost more than the
    rest of its work on most touches. A key a running call reads has an entry from the call's
    admission on (`first` None until a call holds it), held or not."""

    __slots__ = ("key", "size", "readers", "parts", "first", "shared", "stamp", "score", "score_slot", "lru_slot",
                 "in_score", "in_lru", "charge", "locks")

    def __init__(self, key, size: int, first: str):
        self.key, self.size, self.first, self.shared, self.stamp, self.score = key, size, first, False, 0, 0.0
        self.readers: dict[str, dict[str, None]] = {}  # live sampled workflow -> its agents that read the key
        self.parts: dict[str, float] = {}  # live sampled workflow -> sum of its v_w over those agents
        self.score_slot = self.lru_slot = -1
        self.in_score = self.in_lru = False  # held by the score shadow, by the LRU shadow
        self.charge = 0.0  # the tokens each shadow that holds it charges for it
        self.locks = 0  # running calls that read it (their paths are locked in the real tree)

    def set_part(self, workflow: str, table: dict) -> None:
        """A reader's part from its v_w `table`, and the score again (the sum of the parts)."""
        part = self.parts[workflow] = agents_value(table, self.readers[workflow])
        self.score = part if len(self.parts) == 1 else sum_parts(self.parts)

    def drop_reader(self, workflow: str) -> None:
        """A reader retired: its agents and part go, the score is made again."""
        del self.readers[workflow]
        self.parts.pop(workflow, None)
        self.rescore()

    def rescore(self) -> None:
        """The score from the parts (their sum; 0.0 for none, a float as every part is)."""
        self.score = sum_parts(self.parts)


class TimeShadowEntry(ShadowEntry):
    """A key as pbkv_time's shadow knows it: its score is log V (policies.PBKVTime.log_value), the
    log-sum-exp of its live readers' terms (a reader's table is (log discount of its prediction's
    time, agent -> value); its term: that log discount + the log of its values summed over its
    agents, -inf at 0) and of its queued readers' (the log discount of the time each came)."""

    __slots__ = ("queued",)

    def __init__(self, key, size: int, first: str):
        super().__init__(key, size, first)
        self.queued: dict[str, float] = {}  # queued sampled workflow -> the log discount of its queue time
        self.score = -math.inf

    def set_part(self, workflow: str, table: tuple) -> None:
        offset, values = table
        part = agents_value(values, self.readers[workflow])
        term = self.parts[workflow] = offset + log(part) if part > 0 else -math.inf
        if len(self.parts) == 1 and not self.queued:
            self.score = term  # one term: log_sum_exp gives it as it is
        else:
            self.rescore()

    def rescore(self) -> None:
        self.score = log_sum_exp(self.queued.values(), self.parts.values())  # the policy's order of terms


@cython.locals(top=cython.double, total=cython.double, x=cython.double, n=cython.Py_ssize_t)
def log_sum_exp(terms, more=()) -> float:
    """log(sum(exp(x))) over `terms` and then `more` (floats; two sequences, so that a caller
    whose terms are in two dicts builds no list of them) without overflow (-inf for none); one term
    is returned as it is, so a key with one reader has exactly that reader's term, as in
    policies.PBKVTime."""
    top, n = -math.inf, 0
    for x in terms:  # the max, in C when compiled
        n += 1
        if x > top:
            top = x
    for x in more:
        n += 1
        if x > top:
            top = x
    if n <= 1 or top == -math.inf:
        return top
    total = 0.0  # summed in a loop, as sum() does on Python 3.11 (a compiled loop, no generator)
    for x in terms:
        total += exp(x - top)
    for x in more:
        total += exp(x - top)
    return top + log(total)


class ShadowCache:
    """A metadata-only cache of `capacity` tokens: the keys it holds with the tokens charged for each,
    and its eviction order, lowest first, as an indexed binary heap of their entries (each entry
    knows its slot): a key whose rank changes moves to its new place at once (`place`, O(log n)), so
    the heap holds no stale items and the next victim is its top.

    Two orders (`before`): the score shadow's is PBKV's (policies.PBKV): retired keys first, then
    ascending score, the oldest first among equals; the LRU shadow's is lifecycle-aware LRU's
    (policies.LifecycleLRU): retired keys first, then the oldest. A key's stamp is its own (every
    touch takes the next clock value), so no two keys tie and the victim does not depend on the
    heap's shape.

    The heap holds every held key that may be evicted now, and perhaps some that may not: a key
    locked by a running call, or (outcome_unit=node) one with held children, leaves it only when it
    reaches the top (`victim`: most locked keys are unlocked before they would), and comes back
    when it is unlocked or becomes a leaf."""

    def __init__(self, name: str, capacity: float, by_score: bool):
        self.name, self.capacity, self.by_score = name, capacity, by_score
        self.held: dict[Hashable, float] = {}  # key -> tokens charged
        self.used = 0.0
        self.reserved = 0.0  # running calls' prompt tokens in the real tree and not here, less the reverse
        self.order: list[ShadowEntry] = []  # the heap
        self.hit_tokens = 0.0  # prompt tokens hit, decayed over the window (OutcomeTrust)
        self.total_hit_tokens = 0  # prompt tokens hit over the whole run
        self.children: dict[Hashable, int] = {}  # outcome_unit=node: held key -> its held children

    def room(self) -> float:
        """The tokens it may hold now: its capacity less its running calls' reservations."""
        return self.capacity - self.reserved

    def holds(self, entry: ShadowEntry) -> bool:
        """Whether this shadow holds `entry`'s key (its flag: `key in self.held`, without the lookup)."""
        return entry.in_score if self.by_score else entry.in_lru

    def hold(self, entry: ShadowEntry, charge, before: float) -> None:
        """`entry`'s key held at `charge` tokens, where it was charged `before` if held already."""
        if not self.holds(entry):
            self.used += charge
            if self.by_score:
                entry.in_score = True
            else:
                entry.in_lru = True
        elif charge != before:
            self.used += charge - before
        else:
            return  # held at that charge already: nothing changes
        self.held[entry.key] = charge

    @cython.locals(a_live=cython.bint)
    def before(self, a: ShadowEntry, b: ShadowEntry) -> bool:
        """Whether this order evicts `a` before `b`."""
        a_live = len(a.readers) != 0
        if a_live != (len(b.readers) != 0):
            return not a_live  # retired first
        if self.by_score and a_live and a.score != b.score:
            return a.score < b.score
        return a.stamp < b.stamp

    def slot(self, entry: ShadowEntry) -> int:
        return entry.score_slot if self.by_score else entry.lru_slot

    def _put(self, entry: ShadowEntry, i: int) -> int:
        """`entry` into slot `i` of the heap (-1: out of it)."""
        if i >= 0:
            self.order[i] = entry
        if self.by_score:
            entry.score_slot = i
        else:
            entry.lru_slot = i
        return 0

    @cython.locals(order=list, start=cython.Py_ssize_t, parent=cython.Py_ssize_t, above=ShadowEntry)
    def _up(self, entry: ShadowEntry, i: int) -> bool:
        """Sift `entry` up from slot `i`; whether it moved."""
        order, start = self.order, i
        while i > 0:
            parent = (i - 1) >> 1
            above = order[parent]
            if not self.before(entry, above):
                break
            self._put(above, i)
            i = parent
        self._put(entry, i)
        return i != start

    @cython.locals(order=list, n=cython.Py_ssize_t, child=cython.Py_ssize_t, below=ShadowEntry)
    def _down(self, entry: ShadowEntry, i: int) -> int:
        """Sift `entry` down from slot `i`."""
        order = self.order
        n = len(order)
        child = 2 * i + 1
        while child < n:
            if child + 1 < n and self.before(order[child + 1], order[child]):
                child += 1
            below = order[child]
            if not self.before(below, entry):
                break
            self._put(below, i)
            i, child = child, 2 * child + 1
        self._put(entry, i)
        return 0

    @cython.locals(i=cython.Py_ssize_t)
    def place(self, entry: ShadowEntry) -> None:
        """`entry` into the order, or to its new place in it after its rank changed."""
        i = self.slot(entry)
        if i < 0:
            self.order.append(entry)
            self._up(entry, len(self.order) - 1)
        elif not self._up(entry, i):
            self._down(entry, i)

    @cython.locals(i=cython.Py_ssize_t, last=ShadowEntry)
    def drop(self, entry: ShadowEntry) -> None:
        """`entry` out of the order (nothing if it is not in it)."""
        i = self.slot(entry)
        if i < 0:
            return
        self._put(entry, -1)
        last = self.order.pop()
        if last is not entry:  # the last slot's entry fills the hole and moves to its place
            if not self._up(last, i):
                self._down(last, i)

    def reorder(self, entry: ShadowEntry, locked: bool) -> None:
        """A held key's rank changed: its entry to its new place, or, while it is locked, out of the
        order (it comes back when unlocked)."""
        if locked:
            self.drop(entry)
        else:
            self.place(entry)

    @cython.locals(order=list, children=dict, entry=ShadowEntry)
    def victim(self, leaves_only: bool = False):
        """The entry of the next key this order evicts (None: nothing evictable). A locked key, and
        with `leaves_only` a key with held children, leaves the order here (OutcomeTrust._release
        and _evict_node place it again)."""
        order, children = self.order, self.children
        while order:
            entry = order[0]
            if entry.locks or (leaves_only and children.get(entry.key)):
                self.drop(entry)
                continue
            return entry
        return None

    def evict(self, entry: ShadowEntry) -> None:
        self.drop(entry)
        self.used -= self.held.pop(entry.key)
        if self.by_score:
            entry.in_score = False
        else:
            entry.in_lru = False


def ratio_error(r: float, dd: float, dp: float, pp: float, total: float) -> float:
    """The standard error of a ratio estimate r = sum d / sum p from its sums of d^2, d p and p^2
    (delta method), `total` = sum p."""
    spread = dd - 2 * r * dp + r * r * pp
    return math.sqrt(max(spread, 0.0)) / total


class OutcomeTrust:
    """trust=outcome: the score order against lifecycle-aware LRU on two shadow caches that follow
    the workflows' calls (all of them by default, a seeded sample below outcome_sample = 1; module
    docstring); follows the one with more hits, with hysteresis.

    `values(workflow)`: the workflow's folded prediction values v_w (agent -> value, what PBKV's
    score sums, WorkflowLedger.score; empty before its first prediction), or None once the cache
    has retired it. `capacity`: the tokens the real cache may hold now (its GPU tokens less what
    running requests hold outside it), given by the caller that knows it (the simulator's server,
    the plugin's runtime) through `set_capacity` before each call and insert."""

    mode = "outcome"
    candidate = "pbkv"  # the order it judges (the policy's name)
    entry_type = ShadowEntry  # the shadows' per-key record (TimeOutcomeTrust: TimeShadowEntry)

    def __init__(self, options: TrustConfig, values: Callable[[str], dict | None], capacity: float = 0.0):
        self.values = values
        self.share, self.seed = options.outcome_sample, options.outcome_seed
        self.margin, self.min_calls, self.z = options.outcome_margin, options.outcome_min_calls, options.outcome_z
        self.return_z = options.outcome_return_z
        self.slack = options.outcome_slack
        self.real_weight = options.outcome_real_weight
        self.by_node = options.outcome_unit == "node"
        # outcome_unit=node: each key's parent (the key before it in a prompt; chained keys have one)
        # and the node boundaries of the server's tree: keys that ended a held sequence or branched
        self.parent: dict[Hashable, Hashable | None] = {}
        self.ends: dict[Hashable, None] = {}
        self.decay = 1.0 - 1.0 / options.outcome_window
        self.entries: dict[Hashable, ShadowEntry] = {}  # key -> ShadowEntry: held by either shadow, or locked
        self.clock = 0  # touches: each key's stamp
        self.score_shadow = ShadowCache("pbkv", 0.0, by_score=True)
        self.lru_shadow = ShadowCache("pbkv_lae", 0.0, by_score=False)
        self.shadows = (self.score_shadow, self.lru_shadow)
        # live sampled workflows with keys in the shadows: their v_w as last read, and their keys
        self.tables: dict[str, dict] = {}
        self.keys_of: dict[str, dict[Hashable, ShadowEntry]] = {}
        self._revised: dict[str, None] = {}  # tracked workflows whose v_w changed or that retired since
        # each sampled workflow's running calls' keys (locked: ShadowEntry.locks), oldest first
        self.running: dict[str, list[Sequence]] = {}
        self.prompt_tokens = 0.0  # sampled prompt tokens, decayed like the hit counts
        # the hits the decision compares (score order, lifecycle-aware LRU), decayed: the shadows',
        # the followed order's mixed with the real cache's by outcome_real_weight
        self.judged = [0.0, 0.0]
        self.total_prompt_tokens = 0  # sampled prompt tokens over the whole run
        # decayed sums of d^2, d p and p^2 over sampled calls, d = (lru hits - score hits), p = prompt
        # tokens: the variance of the ratio estimate sum d / sum p (judged_rates' difference)
        self._dd = self._dp = self._pp = 0.0
        # outcome_cumulative: the same sums over every sampled call since the last flip, undecayed
        self.cumulative = options.outcome_cumulative
        self._since = [0.0] * 6  # sum d, sum p, sum d^2, sum d p, sum p^2, calls
        self.sampled_calls = 0
        self.trusted, self.switches = True, 0
        self._sampled: dict[str, bool] = {}  # workflow -> is_sampled, memoised (at most SAMPLED_MEMO)
        self.host_tier = False
        self.set_capacity(capacity)

    def set_capacity(self, cache_tokens: float, host_tier: bool | None = None) -> None:
        """The tokens the real cache may hold now, and (when told) whether it has a host tier."""
        if host_tier is not None:
            self.host_tier = host_tier
        for shadow in self.shadows:
            shadow.capacity = self.share * cache_tokens

    @property
    def locked(self) -> dict:
        """The keys running calls read, with how many read each (ShadowEntry.locks; for inspection)."""
        return {key: entry.locks for key, entry in self.entries.items() if entry.locks}

    # ---------------------------------------------------------------- accesses

    def is_sampled(self, workflow: str) -> bool:
        known = self._sampled.get(workflow)
        if known is None:
            if len(self._sampled) >= SAMPLED_MEMO:  # a long-running server sees workflows without end
                self._sampled.clear()
            known = self._sampled[workflow] = sampled(workflow, self.share, self.seed)
        return known

    def observe_call(self, workflow: str, agent: str, keys: Sequence = (), sizes: Sequence = (),
                     cached: int | None = None, gpu_cached: int | None = None) -> bool:
        """A call was admitted with its prompt's content keys (prefix order) and token counts, and
        the first `cached` of its tokens were in the real cache (GPU and host; None: unknown), the
        first `gpu_cached` on its GPU (None: unknown; outcome_real_weight counts them toward the
        followed order's hits). Each
        shadow counts the tokens of its longest held prefix as hits, and then holds what the call
        holds on the GPU inside the real tree while it runs, so that the rest of the prompt and the
        output are what the capacity told (`set_capacity`) leaves out, as for the real cache:
          - with a host tier, the prefix the real server had (a GPU miss there is loaded back from
            the host at admission, and the next call reads it from the GPU): a shadow is a GPU
            cache in front of the server's host tier;
          - without one, its own hits; the tokens the real cache had and it did not are recomputed
            outside its tree, so its room shrinks by them (and grows by what it held and the real
            cache did not) until the call finishes.
        The prompt's keys stay locked until then, as its path is in the real tree; the whole prompt
        is held, read and touched then, as the real cache inserts it. Then each shadow makes room.
        True when the followed order flipped."""
        if not keys or not self.is_sampled(workflow):
            return False
        self.sampled_calls += 1
        prompt, decay = sum(sizes), self.decay
        self.prompt_tokens = self.prompt_tokens * decay + prompt
        self.total_prompt_tokens += prompt
        hits = self._hits(keys, sizes)
        for shadow, hit in zip(self.shadows, hits):
            shadow.hit_tokens = shadow.hit_tokens * decay + hit
            shadow.total_hit_tokens += hit
        judged, sums = self._judged_hits(hits, gpu_cached), self.judged
        sums[0] = sums[0] * decay + judged[0]
        sums[1] = sums[1] * decay + judged[1]
        d = judged[1] - judged[0]
        self._dd, self._dp, self._pp = (self._dd * decay + d * d, self._dp * decay + d * prompt,
                                        self._pp * decay + prompt * prompt)
        if self.cumulative:
            since = self._since
            since[0] += d
            since[1] += prompt
            since[2] += d * d
            since[3] += d * prompt
            since[4] += prompt * prompt
            since[5] += 1
        loaded = cached if cached and self.host_tier else 0  # the prefix held from admission on
        reserved = (0, 0) if cached is None else (cached - max(hits[0], loaded), cached - max(hits[1], loaded))
        for shadow, tokens in zip(self.shadows, reserved):
            shadow.reserved += tokens
        self.running.setdefault(workflow, []).append((keys, reserved))
        entries = self.entries
        for key, size in zip(keys, sizes):
            entry = entries.get(key)
            if entry is None:
                entry = entries[key] = self.entry_type(key, size, None)
            entry.locks += 1
        if loaded:
            n, total = len(sizes), 0
            for i, size in enumerate(sizes):  # the keys up to the first that ends past the loaded prefix
                total += size
                if total > loaded:
                    n = i
                    break
            self._hold(workflow, agent, keys[:n], sizes[:n])
        self._make_room()
        return self._decide()

    @cython.locals(entry=ShadowEntry, in_score=cython.bint, in_lru=cython.bint)
    def _hits(self, keys: Sequence, sizes: Sequence) -> list:
        """Each shadow's hits on a prompt (score order, lifecycle-aware LRU): the tokens of its longest
        held prefix of `keys`, both in one pass over the keys' entries."""
        entries = self.entries
        score_hits = lru_hits = 0
        in_score = in_lru = True
        for key, size in zip(keys, sizes):
            entry = entries.get(key)
            if entry is None:
                break
            in_score = in_score and entry.in_score
            in_lru = in_lru and entry.in_lru
            if not (in_score or in_lru):
                break
            if in_score:
                score_hits += size
            if in_lru:
                lru_hits += size
        return [score_hits, lru_hits]

    def _judged_hits(self, hits: list, gpu_cached) -> list:
        """The call's hits as the decision counts them: the shadows' (score order, lifecycle-aware LRU),
        the followed order's mixed with the real cache's GPU hits by outcome_real_weight. The two
        shadows share most of their error (granularity, the stream they both follow), which their
        difference cancels; the real cache's count has no error for the order it follows, and none to
        cancel the other shadow's. Tried on validation and not adopted (default 0: docs/serving.md
        section 10): any weight switched more and lost more where the score wins."""
        weight = self.real_weight
        if not weight or gpu_cached is None:
            return hits
        followed = 0 if self.trusted else 1
        mixed = list(hits)
        mixed[followed] = (1.0 - weight) * hits[followed] + weight * gpu_cached
        return mixed

    def observe_insert(self, workflow: str, keys: Sequence, sizes: Sequence, agent: str | None = None) -> None:
        """A call finished: its prompt and output (content keys in prefix order) are in the cache, and
        its path is unlocked."""
        if not keys or not self.is_sampled(workflow):
            return
        calls = self.running.get(workflow)
        if calls:
            self._release(*calls.pop(0), keys)
            if not calls:
                del self.running[workflow]
        self._hold(workflow, agent, keys, sizes)
        self._make_room()

    @cython.locals(entry=ShadowEntry, shadow=ShadowCache)
    def _release(self, keys: Sequence, reserved: tuple, held_now: Sequence) -> None:
        """A finished call's keys: unlocked, and back into the orders of the shadows that hold them
        (those about to be held again are placed then, with their new rank); its reservations end."""
        for shadow, tokens in zip(self.shadows, reserved):
            shadow.reserved -= tokens
        entries, again = self.entries, None
        for key in keys:
            entry = entries[key]
            entry.locks -= 1
            if entry.locks:
                continue
            if again is None:
                again = set(held_now)
            if key in again:
                continue  # held again now (`_hold` places it with its new rank)
            if not (entry.in_score or entry.in_lru):
                del entries[key]  # only locked: no shadow held it
                continue
            for shadow in self.shadows:
                if shadow.holds(entry):
                    shadow.place(entry)

    @cython.locals(entry=ShadowEntry, score=ShadowCache, lru=ShadowCache)
    def _hold(self, workflow: str, agent: str | None, keys: Sequence, sizes: Sequence) -> None:
        """The workflow's call read these keys, and the cache now holds them all."""
        table = self.tables.get(workflow)
        if table is None:
            table = self.values(workflow)
            if table is not None:
                self.tables[workflow], self.keys_of[workflow] = table, {}
        mine = self.keys_of.get(workflow) if table is not None else None
        table = table or {}  # read only where `mine` is known, that is where the table is
        entries, share, clock = self.entries, self.share, self.clock
        score, lru = self.score_shadow, self.lru_shadow
        if self.by_node:
            self._shape(keys)
        # touched deepest first, so that a prefix is more recent than what extends it: the LRU
        # ties of both orders then evict leaves before their prefixes, as a radix tree must
        for key, size in zip(reversed(keys), reversed(sizes)):
            entry = entries.get(key)
            if entry is None:
                entry = entries[key] = self.entry_type(key, size, workflow)
            elif entry.first is None:  # only locked until now
                entry.first = workflow
            elif not entry.shared and entry.first != workflow:
                entry.shared = True
            if mine is not None:
                agents = entry.readers.get(workflow)
                if agents is None:
                    agents = entry.readers[workflow] = {}
                    mine[key] = entry
                if agent is not None and agent not in agents:
                    agents[agent] = None
                    entry.set_part(workflow, table)
            clock += 1
            entry.stamp = clock
            charge = size * share if entry.shared else size
            before = entry.charge  # both shadows hold it, at this charge
            score.hold(entry, charge, before)
            lru.hold(entry, charge, before)
            entry.charge = charge
            is_locked = entry.locks != 0
            score.reorder(entry, is_locked)
            lru.reorder(entry, is_locked)
        self.clock = clock

    def _shape(self, keys: Sequence) -> None:
        """outcome_unit=node, before `keys` are held: their parents, the sequence's end, and each
        shadow's count of held children for the keys it does not hold yet."""
        parent, prev = self.parent, None
        for key in keys:
            parent.setdefault(key, prev)
            prev = key
        self.ends[keys[-1]] = None
        for shadow in self.shadows:
            held, children = shadow.held, shadow.children
            for key in keys:
                if key not in held:
                    up = parent[key]
                    if up is not None:
                        n = children[up] = children.get(up, 0) + 1
                        if n > 1:  # a branch: the server's tree splits there, and its nodes never merge again
                            self.ends[up] = None

    # ---------------------------------------------------------------- the two keep orders

    def revise(self, workflow: str) -> None:
        """The workflow's v_w changed, or the cache retired it (the ledger tells every change:
        WorkflowLedger.listeners); read again before the next eviction."""
        if workflow in self.tables:
            self._revised[workflow] = None

    @cython.locals(entry=ShadowEntry, score_shadow=ShadowCache, lru_shadow=ShadowCache)
    def _refresh(self) -> None:
        """Read each revised workflow's v_w again: a retired one leaves its keys' readers, a new
        prediction rescores its keys. Both change ranks, so the keys move in the orders."""
        if not self._revised:
            return
        tables, values = self.tables, self.values
        changed = [(w, values(w)) for w in self._revised if w in tables]
        self._revised = {}
        score_shadow, lru_shadow = self.score_shadow, self.lru_shadow
        for w, now in changed:
            if now is None:  # retired: its keys lose a reader, and may become retired keys
                del tables[w]
                for keys, reserved in self.running.pop(w, ()):  # a call the server never finished (aborted)
                    self._release(keys, reserved, ())
                for key, entry in self.keys_of.pop(w).items():
                    entry.drop_reader(w)
                    is_locked = entry.locks != 0
                    if entry.in_score:
                        score_shadow.reorder(entry, is_locked)
                    if not entry.readers and entry.in_lru:  # retired: its LRU rank changed too
                        lru_shadow.reorder(entry, is_locked)
                continue
            tables[w] = now
            for key, entry in self.keys_of[w].items():  # a new prediction: only the score's order changes
                if w not in entry.parts:
                    continue  # read without an agent (a call before any agent is known)
                entry.set_part(w, now)
                if entry.in_score:
                    score_shadow.reorder(entry, entry.locks != 0)

    @cython.locals(shadow=ShadowCache, other=ShadowCache, score=ShadowCache, lru=ShadowCache, entry=ShadowEntry)
    def _make_room(self) -> None:
        """Each shadow over its capacity evicts by its own order down to (1 - slack) x its capacity;
        a key neither holds any more is forgotten."""
        score, lru = self.score_shadow, self.lru_shadow
        if score.used <= score.room() and lru.used <= lru.room():
            return
        self._refresh()
        for shadow, other in ((self.score_shadow, self.lru_shadow), (self.lru_shadow, self.score_shadow)):
            room = shadow.room()
            if shadow.used <= room:
                continue
            target = (1 - self.slack) * room
            while shadow.used > target:
                entry = shadow.victim(self.by_node)
                if entry is None:
                    break
                if self.by_node:
                    self._evict_node(shadow, other, entry.key)
                    continue
                shadow.evict(entry)
                if not other.holds(entry):
                    self._forget(entry.key)

    def _evict_node(self, shadow: ShadowCache, other: ShadowCache, leaf) -> None:
        """outcome_unit=node: evict `leaf` with the ancestors that form one node with it in the
        server's tree (each the only held child's parent, not a sequence's end, not locked), as
        SGLang evicts a leaf node whole; the ancestor left above, once a leaf, joins the order."""
        parent, ends, children, held, entries = self.parent, self.ends, shadow.children, shadow.held, self.entries
        chain, up = [leaf], parent.get(leaf)
        while up is not None and up in held and children.get(up) == 1 and up not in ends and not entries[up].locks:
            chain.append(up)
            up = parent.get(up)
        for key in chain:
            entry = entries[key]
            shadow.evict(entry)
            above = parent.get(key)
            if above is not None:
                n = children.get(above, 0) - 1
                if n > 0:
                    children[above] = n
                else:
                    children.pop(above, None)
            if not other.holds(entry):
                self._forget(key)
        if up is not None and up in held and not entries[up].locks and not children.get(up):
            shadow.place(entries[up])

    def _forget(self, key) -> None:
        entry = self.entries.pop(key)
        for w in entry.readers:
            self.keys_of[w].pop(key, None)
        if self.by_node:
            self.parent.pop(key, None)
            self.ends.pop(key, None)
            for shadow in self.shadows:
                shadow.children.pop(key, None)

    # ---------------------------------------------------------------- decision

    def hit_rates(self) -> tuple[float, float]:
        """(score order, lifecycle-aware LRU): the shadows' GPU hit rates over the window."""
        total = self.prompt_tokens or 1.0
        return self.score_shadow.hit_tokens / total, self.lru_shadow.hit_tokens / total

    def judged_rates(self) -> tuple[float, float]:
        """(score order, lifecycle-aware LRU): the hit rates the decision compares over the window (the
        shadows' with outcome_real_weight = 0)."""
        total = self.prompt_tokens or 1.0
        return self.judged[0] / total, self.judged[1] / total

    def standard_error(self) -> float:
        """Of the windowed difference of the judged hit rates (lru - score): the ratio estimator's, from
        the decayed per-call sums (delta method)."""
        total = self.prompt_tokens or 1.0
        r = (self.judged[1] - self.judged[0]) / total
        return ratio_error(r, self._dd, self._dp, self._pp, total)

    def lead_since_flip(self) -> tuple[float, float]:
        """outcome_cumulative: lifecycle-aware LRU's lead over the score in hit rate over every sampled
        call since the last flip (or the start), and its standard error."""
        d, total, dd, dp, pp, _ = self._since
        total = total or 1.0
        r = d / total
        return r, ratio_error(r, dd, dp, pp, total)

    def _decide(self) -> bool:
        """Flip to the other order once it wins by more than the margin plus z standard errors (to
        return to the score after a fallback: return_z) over the window, or, with outcome_cumulative,
        over every sampled call since the last flip (once there are min_calls of them): a large,
        steady difference flips within a few dozen sampled calls, noise does not."""
        if self.sampled_calls < self.min_calls:  # too little evidence yet: the predictions are trusted
            return False
        score, lru = self.judged_rates()
        if self.trusted:
            trusted = score >= lru - (self.margin + self.z * self.standard_error())
        else:
            trusted = score > lru + (self.margin + self.return_z * self.standard_error())
        if self.cumulative and trusted == self.trusted and self._since[5] >= self.min_calls:
            # the window holds; the evidence since the flip (over as many calls as the first decision) may not
            lead, error = self.lead_since_flip()
            if self.trusted:
                trusted = not lead > self.margin + self.z * error
            else:
                trusted = -lead > self.margin + self.return_z * error
        flipped, self.trusted = trusted != self.trusted, trusted
        self.switches += flipped
        if flipped:
            self._since = [0.0] * 6
        return flipped

    def report(self) -> dict:
        """What it followed and measured: `shadow_hit_rate_*` over every sampled call of the run,
        `shadow_window_hit_rate_*` over the decision's window at the end (where a replay's load
        drops as its last workflows finish, and every rate rises)."""
        score, lru = self.hit_rates()
        total = self.total_prompt_tokens or 1
        return {"trust": self.mode, "following": self.candidate if self.trusted else "pbkv_lae",
                "trust_switches": self.switches, "shadow_sampled_calls": self.sampled_calls,
                "shadow_hit_rate_pbkv": self.score_shadow.total_hit_tokens / total,
                "shadow_hit_rate_lae": self.lru_shadow.total_hit_tokens / total,
                "shadow_window_hit_rate_pbkv": score, "shadow_window_hit_rate_lae": lru,
                "shadow_hit_tokens_pbkv": self.score_shadow.total_hit_tokens,
                "shadow_hit_tokens_lae": self.lru_shadow.total_hit_tokens}


class TimeOutcomeTrust(OutcomeTrust):
    """trust=outcome for pbkv_time: its order (log V, policies.PBKVTime) against lifecycle-aware LRU.
    The same shadows and decision; a key's score is pbkv_time's value (TimeShadowEntry), a reader's
    table (`values`) is (the log discount of its prediction's time, agent -> value from the step its
    sum starts at), and a call waiting in the admission queue (`observe_queued`) adds its log
    discount to the keys of its prompt the score shadow holds as a prefix, as the policy adds it to
    the prompt's cached path, until the call finishes."""

    candidate = "pbkv_time"
    entry_type = TimeShadowEntry

    def __init__(self, options: TrustConfig, values: Callable[[str], tuple | None], capacity: float = 0.0):
        super().__init__(options, values, capacity)
        self.queued_keys: dict[str, list] = {}  # queued (or running) sampled workflow -> its keys with the term

    def observe_queued(self, workflow: str, keys: Sequence, term: float) -> None:
        """A call of `workflow` entered the admission queue; `term`: the log discount of the time it came."""
        if not keys or not self.is_sampled(workflow):
            return
        self._unqueue(workflow)
        entries = self.entries
        marked = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or not entry.in_score:
                break  # the cached prefix ends here, as the real tree's path does
            entry.queued[workflow] = term
            entry.rescore()
            marked.append(key)
            self.score_shadow.reorder(entry, entry.locks != 0)
        self.queued_keys[workflow] = marked

    def _unqueue(self, workflow: str) -> None:
        entries = self.entries
        for key in self.queued_keys.pop(workflow, ()):
            entry = entries.get(key)
            if entry is not None and entry.queued.pop(workflow, None) is not None:
                entry.rescore()
                if entry.in_score:
                    self.score_shadow.reorder(entry, entry.locks != 0)

    def observe_insert(self, workflow: str, keys: Sequence, sizes: Sequence, agent: str | None = None) -> None:
        if keys and self.is_sampled(workflow):
            self._unqueue(workflow)  # the call finished: it leaves the queue's reads
        super().observe_insert(workflow, keys, sizes, agent)

    def revise(self, workflow: str) -> None:
        if workflow in self.tables or workflow in self.queued_keys:
            self._revised[workflow] = None

    def _refresh(self) -> None:
        for w in [w for w in self._revised if w in self.queued_keys and self.values(w) is None]:
            self._unqueue(w)  # retired while queued (an aborted call)
        OutcomeTrust._refresh(self)  # cpdef: Cython compiles no zero-argument super() in it


def make_trust(options: TrustConfig, ledger: Ledger, values: Callable[[str], dict | None],
               outcome: type[OutcomeTrust] = OutcomeTrust):
    """The judge of one trust mode, or None for always (nothing to judge). `values`: as the outcome
    judge's (`outcome`: OutcomeTrust for pbkv, TimeOutcomeTrust for pbkv_time)."""
    if options.trust == "accuracy":
        return AccuracyTrust(ledger, options, outcome.candidate)
    if options.trust == "outcome":
        return outcome(options, values)
    return None


def trust_summary(reports: list[dict]) -> dict:
    """The replay's trust fields from each replica's report (engine.simulate): switches summed,
    whether every replica followed the score at the end, rates averaged."""
    if not reports:
        return {}
    out = {"trust_switches": sum(r["trust_switches"] for r in reports),
           "trusted_at_end": all(r["following"] != "pbkv_lae" for r in reports)}
    for name in ("prediction_quality", "shadow_hit_rate_pbkv", "shadow_hit_rate_lae", "shadow_window_hit_rate_pbkv",
                 "shadow_window_hit_rate_lae"):
        if name in reports[0]:
            out[name] = sum(r[name] for r in reports) / len(reports)
    if "shadow_sampled_calls" in reports[0]:
        out["shadow_sampled_calls"] = sum(r["shadow_sampled_calls"] for r in reports)
    return out
