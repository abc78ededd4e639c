"""PBKV's trust modes (cache/trust.py): the outcome shadows' hit counts and keep orders checked by
hand on a tiny sequence, their incremental orders against a full sort, the locks and capacity of
running calls, the workflow sample, and the decision with its hysteresis."""

import functools
import math
import operator
import random
from collections import Counter

import pytest

from data.errors import ConfigError
from serving_integration.cache.config import TrustConfig
from serving_integration.cache.trust import OutcomeTrust, TimeOutcomeTrust, agents_value, log_sum_exp, sampled, sum_parts

VALUES = {"w1": {"a": 0.0, "c": 1.0}, "w2": {"a": 0.0, "b": 1.0}}  # v_w[agent], as PBKV's ledger folds them


def judge(capacity=12, **options):
    # every option of the decision pinned, so the hand-checked steps do not move with the defaults
    options = {"outcome_sample": 1.0, "outcome_window": 10**6, "outcome_min_calls": 1, "outcome_z": 0.0,
               "outcome_return_z": 1.0, "outcome_cumulative": False, "outcome_margin": 0.001,
               "outcome_slack": 0.0, **options}
    live = dict.fromkeys(VALUES)
    trust = OutcomeTrust(TrustConfig(**options), lambda w: VALUES[w] if w in live else None)
    trust.set_capacity(capacity / trust.share)  # the shadows hold share x the GPU tokens
    return trust, live


def held(trust):
    return sorted(trust.score_shadow.held), sorted(trust.lru_shadow.held)


def run_call(trust, w, agent, keys, sizes, gpu_cached=None):
    """A call admitted and finished at once (no output): matched, then its prompt held; `gpu_cached`:
    the real cache's GPU hits told with it."""
    flipped = trust.observe_call(w, agent, keys, sizes, None, gpu_cached)
    trust.observe_insert(w, keys, sizes, agent)
    return flipped


def test_shadow_hits_and_keep_orders_by_hand():
    trust, _ = judge()
    call = lambda w, agent, *keys: run_call(trust, w, agent, keys, [4] * len(keys))
    call("w1", "c", "X")
    call("w1", "a", "S")
    call("w2", "b", "T")
    assert held(trust) == (["S", "T", "X"], ["S", "T", "X"]) and trust.lru_shadow.used == 12
    call("w2", "a", "S")  # a hit in both; S is shared now
    assert (trust.score_shadow.total_hit_tokens, trust.lru_shadow.total_hit_tokens) == (4, 4)
    # V needs room: LRU drops X (the oldest); the score drops S (no live reader's agent is predicted:
    # 0 + 0), not X (v_w1[c] = 1) or T (v_w2[b] = 1)
    call("w1", "a", "V")
    assert held(trust) == (["T", "V", "X"], ["S", "T", "V"])
    assert trust.trusted
    # S again: a hit for LRU only (8 against 4 tokens so far): past the (tiny) margin the order flips to LRU
    assert call("w2", "a", "S") is True and not trust.trusted and trust.switches == 1
    assert (trust.score_shadow.total_hit_tokens, trust.lru_shadow.total_hit_tokens) == (4, 8)
    assert held(trust)[0] == ["S", "T", "X"]  # the score shadow made room by V (score 0), kept X and T
    # X again: a hit for the score only; 8 against 8 is no win, so LRU stays followed (hysteresis)
    assert call("w1", "c", "X") is False and not trust.trusted
    assert (trust.score_shadow.total_hit_tokens, trust.lru_shadow.total_hit_tokens) == (8, 8)
    report = trust.report()
    assert report["following"] == "pbkv_lae" and report["shadow_sampled_calls"] == 7
    assert report["shadow_hit_rate_pbkv"] == report["shadow_hit_rate_lae"] == 8 / 28  # the whole run: 7 x 4 tokens


def test_a_prompt_hits_only_as_far_as_its_prefix_is_held():
    trust, _ = judge(capacity=100)
    run_call(trust, "w1", "a", ["P", "Q"], [10, 5])
    trust.score_shadow.evict(trust.entries["P"])  # a hole at the root of the chain
    trust.observe_call("w2", "b", ["P", "Q", "R"], [10, 5, 7])
    assert trust.score_shadow.total_hit_tokens == 0 and trust.lru_shadow.total_hit_tokens == 15


