"""When PBKV follows its own score order and when it falls back to lifecycle-aware LRU: the one
implementation of its trust modes, used by the PBKV policy class (policies.py) in the simulator
and in the SGLang plugin.

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
data; sampled as SHARDS samples keys for miss-ratio curves, Waldspurger et al., FAST 2015). Two
miniature caches hold metadata only (content keys, token counts, each one's own keep order, no
KV): one ordered as PBKV's score (retired first, then ascending lookahead score, LRU ties), one as
lifecycle-aware LRU (retired first, then LRU). Both see the same accesses: every call of a sampled
workflow, its prompt's content keys in prefix order (each is a hit in a shadow when it and every
key before it is held there; then all are held) and, once the call finishes, its output's keys.
Each shadow evicts by its own order down to its capacity, and counts the prompt tokens it hit.
Neither shadow depends on which order the real cache follows, so neither is fed back its own
choices. The decision compares the two hit rates over a moving window of sampled calls and flips,
with a margin, to the one that wins.

The sample, and why it is unbiased with prefix sharing. A workflow is sampled when a seeded hash of
its id falls below `outcome_sample` (stable: the same workflows in every run and process, drawn
independently of what they access). Sampling whole workflows rather than keys keeps every sampled
prompt's prefix chain whole, so a shadow hit needs the prefix to be held, as in a radix tree
(sampling keys would sample a child without its parent). The shadows hold a share R =
`outcome_sample` of the GPU capacity. Hits: every access of a sampled workflow is counted,
shared key or not, so a shared prefix read by n workflows is counted for each of the about R n
sampled ones that read it, like private keys: both shadows' hit counts are R times the full
trace's in expectation, and so is their difference, which is all the decision reads. Footprint:
a private key is in the sample with probability R and charged its size s (expected footprint R s,
the scaled cache's share); a key held once for all its readers would be charged s if held at all,
i.e. about 1/R times too much for a prefix that many workflows share. A key read by two or more
sampled workflows is therefore charged R s, its scaled share, exactly for prefixes shared widely
(a system prompt, a task's context); a key shared by few workflows (2 to about 1/R) is over- or
under-charged by less than a factor 1/R. Either way both shadows charge the same key the same,
so the residual bias changes the capacity both compete for, not which order it favours.

Cost: a sampled call touches its keys in both shadows (dict and ordered-dict operations) and, when
a shadow is over its capacity, ranks what that shadow holds once (O(n) scores and a heap) and
evicts down to (1 - `outcome_slack`) x its capacity, so that the next inserts need no ranking;
unsampled calls cost one hash of the workflow id.
A flip changes every node's priority at once: `observe_call` returns True and the simulator
re-heapifies (RadixTree.reprioritize), as the accuracy meter's flips do.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from typing import Callable, Hashable, Protocol, Sequence

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

    def __init__(self, ledger: Ledger, options: TrustConfig):
        self.ledger = ledger
        self.meter = TrustMeter(options.trust_threshold, options.trust_margin, options.trust_window)

    @property
    def trusted(self) -> bool:
        return self.meter.trusted

    @property
    def switches(self) -> int:
        return self.meter.switches

    def observe_call(self, workflow: str, agent: str, keys: Sequence = (), sizes: Sequence = ()) -> bool:
        p = self.ledger.check_prediction(workflow, agent)
        return p is not None and self.meter.update(p)

    def observe_insert(self, workflow: str, keys: Sequence, sizes: Sequence, agent: str | None = None) -> None:
        pass  # the meter reads predictions, not cache contents

    def report(self) -> dict:
        return {"trust": self.mode, "following": "pbkv" if self.trusted else "pbkv_lae",
                "trust_switches": self.switches, "prediction_quality": self.meter.quality}


def sampled(workflow: str, share: float, seed: int) -> bool:
    """Whether a workflow is in the shadows' sample: a seeded hash of its id below `share` (the
    same answer in every process, unlike Python's salted hash of a str)."""
    digest = hashlib.blake2b(f"{seed}\x00{workflow}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < share * 2 ** 64


SAMPLED_MEMO = 65536  # workflows whose sampling is memoised at once (the hash costs about a microsecond)


class ShadowEntry:
    """One content key as the shadows know it: its tokens, the sampled workflows (and their agents)
    that read it, how many distinct ones ever did, and when it was last touched."""

    __slots__ = ("size", "readers", "sharers", "stamp")

    def __init__(self, size: int):
        self.size, self.sharers, self.stamp = size, 0, 0
        self.readers: dict[str, dict[str, None]] = {}  # sampled workflow -> its agents that read the key


class ShadowCache:
    """A metadata-only cache of `capacity` tokens: the keys it holds, in the order they were last
    touched (oldest first), and the tokens charged for each."""

    def __init__(self, name: str, capacity: float):
        self.name, self.capacity = name, capacity
        self.held: OrderedDict[Hashable, float] = OrderedDict()  # key -> tokens charged, least recently touched first
        self.used = 0.0
        self.hit_tokens = 0.0  # prompt tokens hit, decayed over the window (OutcomeTrust)
        self.total_hit_tokens = 0  # prompt tokens hit over the whole run

    def hits(self, keys: Sequence, sizes: Sequence) -> int:
        """Tokens of the longest held prefix of `keys`."""
        hit = 0
        for key, size in zip(keys, sizes):
            if key not in self.held:
                break
            hit += size
        return hit

    def hold(self, key, charge: float) -> None:
        held = self.held
        self.used += charge - held.get(key, 0.0)
        held[key] = charge
        held.move_to_end(key)

    def evict(self, key) -> None:
        self.used -= self.held.pop(key)


class OutcomeTrust:
    """trust=outcome: the score order against lifecycle-aware LRU on two shadow caches over a sample
    of the workflows (module docstring); follows the one with more hits, with hysteresis.

    `values(workflow)`: the workflow's folded prediction values v_w (agent -> value, what PBKV's
    score sums, WorkflowLedger.score; empty before its first prediction), or None once the cache
    has retired it. `capacity`: the real cache's GPU tokens, given by the caller that knows it (the
    simulator's server, the plugin's runtime) through `set_capacity`."""

    mode = "outcome"

    def __init__(self, options: TrustConfig, values: Callable[[str], dict | None], capacity: float = 0.0):
        self.values = values
        self.share, self.seed = options.outcome_sample, options.outcome_seed
        self.margin, self.min_calls, self.z = options.outcome_margin, options.outcome_min_calls, options.outcome_z
        self.slack = options.outcome_slack
        self.decay = 1.0 - 1.0 / options.outcome_window
        self.entries: dict[Hashable, ShadowEntry] = {}  # key -> ShadowEntry, for keys held by either shadow
        self.clock = 0
        self.score_shadow, self.lru_shadow = ShadowCache("pbkv", 0.0), ShadowCache("pbkv_lae", 0.0)
        self.shadows = (self.score_shadow, self.lru_shadow)
        self.prompt_tokens = 0.0  # sampled prompt tokens, decayed like the hit counts
        # decayed sums of d^2, d p and p^2 over sampled calls, d = (lru hits - score hits), p = prompt
        # tokens: the variance of the ratio estimate sum d / sum p (hit_rates' difference)
        self._dd = self._dp = self._pp = 0.0
        self.sampled_calls = 0
        self.trusted, self.switches = True, 0
        self._sampled: dict[str, bool] = {}  # workflow -> is_sampled, memoised (at most SAMPLED_MEMO)
        self.set_capacity(capacity)

    def set_capacity(self, gpu_tokens: float) -> None:
        for shadow in self.shadows:
            shadow.capacity = self.share * gpu_tokens

    # ---------------------------------------------------------------- accesses

    def is_sampled(self, workflow: str) -> bool:
        known = self._sampled.get(workflow)
        if known is None:
            if len(self._sampled) >= SAMPLED_MEMO:  # a long-running server sees workflows without end
                self._sampled.clear()
            known = self._sampled[workflow] = sampled(workflow, self.share, self.seed)
        return known

    def observe_call(self, workflow: str, agent: str, keys: Sequence = (), sizes: Sequence = ()) -> bool:
        """A call arrived with its prompt's content keys (prefix order) and token counts: each shadow
        counts its hits, then holds the prompt. True when the followed order flipped."""
        if not keys or not self.is_sampled(workflow):
            return False
        self.sampled_calls += 1
        prompt, decay = sum(sizes), self.decay
        self.prompt_tokens = self.prompt_tokens * decay + prompt
        hits = []
        for shadow in self.shadows:
            hit = shadow.hits(keys, sizes)
            shadow.hit_tokens = shadow.hit_tokens * decay + hit
            shadow.total_hit_tokens += hit
            hits.append(hit)
        d = hits[1] - hits[0]
        self._dd, self._dp, self._pp = (self._dd * decay + d * d, self._dp * decay + d * prompt,
                                        self._pp * decay + prompt * prompt)
        self._hold(workflow, agent, keys, sizes)
        return self._decide()

    def observe_insert(self, workflow: str, keys: Sequence, sizes: Sequence, agent: str | None = None) -> None:
        """A call finished: its prompt and output (content keys in prefix order) are in the cache."""
        if keys and self.is_sampled(workflow):
            self._hold(workflow, agent, keys, sizes)

    def _hold(self, workflow: str, agent: str | None, keys: Sequence, sizes: Sequence) -> None:
        entries = self.entries
        # touched deepest first, so that a prefix is more recent than what extends it: the LRU
        # ties of both orders then evict leaves before their prefixes, as a radix tree must
        for key, size in zip(reversed(keys), reversed(sizes)):
            entry = entries.get(key)
            if entry is None:
                entry = entries[key] = ShadowEntry(size)
            agents = entry.readers.get(workflow)
            if agents is None:
                agents = entry.readers[workflow] = {}
                entry.sharers += 1
            if agent is not None:
                agents[agent] = None
            self.clock += 1
            entry.stamp = self.clock
            charge = size * self.share if entry.sharers >= 2 else size
            for shadow in self.shadows:
                shadow.hold(key, charge)
        keep = set(keys)  # the call's own keys stay (its path is locked in the real tree)
        for shadow, make_room in ((self.score_shadow, self._evict_by_score), (self.lru_shadow, self._evict_by_lru)):
            if shadow.used > shadow.capacity:
                for key in make_room(shadow, keep, shadow.used - (1 - self.slack) * shadow.capacity):
                    shadow.evict(key)
                    if key not in self.score_shadow.held and key not in self.lru_shadow.held:
                        del entries[key]

    # ---------------------------------------------------------------- the two keep orders

    def _live_values(self, entry: ShadowEntry, cache: dict[str, dict | None]) -> list[tuple[dict, dict]]:
        """The value tables of the entry's readers the cache still follows, with their agents;
        retired readers are dropped. `cache`: workflow -> its table (None: retired), per pass."""
        readers = entry.readers
        if len(readers) == 1:  # the common case: a private key
            (w, agents), = readers.items()
            table = cache[w] if w in cache else cache.setdefault(w, self.values(w))
            if table is None:
                readers.clear()
                return []
            return [(table, agents)]
        tables, gone = [], []
        for w, agents in readers.items():
            table = cache[w] if w in cache else cache.setdefault(w, self.values(w))
            if table is None:
                gone.append(w)
            else:
                tables.append((table, agents))
        for w in gone:
            del readers[w]
        return tables

    def _retired_first(self, shadow: ShadowCache, keep: set, over: float,
                       cache: dict[str, dict | None]) -> tuple[list, float, list]:
        """Both orders evict retired keys (no live reader) first, oldest first: those, until `over`
        tokens are freed; then what is still to free and the live keys seen, oldest first, with their
        value tables (all of them when the retired keys did not suffice)."""
        victims, active, entries = [], [], self.entries
        for key, charge in shadow.held.items():
            if key in keep:
                continue
            tables = self._live_values(entries[key], cache)
            if tables:
                active.append((key, tables))
                continue
            victims.append(key)
            over -= charge
            if over <= 0:
                break
        return victims, over, active

    def _evict_by_lru(self, shadow: ShadowCache, keep: set, over: float) -> list:
        """Lifecycle-aware LRU: retired keys first, then the oldest, until `over` tokens are freed."""
        victims, over, active = self._retired_first(shadow, keep, over, {})
        for key, _ in active:
            if over <= 0:
                break
            victims.append(key)
            over -= shadow.held[key]
        return victims

    def _evict_by_score(self, shadow: ShadowCache, keep: set, over: float) -> list:
        """PBKV's order: retired keys first (oldest first, as their scores tie), then ascending score,
        older first among equals; until `over` tokens are freed. Only when the retired keys do not
        suffice are the live ones scored."""
        victims, over, active = self._retired_first(shadow, keep, over, {})
        if over <= 0:
            return victims
        entries = self.entries
        ranked = [(sum(table.get(a, 0.0) for table, agents in tables for a in agents), entries[key].stamp, key)
                  for key, tables in active]
        heapq.heapify(ranked)
        while over > 0 and ranked:
            key = heapq.heappop(ranked)[2]
            victims.append(key)
            over -= shadow.held[key]
        return victims

    # ---------------------------------------------------------------- decision

    def hit_rates(self) -> tuple[float, float]:
        """(score order, lifecycle-aware LRU): the shadows' GPU hit rates over the window."""
        total = self.prompt_tokens or 1.0
        return self.score_shadow.hit_tokens / total, self.lru_shadow.hit_tokens / total

    def standard_error(self) -> float:
        """Of the windowed difference of the hit rates (lru - score): the ratio estimator's, from the
        decayed per-call sums (delta method)."""
        total = self.prompt_tokens or 1.0
        r = (self.lru_shadow.hit_tokens - self.score_shadow.hit_tokens) / total
        spread = self._dd - 2 * r * self._dp + r * r * self._pp
        return math.sqrt(max(spread, 0.0)) / total

    def _decide(self) -> bool:
        """Flip to the other order once it wins by more than the margin plus z standard errors: a
        large, steady difference flips within a few dozen sampled calls, noise does not."""
        if self.sampled_calls < self.min_calls:  # too little evidence yet: the predictions are trusted
            return False
        score, lru = self.hit_rates()
        bar = self.margin + self.z * self.standard_error()
        trusted = score >= lru - bar if self.trusted else score > lru + bar
        flipped, self.trusted = trusted != self.trusted, trusted
        self.switches += flipped
        return flipped

    def report(self) -> dict:
        score, lru = self.hit_rates()
        return {"trust": self.mode, "following": "pbkv" if self.trusted else "pbkv_lae",
                "trust_switches": self.switches, "shadow_sampled_calls": self.sampled_calls,
                "shadow_hit_rate_pbkv": score, "shadow_hit_rate_lae": lru,
                "shadow_hit_tokens_pbkv": self.score_shadow.total_hit_tokens,
                "shadow_hit_tokens_lae": self.lru_shadow.total_hit_tokens}


def make_trust(options: TrustConfig, ledger: Ledger, values: Callable[[str], dict | None]):
    """The judge of one trust mode, or None for always (nothing to judge). `values`: as OutcomeTrust's."""
    if options.trust == "accuracy":
        return AccuracyTrust(ledger, options)
    if options.trust == "outcome":
        return OutcomeTrust(options, values)
    return None


def trust_summary(reports: list[dict]) -> dict:
    """The replay's trust fields from each replica's report (engine.simulate): switches summed,
    whether every replica followed the score at the end, rates averaged."""
    if not reports:
        return {}
    out = {"trust_switches": sum(r["trust_switches"] for r in reports),
           "trusted_at_end": all(r["following"] == "pbkv" for r in reports)}
    for name in ("prediction_quality", "shadow_hit_rate_pbkv", "shadow_hit_rate_lae"):
        if name in reports[0]:
            out[name] = sum(r[name] for r in reports) / len(reports)
    if "shadow_sampled_calls" in reports[0]:
        out["shadow_sampled_calls"] = sum(r["shadow_sampled_calls"] for r in reports)
    return out