def test_retired_readers_go_first_in_both_orders_and_outputs_are_held():
    trust, live = judge(capacity=12)
    run_call(trust, "w2", "b", ["T"], [4])
    trust.observe_call("w1", "c", ["X"], [4])
    assert held(trust) == (["T"], ["T"])  # a prompt is held once its call finishes, as the real cache inserts it
    trust.observe_insert("w1", ["X", "Xout"], [4, 4], "c")  # the call's output joins its prompt
    assert held(trust) == (["T", "X", "Xout"], ["T", "X", "Xout"])
    del live["w1"]  # the cache retired w1: its keys have no live reader
    trust.revise("w1")  # as the ledger tells its listeners
    run_call(trust, "w2", "b", ["T", "U"], [4, 4])
    # both drop retired Xout first, not the live T, not X (Xout is older than X: prefixes are
    # touched after what extends them)
    assert held(trust) == (["T", "U", "X"], ["T", "U", "X"])


def test_a_running_calls_keys_stay_and_its_memory_shrinks_the_shadows():
    trust, _ = judge(capacity=12)
    run_call(trust, "w1", "c", ["A"], [4])
    run_call(trust, "w2", "b", ["C"], [4])
    run_call(trust, "w2", "b", ["D"], [4])
    trust.set_capacity(8 / trust.share)  # running calls now hold 4 of the 12 tokens outside the cache
    trust.observe_call("w1", "c", ["A", "B"], [4, 4])  # A is matched and locked while the call runs
    # both shadows make room at once; the oldest, A, is locked, so C goes (in the score order too:
    # C has score 1 as A has, and is older among the unlocked)
    assert held(trust) == (["A", "D"], ["A", "D"]) and trust.locked == {"A": 1, "B": 1}
    trust.set_capacity(12 / trust.share)
    trust.observe_insert("w1", ["A", "B"], [4, 4], "c")
    assert held(trust) == (["A", "B", "D"], ["A", "B", "D"]) and not trust.locked and not trust.running


def test_with_a_host_tier_the_prefix_the_server_had_is_held_from_admission():
    """The real server loads a host hit back at admission, and the next call reads it from the GPU:
    a shadow holds the prefix the server had from then on (cached=8: both keys), not at the finish."""
    trust, _ = judge(capacity=100)
    trust.set_capacity(100, host_tier=True)
    trust.observe_call("w1", "c", ["A", "B"], [4, 4], cached=8)
    assert held(trust) == (["A", "B"], ["A", "B"]) and trust.score_shadow.total_hit_tokens == 0
    trust.observe_call("w2", "b", ["A", "C"], [4, 4], cached=4)
    assert trust.score_shadow.total_hit_tokens == trust.lru_shadow.total_hit_tokens == 4
    assert held(trust) == (["A", "B"], ["A", "B"])  # without a host tier C is recomputed: held at its insert


def test_without_a_host_tier_what_the_server_had_and_a_shadow_did_not_is_its_room_less():
    """The real cache held A and B (8 tokens in its tree while the call runs) and the shadows did not:
    they would recompute them outside their tree, so their room is 12 - 8 until the call finishes."""
    trust, _ = judge(capacity=12)
    run_call(trust, "w2", "b", ["C"], [4])
    run_call(trust, "w2", "b", ["D"], [4])
    trust.observe_call("w1", "c", ["A", "B"], [4, 4], cached=8)
    assert held(trust) == (["D"], ["D"])  # C, the oldest, made room
    assert trust.score_shadow.reserved == trust.lru_shadow.reserved == 8
    trust.observe_insert("w1", ["A", "B"], [4, 4], "c")
    assert held(trust) == (["A", "B", "D"], ["A", "B", "D"]) and trust.score_shadow.reserved == 0


# lowest evicted first: retired keys first; then PBKV's ascending score, or LRU's; oldest first
RANKS = {"pbkv": lambda e: (1, e.score, e.stamp) if e.readers else (0, 0.0, e.stamp),
         "pbkv_lae": lambda e: (1 if e.readers else 0, e.stamp)}


def streamed_judge(judge_type, **options):
    """A judge after a random stream of calls (queued first, for pbkv_time's judge), inserts, new
    predictions and retirements, over keys that six workflows share in part, in a cache of 60 tokens."""
    rng = random.Random(0)
    timed = judge_type is TimeOutcomeTrust
    table = lambda: {a: rng.choice([0.0, 0.5, rng.random()]) for a in "abc"}
    tables = {f"w{i}": (-rng.random() * 50, table()) if timed else table() for i in range(6)}
    live = set(tables)
    trust = judge_type(TrustConfig(outcome_sample=1.0, outcome_slack=0.0, **options),
                       lambda w: tables[w] if w in live else None)
    trust.set_capacity(60)
    running = {}
    for step in range(400):
        w = rng.choice(sorted(tables))
        if w in running:
            trust.observe_insert(w, *running.pop(w), rng.choice("abc"))
        else:
            keys = [f"{w[1] if rng.random() < 0.5 else 's'}{j}" for j in range(rng.randint(1, 4))]
            running[w] = (keys, [rng.randint(1, 6) for _ in keys])
            if timed:
                trust.observe_queued(w, keys, -step / 10)
            trust.observe_call(w, rng.choice("abc"), *running[w])
        if rng.random() < 0.2:  # a new prediction
            w = rng.choice(sorted(tables))
            tables[w] = (-step / 10, table()) if timed else table()
            trust.revise(w)
        if rng.random() < 0.05:
            w = rng.choice(sorted(tables))
            live ^= {w}  # retired, or live again
            trust.revise(w)
    trust._refresh()
    assert trust.locked and any(not e.readers for e in trust.entries.values())  # the stream reached both cases
    if timed:
        assert any(e.queued for e in trust.entries.values())
    return trust


def assert_slots_are_known(trust, shadow):
    """Each record in the shadow's heap knows its slot there, and every other record knows it is not in it."""
    slot = (lambda e: e.score_slot) if shadow.by_score else (lambda e: e.lru_slot)
    assert [slot(e) for e in shadow.order] == list(range(len(shadow.order)))
    assert all(slot(e) == -1 for e in trust.entries.values() if e not in shadow.order)


@pytest.mark.parametrize("unit", ["key", "node"])
@pytest.mark.parametrize("judge_type", [OutcomeTrust, TimeOutcomeTrust])
def test_each_record_knows_what_holds_and_locks_its_key(judge_type, unit):
    """After a random stream, a key's record says which shadows hold it, at the charge they hold it
    at, and how many running calls read it (what the judge reads instead of looking the key up), and
    the judge keeps a record for exactly the keys a shadow holds or a running call reads."""
    trust = streamed_judge(judge_type, outcome_unit=unit)
    running = Counter(key for calls in trust.running.values() for keys, _ in calls for key in keys)
    assert running and set(trust.entries) == set(trust.score_shadow.held) | set(trust.lru_shadow.held) | set(running)
    for key, entry in trust.entries.items():
        assert (entry.in_score, entry.in_lru) == (key in trust.score_shadow.held, key in trust.lru_shadow.held)
        assert all(shadow.held[key] == entry.charge for shadow in trust.shadows if key in shadow.held)
        assert entry.locks == running[key]


def test_an_aborted_call_leaves_no_record_of_what_it_only_locked():
    trust, live = judge()
    run_call(trust, "w1", "c", ["X"], [4])
    trust.observe_call("w1", "c", ["X", "F"], [4, 4], None)  # admitted; F is in no shadow
    assert trust.locked == {"X": 1, "F": 1} and set(trust.entries) == {"X", "F"}
    del live["w1"]  # retired before the call finished (aborted)
    trust.revise("w1")
    trust._refresh()
    assert not trust.locked and set(trust.entries) == {"X"}


@pytest.mark.parametrize("judge_type", [OutcomeTrust, TimeOutcomeTrust])
def test_the_incremental_orders_are_the_orders_a_full_sort_gives(judge_type):
    """After a random stream, each shadow's heap yields its held, unlocked keys exactly in the order
    of sorting them by their rank now, and each key's record knows its slot in each heap."""
    trust = streamed_judge(judge_type)
    for shadow in trust.shadows:
        assert_slots_are_known(trust, shadow)
        rank = RANKS[shadow.name]
        expected = sorted((k for k in shadow.held if k not in trust.locked), key=lambda k: rank(trust.entries[k]))
        popped = []
        while (entry := shadow.victim()) is not None:
            popped.append(entry.key)
            shadow.evict(entry)
        assert popped == expected, shadow.name


@pytest.mark.parametrize("judge_type", [OutcomeTrust, TimeOutcomeTrust])
def test_node_shadows_evict_the_lowest_ranked_leaf_each_time(judge_type):
    """outcome_unit=node: after a random stream (node evictions in it), each shadow's next victim is
    always its lowest-ranked held, unlocked key without held children, while evicting node by node
    empties it down to what is locked: a key that left the heap as a parent comes back as a leaf."""
    trust = streamed_judge(judge_type, outcome_unit="node")
    for shadow, other in ((trust.score_shadow, trust.lru_shadow), (trust.lru_shadow, trust.score_shadow)):
        rank, evicted = RANKS[shadow.name], 0
        while True:
            assert_slots_are_known(trust, shadow)
            leaves = [k for k in shadow.held if k not in trust.locked and not shadow.children.get(k)]
            entry = shadow.victim(True)
            if entry is None:
                assert not leaves  # what is left is locked or a parent of what is locked
                break
            assert entry.key == min(leaves, key=lambda k: rank(trust.entries[k])), shadow.name
            trust._evict_node(shadow, other, entry.key)
            evicted += 1
        assert evicted > 3


@pytest.mark.parametrize("judge_type", [OutcomeTrust, TimeOutcomeTrust])
def test_each_records_score_is_its_readers_value_made_again(judge_type):
    """After a random stream, each record's score is the one its live readers' tables give, made
    again from scratch: pbkv's the sum of their parts, first reader first; pbkv_time's the
    log-sum-exp of its queued terms and then its readers' terms, however the record got there (a
    reader's part alone, kept as it is, or the terms summed again)."""
    trust = streamed_judge(judge_type)
    timed = judge_type is TimeOutcomeTrust
    one_term = several = 0
    for entry in trust.entries.values():
        parts = {}
        for w in entry.parts:
            offset, table = trust.tables[w] if timed else (None, trust.tables[w])
            part = agents_value(table, entry.readers[w])
            parts[w] = (offset + math.log(part) if part > 0 else -math.inf) if timed else part
        assert entry.parts == parts
        terms = [*entry.queued.values(), *parts.values()] if timed else list(parts.values())
        assert entry.score == (log_sum_exp(terms) if timed else sum(terms, 0.0))
        one_term += len(terms) == 1
        several += len(terms) > 1
    assert one_term and (several or not timed)  # pbkv_time's stream reached both (queued terms make several)


def test_sum_parts_and_agents_value_add_as_sum_does():
    """A key's score (sum_parts) and a reader's part (agents_value) are compiled loops: the very
    floats of adding the same values to 0.0 one by one in the same order (sum() on Python 3.11;
    3.12's sum() of floats compensates, so the reference is the left-to-right sum itself), to the
    bit (none: 0)."""
    def in_order(values):
        return functools.reduce(operator.add, values, 0.0)

    rng = random.Random(0)
    for n in range(12):
        parts = {f"w{i}": rng.uniform(-1, 1) * 10 ** rng.randint(-9, 9) for i in range(n)}
        assert sum_parts(parts).hex() == in_order(parts.values()).hex()
        agents = dict.fromkeys(rng.sample([*parts, "unknown"], k=min(n, 3)))
        assert float(agents_value(parts, agents)).hex() == in_order(parts.get(a, 0.0) for a in agents).hex()


def test_log_sum_exp_reads_its_two_sequences_as_one():
    """Two sequences of terms are the terms of both, in order (to the bit); one term is given as it
    is, none gives -inf; the value is log(sum(exp(x)))."""
    rng = random.Random(3)
    for _ in range(200):
        terms = [rng.choice([-math.inf, rng.uniform(-40, 5)]) for _ in range(rng.randint(0, 6))]
        cut = rng.randint(0, len(terms))
        assert log_sum_exp(terms[:cut], terms[cut:]) == log_sum_exp(terms)
        finite = [x for x in terms if x > -math.inf]
        if finite:
            assert log_sum_exp(terms) == pytest.approx(math.log(sum(math.exp(x) for x in finite)), rel=1e-12)
    assert log_sum_exp([], [-3.25]) == -3.25 and log_sum_exp([]) == -math.inf


def test_a_key_shared_by_sampled_workflows_is_charged_its_share():
    trust, _ = judge(capacity=1000, outcome_sample=0.5)
    assert trust.lru_shadow.capacity == 1000
    trust.score_shadow.capacity = trust.lru_shadow.capacity = 10**6
    w1, w2 = sampled_pair(0.5)
    run_call(trust, w1, "a", ["S", "x"], [100, 10])
    assert trust.lru_shadow.used == 110  # read by one sampled workflow: its full size
    run_call(trust, w2, "a", ["S", "y"], [100, 10])
    assert trust.lru_shadow.used == 50 + 10 + 10  # S, shared: half its tokens (the sample's share of its readers)


def sampled_pair(share, seed=0):
    ids = [f"wf-{i}" for i in range(200) if sampled(f"wf-{i}", share, seed)]
    return ids[0], ids[1]


def test_the_sample_is_seeded_stable_and_of_the_given_share():
    ids = [f"workflow-{i}" for i in range(4000)]
    picked = [w for w in ids if sampled(w, 0.25, 0)]
    assert picked == [w for w in ids if sampled(w, 0.25, 0)]  # stable (no salted hash)
    assert 0.23 < len(picked) / len(ids) < 0.27
    assert set(w for w in ids if sampled(w, 0.1, 0)) <= set(picked)  # nested in the share, per seed
    assert picked != [w for w in ids if sampled(w, 0.25, 1)]
    assert all(sampled(w, 1.0, 0) for w in ids[:50])
    trust, _ = judge(outcome_sample=0.25)
    unsampled = next(w for w in ids if not sampled(w, 0.25, 0))
    assert trust.observe_call(unsampled, "a", ["K"], [5]) is False and trust.sampled_calls == 0


HAND_CHECKED = [("w1", "c", "X"), ("w1", "a", "S"), ("w2", "b", "T"), ("w2", "a", "S"), ("w1", "a", "V"),
                ("w2", "a", "S"), ("w1", "c", "X")]
AFTER_THE_FLIP = [("w2", "b", "T"), ("w1", "c", "X"), ("w2", "b", "T")]  # hits for the score only, or for both


def flips(then=(), sequence=HAND_CHECKED, gpu_cached=None, **options):
    """The calls of the hand-checked sequence (and of `then` after it) at which the order flipped;
    `gpu_cached`: the real cache's GPU hits told at every call."""
    trust, _ = judge(**options)
    return [i for i, (w, agent, key) in enumerate([*sequence, *then], 1)
            if run_call(trust, w, agent, [key], [4], gpu_cached)]


def test_the_flip_waits_for_min_calls_and_for_a_difference_beyond_its_standard_error():
    assert flips() == [6]
    assert flips(outcome_min_calls=7) == []  # 6 sampled calls are too few; at the 7th the hit counts tie
    # at call 6 LRU leads by 4 of 24 prompt tokens (0.167), with a standard error of 0.152
    assert flips(outcome_z=1.0) == [6] and flips(outcome_z=2.0) == []
    assert flips(outcome_margin=0.2) == []


def test_the_return_to_the_score_after_a_fallback_has_its_own_bar():
    # after the flip at call 6, T (call 8) is a hit for the score only: it leads by 12 of 32 tokens
    # against 8 (0.125), with a standard error of 0.212, and leads less at calls 9 and 10
    then = AFTER_THE_FLIP
    assert flips(then, outcome_return_z=1.0) == [6]  # within one standard error: LRU stays followed
    assert flips(then, outcome_return_z=0.0) == [6, 8]  # past the margin alone: back to the score
    assert flips(then, outcome_return_z=0.0, outcome_margin=0.15) == [6]  # the margin bars the return too
    assert flips(outcome_return_z=5.0) == [6]  # leaving the score reads outcome_z only


def test_the_evidence_since_the_last_flip_can_flip_back_where_the_window_does_not():
    # since the flip at call 6, every call was a hit for the score only (call 7: X, 4 tokens against
    # none; call 8: T): a lead of 1.0 with no spread, where the window (here the whole run) still
    # holds the calls before the flip (the score leads by 0.125 at call 8, standard error 0.212)
    then = AFTER_THE_FLIP
    assert flips(then, outcome_return_z=1.0, outcome_cumulative=True) == [6, 7]
    # the evidence since the flip waits for outcome_min_calls calls, as the first decision does
    assert flips(then, outcome_return_z=1.0, outcome_cumulative=True, outcome_min_calls=2) == [6, 8]
    assert flips(then, outcome_return_z=1.0, outcome_cumulative=False, outcome_min_calls=2) == [6]


def test_the_evidence_since_the_start_can_leave_the_score_where_the_window_cannot_tell():
    # LRU's only lead is call 6 (S: 4 tokens against none); call 7 is a miss for both. No decision
    # before call 7 (min_calls); there a window of about 2 calls has LRU ahead by 0.25, under a bar of
    # 0.31 (so short a window has a wide standard error), while over all 7 calls LRU leads by 4 of 28
    # tokens (0.143), standard error 0.132: past the bar
    sequence = [*HAND_CHECKED[:6], ("w1", "a", "N")]
    options = {"outcome_window": 2, "outcome_z": 1.0, "outcome_min_calls": 7}
    assert flips(sequence=sequence, **options) == []
    assert flips(sequence=sequence, outcome_cumulative=True, **options) == [7]


def test_the_real_caches_hits_count_for_the_followed_order_by_their_weight():
    # by default (weight 0) the shadows alone decide, whatever the real cache hit
    assert flips(gpu_cached=0) == flips(gpu_cached=4) == [6]
    # a real cache that hit every prompt whole: the followed score order is never behind
    assert flips(gpu_cached=4, outcome_real_weight=1.0) == []
    # one that hit nothing: LRU's shadow leads at its first hit (S at call 4), before the shadows alone see it
    assert flips(gpu_cached=0, outcome_real_weight=1.0)[0] == 4
    # half the weight: the score's measured hits are half its shadow's and half the real cache's
    trust, _ = judge(outcome_real_weight=0.5)
    trust.observe_call("w1", "c", ["X"], [4], None, 4)
    assert trust.judged == [2.0, 0.0]  # the score's shadow missed X, the real cache hit it; LRU's shadow missed


def test_trust_knobs_are_checked():
    with pytest.raises(ConfigError, match="outcome_sample"):
        TrustConfig(outcome_sample=0)
    with pytest.raises(ConfigError, match="trust"):
        TrustConfig(trust="adaptive")


def test_a_full_shadow_evicts_down_to_its_slack():
    trust, _ = judge(capacity=100, outcome_slack=0.1)
    for i in range(10):
        run_call(trust, "w1", "c", [f"k{i}"], [10])
    assert trust.lru_shadow.used == 100
    run_call(trust, "w1", "c", ["k10"], [10])  # 110 > 100: down to 90 (the two oldest go)
    assert trust.lru_shadow.used == 90 and sorted(trust.lru_shadow.held) == sorted(f"k{i}" for i in range(2, 11))


def test_pbkv_time_judge_keeps_the_queued_calls_keys_until_the_call_finishes():
    """TimeOutcomeTrust: a key's score is pbkv_time's log value, and a queued call's term (its queue
    time) keeps the prefix of its prompt that the score shadow holds, as the policy keeps the cached
    path of a queued call; it leaves when the call finishes."""
    import math

    tables = {"w1": (-1.0, {"a": 0.5}), "w2": (-2.0, {"a": 0.25}), "w3": (0.0, {})}
    trust = TimeOutcomeTrust(TrustConfig(outcome_sample=1.0, outcome_slack=0.0, outcome_min_calls=10**6),
                             lambda w: tables.get(w))
    trust.set_capacity(12)
    run_call(trust, "w1", "a", ["X"], [4])
    run_call(trust, "w2", "a", ["Y"], [4])
    run_call(trust, "w3", "a", ["Z"], [4])
    entries = trust.entries
    assert entries["X"].score == pytest.approx(-1.0 + math.log(0.5)) and entries["Z"].score == -math.inf
    trust.observe_queued("w3", ["Z", "Q"], -0.5)  # Q: not held, the cached prefix ends at Z
    assert trust.queued_keys["w3"] == ["Z"] and entries["Z"].score == -0.5
    run_call(trust, "w2", "a", ["V"], [4])  # room for V: Y goes (the lowest value), not the queued Z
    assert held(trust)[0] == ["V", "X", "Z"]
    trust.observe_call("w3", "a", ["Z"], [4])
    trust.observe_insert("w3", ["Z"], [4], "a")  # the call finished: its queue term goes
    assert "w3" not in trust.queued_keys and entries["Z"].score == -math.inf
    assert trust.report()["following"] == "pbkv_time"


def test_pbkv_time_judge_rescores_a_queued_key_with_its_readers_new_prediction():
    """A key one workflow read and another waits to read: its score is the log-sum-exp of the queued
    term and the reader's term, and a new prediction of the reader changes only the reader's term."""
    tables = {"w1": (-1.0, {"a": 0.5}), "w2": (0.0, {"a": 0.25})}
    trust = TimeOutcomeTrust(TrustConfig(outcome_sample=1.0, outcome_slack=0.0, outcome_min_calls=10**6),
                             lambda w: tables.get(w))
    trust.set_capacity(12)
    run_call(trust, "w1", "a", ["X"], [4])
    trust.observe_queued("w2", ["X"], -0.5)
    x = trust.entries["X"]
    assert x.score == log_sum_exp([-0.5, -1.0 + math.log(0.5)])
    tables["w1"] = (-2.0, {"a": 0.25})
    trust.revise("w1")
    trust._refresh()
    assert x.parts == {"w1": -2.0 + math.log(0.25)} and x.score == log_sum_exp([-0.5, -2.0 + math.log(0.25)])


def test_node_unit_shadows_evict_a_leaf_with_its_node_as_the_server_tree_does():
    """outcome_unit=node: a victim leaf goes with the ancestors that form one node with it (each the
    only held child of the one above, not the end of a held sequence), and a branch point stays;
    key by key (the default) only the victim key goes."""
    def run(unit):
        trust, _ = judge(capacity=24, outcome_unit=unit)
        run_call(trust, "w1", "c", ["S", "A", "B"], [4, 4, 4])  # one node S-A-B
        run_call(trust, "w2", "b", ["S", "T"], [4, 4])  # S branches: S | A-B and S | T
        run_call(trust, "w2", "b", ["S", "T", "U"], [4, 4, 4])  # T is a sequence's end: T | U
        run_call(trust, "w1", "a", ["V"], [8])  # 28 tokens > 24: make room
        return held(trust)[1]

    # lifecycle-aware LRU's victim is the oldest key, the leaf B (a prefix is touched after what
    # extends it); by node A goes with it (B is A's only child, A ends no sequence), not S (a branch)
    assert run("key") == ["A", "S", "T", "U", "V"]
    assert run("node") == ["S", "T", "U", "V"]


def test_node_unit_keeps_a_branch_point_a_node_boundary_after_its_branch_goes():
    """SGLang's nodes never merge: once S branched (S | A and S | T), S ends a node even after the
    branch A is evicted, so evicting T later takes T alone, not S with it."""
    trust, _ = judge(capacity=16, outcome_unit="node")
    run_call(trust, "w1", "c", ["S", "A"], [4, 4])
    run_call(trust, "w2", "b", ["S", "T"], [4, 4])
    run_call(trust, "w1", "a", ["V"], [8])  # 20 > 16: the oldest leaf, A, goes
    assert held(trust)[1] == ["S", "T", "V"]
    run_call(trust, "w1", "a", ["W"], [4])  # 20 > 16 again: T goes, S (a boundary) stays
    assert held(trust)[1] == ["S", "V", "W"]
