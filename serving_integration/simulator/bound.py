"""Offline upper bounds on the prefix hits of one replay, in the style of FOO (Berger, Beckmann and
Harchol-Balter, "Practical Bounds on Optimal Caching with Variable Object Sizes", SIGMETRICS 2018).

Input: the realized request sequence of a simulator run (engine.Server.trace): every request's
admission and finish, in the order the simulator did them, with the prefix units (their prefix
identities, radix.prefix_keys) the request read and their token counts, and its output; and, for
prefetch, the PCIe tokens the run's idle time could carry (`prefetch_budgets`). Output: three
numbers of prompt tokens on that same sequence, with the same GPU capacity C (`gpu_tokens`) and
host capacity H (`host_tokens`):
- `eviction`: no eviction policy gets more GPU hits (points 1-4);
- `prefetch`: no eviction policy with prefetch from the host tier gets more GPU hits (point 5);
- `any_tier`: no policy at all gets more hits in the GPU and host tiers together, so the missed
  (recomputed) prompt tokens are at least the prompt tokens minus this (point 6).

The model, and why it is a bound
--------------------------------
Events e = 0, 1, ... are the admissions and finishes; "gap g" is the time between event g and
event g + 1. A key k (one prompt unit at one prefix position, or a call's output) has a memory
size s_k: the fewest tokens it is ever given (a pruned call may hold fewer tokens of a unit than
another); wherever the cache holds k it holds at least s_k tokens of it.

1. What every policy holds. From its admission A_r to its finish F_r a request r holds all its
   prompt tokens on the GPU: the matched path is loaded back and locked (locked nodes are never
   evicted), the missed tokens and the output are reserved privately. So during every gap the
   GPU holds at least L(g) = sum of s_k over the distinct prompt keys of running requests plus
   their output tokens, whatever the policy did; and L(g) <= C because the run respected C.
2. How a hit happens. A read of k at admission b is a GPU hit only if k is on the GPU at b. The
   cache (either tier) gains a key only when it is accessed: a finish inserts prompt and output
   (radix.RadixTree.insert, the only place nodes and host copies are made). The GPU gains a key
   when it is accessed (an admission loads its matched path back, a finish inserts) or when
   prefetch loads it back from the host (Server._prefetch; the only other call of load_back).
   Without prefetch, k therefore stayed on the GPU through every gap from its previous access
   p to b: the interval (p, b).
3. Intervals that are free. If k is held by a running request r' at gap b - 1, then A_r' <= p
   and F_r' > b (both are accesses of k), so r' holds k through the whole interval: k is counted
   in L already and the hit costs nothing more (the bound counts it as a hit; in the run it may
   have been a private copy and a miss, which only loosens the bound). But where no finish has
   inserted k before b, no tier holds it (2), whatever private copies running requests hold:
   the read is a miss for every policy, and counted so (a cold prefix that concurrent calls
   each prefill, such as a system prompt before its first call finishes). An interval that starts at
   an admission always ends at the request's own finish or at a read while it still runs: free or
   hit-less. First accesses have no interval: always misses. No running request holds the key of
   any other interval in any of its gaps (such a request's admission or finish would lie inside).
4. The eviction LP. Every other interval i = (p, b) starts at a finish; it gets x_i in [0, 1]
   with weight w_i = the tokens read at b and size s_i. For every gap g:
        (G)  sum of s_i x_i over intervals i spanning g  <=  C - L(g),
   because such keys are on the GPU, are not running keys (3), and the running ones take L(g).
   The hits of any run (x_i = 1 for the intervals it kept) satisfy these constraints, so the LP
   optimum plus the free hits bounds its GPU hits. Dropping the host tier, page rounding and the
   order of evictions within an admission only enlarge the feasible set: the result stays an upper
   bound.
4a. Prefix closure. A radix cache matches a prompt from the root: a read hits key k only if it also
   hits every key before k in the prompt (the match stops at the first unit it lacks, and its GPU
   part is a prefix: radix.RadixTree.match). Take the key j just before k in one read at b, and k's
   interval i. If a running request holds j (and a finish inserted it), it holds every key above j
   too: no row. If no finish inserted j before b, no tier holds it (2, 3), so k is a miss: x_i = 0.
   If j has an interval i' ending at b, a hit on k means j stayed on the GPU through i' (2):
        (C)  x_i <= x_i'.
   Every run's 0/1 hits satisfy (C), so adding it keeps the bound. Where j is read with no tokens (a
   pruned call) or has size 0, k gets no row: fewer rows only loosen.
   The three bounds leave (C) out, and where every key is read at its full size (w_i = s_i, as in
   every generated and imported trace; not in a pruned replay) that changes neither the eviction
   optimum nor the any-tier one (the same LP at capacity C + H - L(g)). Every access of k (a read, a
   finish) is an access of j too, so j's last access before b is no earlier than k's: i' lies within
   i (and a finish that inserted k inserted j: no MISSED parent). Along one read's linked keys k_1,
   k_2, ... (each the key before the next), the intervals all end at b - 1 and start no later the
   deeper they lie, so the keys whose interval spans a gap g are the deepest ones, from some depth
   d(g) on. Take any LP solution, and the total T = sum of s x over the chain: refilled from the top
   (k_1 up to x = 1, then k_2, ...), the chain satisfies (C), its value sum w x = T is unchanged,
   and its load on g, T less at most the full sizes above d(g), is no more than before (T less those
   keys' actual load). Chains share no interval, so the refilled solution is feasible and optimal.
   (C) costs 4.5x the solve time (hover, 1,000 workflows, 25,181 intervals, no host tier: 4.0 s
   against 0.9 s) and is asked only where the solution's shape matters: `eviction_solution`, for
   headroom.py.
5. With prefetch. A GPU hit at b whose key left the GPU inside its interval came back by a
   prefetch load (2): y_i in [0, 1], x_i + y_i <= 1 (a hit is one or the other). Every run with
   prefetch satisfies, with its 0/1 values:
        (G') sum of s_i x_i over intervals spanning g + sum of s_i y_i over intervals ending at g
             (read at g + 1)  <=  C - L(g): a y-key is on the GPU when it is read, at the end of
             gap b - 1, beside the kept keys and the running ones;
        (U)  sum of s_i (x_i + y_i) over intervals spanning g  <=  C + H - L(g): a key prefetched
             from the host was in the cache (GPU or host) through its whole interval (2: once in
             neither tier it comes back only by an access), and the cache holds at most C - L(g)
             tokens of keys that are not running on the GPU and H on the host; a node on both
             tiers (write-through) counts once in the union, so this only loosens;
        (P)  for every window W of consecutive gaps: sum of s_i y_i over intervals whose gaps
             lie within W  <=  the PCIe tokens prefetch can load during W: each y-key was loaded
             (at least s_i tokens; prefetch loads whole paths, so more) at least once inside its
             own interval, after it left the GPU, and loads of different intervals are different
             loads (two intervals of one key are disjoint in time).
   The simulator prefetches only in decode-only iterations and in idle time, and loads at most
   the PCIe bandwidth of that time (cost_model.pcie_tokens per window). Each admission records
   the server's clocks, so the seconds of decode and idle time between two consecutive
   admissions are known exactly: `prefetch_budgets` puts their PCIe tokens on the last gap before
   the later admission. That is no loss for (P): an interval that spans any gap between two
   admissions ends at a read, an admission, so it spans the last gap before the later one too.
   Each prefetch round loads whole tokens, at most int(its seconds x the PCIe rate), so the loads
   of a window W are an integer L <= S_W + e, with S_W the sum of W's budgets and e the clocks'
   rounding. `prefetch_budgets` rounds each budget up to a whole token after taking BUDGET_SLACK off
   it; the rounded budgets sum to at least S_W - |W| BUDGET_SLACK, and, being integers, to at least
   L whenever |W| BUDGET_SLACK + e < 1 (a window of fewer than a million gaps). So the rounding keeps
   (P) valid, and it makes equal request sequences give equal budgets: the clocks of two policies
   that admitted the same calls at the same times differ in their last bits (sums in another
   order), and equal budgets let `upper_bounds` answer the second from memory.
   (P) is kept for the windows of two dyadic hierarchies over the gaps that carry a budget
   (offsets 0 and a third of the top window: every interval then lies in a window at most about
   six times its own length); any subset of valid constraints is a relaxation. With H = 0 there
   are no host copies to prefetch (the prefetch bound is the eviction bound); with H > 0 and no
   budget, (P) forces y = 0 and (U) follows from (G'): again the eviction bound.
6. Hits in either tier. A read of k at b is a GPU or host hit only if k stayed in the cache
   (GPU or host) through its interval (2), so with (U) alone on x: the eviction LP with capacity
   C + H - L(g) bounds GPU + host hits of every policy, prefetching or not, and 1 - that bound
   over the prompt tokens bounds recompute_rate (cache/metrics.py: missed prompt tokens over
   prompt tokens; page rounding only adds misses) from below. Write-through does not break it:
   it makes host copies only of keys just inserted and evicts only host-only nodes to make room.
The three LP optima satisfy eviction <= prefetch <= any_tier (each feasible set embeds the
previous one); the results are kept in that order (the maximum of two valid bounds is one).

Solving. The (G), (G') and (U) matrices have consecutive ones in each column (interval
matrices); each is written with one running-load variable z_j per segment between interval
endpoints: z_j = z_{j-1} + (sizes of intervals starting at j) - (sizes of those ending before
j), 0 <= z_j <= min over the segment of the capacity. That takes about 2 nonzeros per interval
instead of one per gap spanned; (P) is written the same way down each hierarchy, one sum
variable per window (itself, plus its two halves), and scipy's HiGHS (scipy.optimize.linprog)
solves it. The any-tier LP is solved first: the prefetch LP's optimum is at most its optimum, and
where its hits, all taken as prefetch hits (x = 0, y = those hits), satisfy (G') and (P) (an O(n
log n) check; (U) they satisfy already), the two optima are equal and the larger LP is not
solved (where PCIe time is plentiful, as on an H100, that is the usual case). Otherwise the
prefetch LP is solved up to max_lp_intervals / PREFETCH_LP_COST intervals (it costs about ten
times the eviction LP), and the any-tier bound stands for it above that. Above
`max_lp_intervals` the cheap PFOO-U-style bound runs instead, for all three bounds (the same
paper's PFOO-U): the sum of all the gap constraints is one knapsack constraint (sum of s_i x len_i
x_i <= sum of capacities), whose fractional optimum, filled greedily by w_i / (s_i len_i), bounds
the LP from above; for prefetch, the knapsack of (U) alone (x + y counted as one variable), which
bounds the any-tier LP and hence the prefetch LP. (C), where asked, adds a row of two nonzeros
per interval below another in its read.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

log = logging.getLogger(__name__)

# The prefetch LP costs about ten times the eviction LP of the same intervals (HiGHS: 8 s against
# 0.8 s at 20,707 intervals, hover's train split at 300k GPU tokens with a 0.2 GB/s host link): it is
# solved up to max_lp_intervals / PREFETCH_LP_COST intervals, above which the any-tier bound stands
PREFETCH_LP_COST = 10

# The state of the key before an interval's key in a read (intervals, point 4a): held by a running
# request (a hit whatever the cache did), and never inserted by a finish (a miss whatever it did)
FREE, MISSED = -2, -1

# What prefetch_budgets takes off each budget before rounding it up to a whole token: more than the
# clocks' rounding, and less than one token over a million gaps (point 5)
BUDGET_SLACK = 1e-6

# Bounds of the sequences solved last in this process, by their LP's inputs: policies that make the
# same request sequence (lru and lifecycle-aware LRU without retirements, a judged policy that never
# switched and its always-trust row) get its bounds without solving the same LPs again
SOLVED_MEMO = 64
_solved: OrderedDict[bytes, "Bounds"] = OrderedDict()

# An event of the abstract sequence: (is_admission, request index, prompt keys, their tokens as
# read, output key or None, output tokens)
Event = tuple


@dataclass
class Bound:
    hit_tokens: float  # upper bound on hit prompt tokens
    # "lp" (HiGHS), "pfoo_u" (the knapsack relaxation) or, for prefetch, "any_tier" (that bound stands)
    method: str
    free_tokens: int  # hits held by a running request (counted without a variable)
    intervals: int  # intervals (LP variables x; with prefetch, as many y again)
    rows: int  # LP rows
    nonzeros: int
    seconds: float


@dataclass
class Bounds:
    """The three bounds of one sequence (module docstring): eviction <= prefetch <= any_tier."""
    eviction: Bound  # GPU hits of any eviction policy (points 1-4)
    prefetch: Bound  # GPU hits of any eviction policy with prefetch (point 5)
    any_tier: Bound  # GPU + host hits of any policy (point 6)


def sequence_from_trace(trace: Sequence) -> list[Event]:
    """The simulator's trace (each Request once when admitted, once when finished) as events."""
    from serving_integration.cache.workload import chain

    seen: dict[int, int] = {}
    events = []
    for r in trace:
        call = r.call
        index = seen.get(id(r))
        if index is None:
            index = seen[id(r)] = len(seen)
            events.append((True, index, call.keys, call.lens, None, call.output_tokens))
        else:
            out = chain(call.keys[-1], call.output_unit) if call.output_tokens > 0 and call.keys else None
            events.append((False, index, call.keys, call.lens, out, call.output_tokens))
    return events


def prefetch_budgets(trace: Sequence, pcie_tokens_per_s: float) -> np.ndarray:
    """PCIe tokens prefetch may load in each gap of the trace's events (point 5): between two
    consecutive admissions the simulator prefetches only in decode iterations and idle time, and
    the admission's clocks (engine.Request.admitted, .clocks: prefill, decode, PCIe, predictor
    seconds so far) give that time: the clock less prefill, PCIe and predictor seconds. The whole
    window's budget is put on the last gap before the later admission, in whole tokens (rounded
    up after BUDGET_SLACK is taken off: point 5)."""
    rounded = np.ceil(clock_budgets(trace, pcie_tokens_per_s) - BUDGET_SLACK)
    return np.where(rounded > 0, rounded, 0.0)  # no -0.0: budgets are compared by their bytes


def clock_budgets(trace: Sequence, pcie_tokens_per_s: float) -> np.ndarray:
    """`prefetch_budgets` as the clocks give them, before rounding (fractions of a token, and the
    clocks' last bits)."""
    budgets = np.zeros(len(trace), dtype=np.float64)
    seen: set[int] = set()
    previous = None  # decode + idle seconds at the previous admission
    for e, r in enumerate(trace):
        if id(r) in seen:
            continue
        seen.add(id(r))
        prefill, _, pcie, predictor = r.clocks
        window = r.admitted - prefill - pcie - predictor
        if previous is not None and e > 0:
            budgets[e - 1] = max(window - previous, 0.0) * pcie_tokens_per_s
        previous = window
    return budgets


def intervals(events: Iterable[Event], capacity: int, keys_out: list | None = None,
              closure_out: list | None = None):
    """(free hit tokens, starts p, ends b - 1, sizes, weights, capacity C - L(g) in each gap);
    `keys_out`, when given, receives each interval's key, in the intervals' order; `closure_out`
    the prefix-closure pairs of point 4a: (interval, the interval of the key before it in the same
    read), or (interval, MISSED) where that key cannot be a hit (no finish inserted it)."""
    events = list(events)
    size: dict = {}
    for _, _, keys, lens, out, out_tokens in events:
        for k, t in zip(keys, lens):
            if t < size.get(k, t + 1):
                size[k] = t
        if out is not None and out_tokens < size.get(out, out_tokens + 1):
            size[out] = out_tokens
    running: dict = {}  # key -> running requests holding it
    last_finish: dict = {}  # key -> its latest access, when that was a finish
    inserted: set = set()  # keys some finish has inserted: the only ones a cache can hold (point 3)
    load, free = 0, 0
    starts, ends, sizes, weights = [], [], [], []
    caps = np.empty(len(events), dtype=np.float64)
    for e, (admit, _, keys, lens, out, out_tokens) in enumerate(events):
        if admit:
            before = None  # the previous key's interval in this read; FREE: certainly kept; MISSED: certainly not
            for k, t in zip(keys, lens):
                if k in running:
                    if k in inserted:
                        free += t
                        before = FREE
                    else:  # only private copies of it exist: a miss, and so is every key below it
                        before = MISSED
                    continue
                p = last_finish.pop(k, None)
                if p is not None and t > 0:
                    if size[k] == 0:
                        free += t
                        before = FREE
                    else:
                        if closure_out is not None and before is not None and before != FREE:
                            closure_out.append((len(starts), before))
                        before = len(starts)
                        starts.append(p)
                        ends.append(e - 1)
                        sizes.append(size[k])
                        weights.append(t)
                        if keys_out is not None:
                            keys_out.append(k)
                elif p is None:  # never inserted: no cache holds it, nor anything below it
                    before = MISSED
                else:  # read with no tokens (a pruned call): no constraint through it
                    before = None
            for k in keys:
                held = running.get(k, 0)
                if not held:
                    load += size[k]
                    last_finish.pop(k, None)
                running[k] = held + 1
            load += out_tokens
        else:
            for k in keys:
                held = running[k] - 1
                if held:
                    running[k] = held
                else:
                    del running[k]
                    load -= size[k]
                last_finish[k] = e
            inserted.update(keys)
            load -= out_tokens
            if out is not None:
                last_finish[out] = e
                inserted.add(out)
        caps[e] = capacity - load
    return (free, np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64),
            np.asarray(sizes, dtype=np.float64), np.asarray(weights, dtype=np.float64), np.maximum(caps, 0.0))


def upper_bound(events: Iterable[Event], capacity: int, max_lp_intervals: int = 300_000) -> Bound:
    """The eviction-only bound (points 1-4) on GPU hits."""
    return upper_bounds(events, capacity, max_lp_intervals=max_lp_intervals).eviction


def upper_bounds(events: Iterable[Event], capacity: int, host_capacity: int = 0, pcie: np.ndarray | None = None,
                 max_lp_intervals: int = 300_000, reuse: bool = True) -> Bounds:
    """The three bounds of the module docstring; `pcie`: prefetch's PCIe tokens per gap (None: none).
    `reuse`: answer LP inputs solved before in this process from memory (the same Bounds object,
    its `seconds` those of the first solve); False solves them again (to time the solver)."""
    started = time.perf_counter()
    free, a, b, s, w, caps = intervals(events, capacity)
    if not reuse:
        return _solve_bounds(free, a, b, s, w, caps, host_capacity, pcie, max_lp_intervals, started)
    key = _inputs_key(free, host_capacity, max_lp_intervals, a, b, s, w, caps, pcie)
    bounds = _solved.get(key)
    if bounds is not None:
        _solved.move_to_end(key)
        return bounds
    bounds = _solved[key] = _solve_bounds(free, a, b, s, w, caps, host_capacity, pcie, max_lp_intervals, started)
    if len(_solved) > SOLVED_MEMO:
        _solved.popitem(last=False)
    return bounds


def _inputs_key(*inputs) -> bytes:
    """A digest of the LPs' inputs: equal inputs, equal bounds."""
    digest = hashlib.blake2b(digest_size=16)
    for part in inputs:
        if isinstance(part, np.ndarray):
            digest.update(f"{part.dtype}{part.shape}".encode())
            digest.update(np.ascontiguousarray(part).tobytes())
        elif part is not None and not np.isscalar(part):  # a list of PCIe budgets
            digest.update(np.asarray(part, dtype=np.float64).tobytes())
        else:
            digest.update(repr(part).encode())
        digest.update(b"|")
    return digest.digest()


def _solve_bounds(free, a, b, s, w, caps, host_capacity, pcie, max_lp_intervals, started) -> Bounds:
    """upper_bounds' three bounds from the sequence's intervals (`intervals`)."""
    n = len(a)
    if n == 0:
        none = Bound(float(free), "lp", free, 0, 0, 0, time.perf_counter() - started)
        return Bounds(none, none, none)
    cheap = n > max_lp_intervals

    def finish(value, method, rows, nnz, since):
        return Bound(free + value, method, free, n, rows, nnz, time.perf_counter() - since)

    def eviction_lp(capacities, since):
        """(the bound, the LP's hits x or None) of the eviction LP with these capacities."""
        solved = None if cheap else _eviction_lp(a, b, s, w, capacities)
        if solved is None:  # above the size limit, or the solver failed: the relaxation still bounds it
            return finish(_knapsack(a, b, s, w, capacities), "pfoo_u", 1, n, since), None
        value, rows, nonzeros, hits = solved
        return finish(value, "lp", rows, nonzeros, since), hits

    eviction, _ = eviction_lp(caps, started)
    if host_capacity <= 0:  # no host copies: nothing to prefetch, no host hits (points 5 and 6)
        return Bounds(eviction, eviction, eviction)
    since = time.perf_counter()
    any_tier, hits = eviction_lp(caps + host_capacity, since)
    any_tier = _at_least(any_tier, eviction)
    budgets = np.zeros(len(caps)) if pcie is None else np.asarray(pcie, dtype=np.float64)
    since = time.perf_counter()
    if not budgets.any():  # no PCIe time for prefetch: (P) forces y = 0 (point 5)
        prefetch = eviction
    elif hits is None or _all_prefetched(a, b, s, hits, caps, budgets):
        # the any-tier bound bounds the prefetch LP (point 5); where its hits, all taken as prefetch
        # hits (x = 0, y = those hits), are feasible for the prefetch LP, it is that LP's optimum
        prefetch = finish(any_tier.hit_tokens - free, any_tier.method, 0, 0, since)
    else:
        solved = (_prefetch_lp(a, b, s, w, caps, caps + host_capacity, budgets)
                  if n * PREFETCH_LP_COST <= max_lp_intervals else None)
        prefetch = (finish(solved[0], "lp", *solved[1:], since) if solved is not None  # else the any-tier bound stands
                    else finish(any_tier.hit_tokens - free, "any_tier", 0, 0, since))
    prefetch = _at_least(prefetch, eviction)
    return Bounds(eviction, prefetch, _at_least(any_tier, prefetch))


def eviction_solution(events: Iterable[Event], capacity: int, max_lp_intervals: int = 300_000):
    """The eviction LP's intervals and its optimal x (points 4, 4a), for analyses of where its hits
    come from (headroom.py): (free tokens, starts, ends, sizes, weights, keys, x); x is None above
    `max_lp_intervals` or if HiGHS fails."""
    keys: list = []
    closure: list = []
    free, a, b, s, w, caps = intervals(events, capacity, keys, closure)
    solved = _eviction_lp(a, b, s, w, caps, closure) if 0 < len(a) <= max_lp_intervals else None
    x = solved[3] if solved is not None else (np.zeros(0) if len(a) == 0 else None)
    return free, a, b, s, w, keys, x


def integer_solution(events: Iterable[Event], capacity: int, node_limit: int,
                     max_lp_intervals: int = 300_000) -> tuple[float, float] | None:
    """How far the eviction LP (points 4, 4a) is from its integer optimum, on the same model: the
    LP with every x_i in {0, 1} (a key kept through its whole interval or not), solved by HiGHS's
    branch and bound up to `node_limit` nodes (a count, not a time: the same answer on every run).
    Returns (plan, dual) in prompt tokens, free hits included: `plan` is the best 0/1 solution it
    found (it satisfies (G) and (C), so the integer optimum is at least it), `dual` its proven
    upper bound on the integer optimum (at most the LP's optimum: any run's hits are a 0/1 point,
    so `dual` bounds them too). dual - plan is what the search left open; LP - plan bounds the
    relaxation's integrality gap. None above `max_lp_intervals`, or when HiGHS found no 0/1 solution."""
    from scipy.optimize import Bounds as VariableBounds
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import coo_matrix

    closure: list = []
    free, a, b, s, w, caps = intervals(events, capacity, closure_out=closure)
    n = len(a)
    if n == 0:
        return float(free), float(free)
    if n > max_lp_intervals:
        return None
    (rows, cols, vals), n_seg, upper, prefix = _eviction_rows(a, b, s, caps, closure)
    constraints = [LinearConstraint(coo_matrix((vals, (rows, cols)), shape=(n_seg, n + n_seg)).tocsr(), 0, 0)]
    if prefix is not None:
        constraints.append(LinearConstraint(prefix, -np.inf, 0))
    res = milp(np.concatenate([-w, np.zeros(n_seg)]), constraints=constraints, bounds=VariableBounds(0, upper),
               integrality=np.concatenate([np.ones(n), np.zeros(n_seg)]), options={"node_limit": node_limit})
    if res.x is None or res.mip_dual_bound is None or not np.isfinite(res.mip_dual_bound):
        return None
    # the dual bound carries HiGHS's relative tolerance as the LP's does (_eviction_lp): the same margin
    return free + float(w @ np.round(res.x[:n])), free - float(res.mip_dual_bound) + 1e-6 * float(w.sum())


def _at_least(bound: Bound, lower: Bound) -> Bound:
    """`bound`, raised to `lower` where the solver's tolerance put it below (both are valid bounds)."""
    if bound.hit_tokens >= lower.hit_tokens:
        return bound
    return Bound(lower.hit_tokens, bound.method, bound.free_tokens, bound.intervals, bound.rows, bound.nonzeros,
                 bound.seconds)


def _chain(starts, ends, sizes, columns, caps, first_row: int, first_z: int):
    """One running-load chain (module docstring, Solving) for the items (start gap, end gap, size,
    column): COO (rows, cols, vals) of its equality rows, and the z variables' upper bounds."""
    points = np.unique(np.concatenate([starts, ends + 1]))  # segment j covers gaps points[j] .. points[j+1]-1
    seg_caps = np.minimum.reduceat(caps[: points[-1]], points[:-1])
    n_seg = len(points) - 1
    first = np.searchsorted(points, starts)
    after = np.searchsorted(points, ends + 1)  # the segment just past the item
    # rows j: z_j - z_{j-1} - sum_{first = j} size x + sum_{after = j} size x = 0
    inside = after < n_seg
    seg = np.arange(n_seg)
    rows = np.concatenate([first, after[inside], seg, seg[1:]]) + first_row
    cols = np.concatenate([columns, columns[inside], first_z + seg, first_z + seg[:-1]])
    vals = np.concatenate([-sizes, sizes[inside], np.ones(n_seg), -np.ones(n_seg - 1)])
    return (rows, cols, vals), seg_caps


def _budget_spans(a, b, budgets):
    """The gaps with a PCIe budget, and for each interval the first and last of them it spans (lo >
    hi: none); the cumulative budgets (0 first); the offsets of the two hierarchies of (P)."""
    positions = np.flatnonzero(budgets > 0)
    lo = np.searchsorted(positions, a, side="left")
    hi = np.searchsorted(positions, b, side="right") - 1
    cum = np.concatenate([[0.0], np.cumsum(budgets[positions])])
    m = len(positions)
    return lo, hi, cum, sorted({0, (1 << int(m - 1).bit_length()) // 3})


def _windows(lo, hi, m: int, offset: int):
    """Per item, the level and index of the smallest window of the hierarchy shifted by `offset`
    that holds its budget span (a window at level l, index c: positions c 2^l .. (c+1) 2^l - 1,
    shifted); the top level; per level, the sorted windows that hold some item's span."""
    start, stop = lo + offset, hi + offset
    top = int(m - 1 + offset).bit_length()
    level = np.zeros(len(lo), dtype=np.int64)
    for bit in range(top + 1):  # the bit length of start ^ stop: the level of the smallest window holding both
        level += (start >> bit) != (stop >> bit)
    window = start >> level
    by_level = []
    for lvl in range(top + 1):
        here = level <= lvl
        by_level.append(np.unique(window[here] >> (lvl - level[here])))
    return level, window, top, by_level


def _window_budgets(cells, lvl: int, offset: int, cum):
    m = len(cum) - 1
    begin = np.clip((cells << lvl) - offset, 0, m)
    end = np.clip(((cells + 1) << lvl) - offset, 0, m)
    return cum[end] - cum[begin]


def _all_prefetched(a, b, s, hits, caps, budgets, tolerance: float = 1e-6) -> bool:
    """Whether x = 0, y = `hits` satisfies the prefetch LP's (G') and (P) (its (U) holds for the
    any-tier LP's hits): then that LP's optimum is the any-tier one."""
    loads = s * np.clip(hits, 0.0, 1.0)
    at_read = np.zeros(len(caps))
    np.add.at(at_read, b, loads)  # (G') with x = 0: what is read next, on the gap before
    if np.any(at_read > caps + tolerance * (1 + caps)):
        return False
    lo, hi, cum, offsets = _budget_spans(a, b, budgets)
    has = lo <= hi
    if np.any(loads[~has] > tolerance):  # no PCIe time inside the interval
        return False
    for offset in offsets:
        level, window, top, by_level = _windows(lo[has], hi[has], len(cum) - 1, offset)
        for lvl in range(top + 1):
            here = level <= lvl
            cells = by_level[lvl]
            total = np.zeros(len(cells))
            np.add.at(total, np.searchsorted(cells, window[here] >> (lvl - level[here])), loads[has][here])
            budget = _window_budgets(cells, lvl, offset, cum)
            if np.any(total > budget + tolerance * (1 + budget)):
                return False
    return True


def _hierarchy(lo, hi, sizes, columns, cum_budget, offset: int, first_row: int, first_sum: int):
    """(P) over one dyadic hierarchy of windows of budget positions shifted by `offset`: for every
    window that contains the budget span [lo, hi] of some item, one sum variable S = the sizes x
    columns of the items whose smallest containing window it is + S of its two halves, at most the
    window's budget (`cum_budget`: cumulative budgets, 0 first). COO (rows, cols, vals) and the S
    variables' upper bounds."""
    level, window, top, by_level = _windows(lo, hi, len(cum_budget) - 1, offset)
    first_id = np.concatenate([[0], np.cumsum([len(cells) for cells in by_level])])  # per level, its first S
    total = int(first_id[-1])
    item_rows = np.empty(len(lo), dtype=np.int64)
    for lvl in range(top + 1):
        at = level == lvl
        item_rows[at] = first_row + first_id[lvl] + np.searchsorted(by_level[lvl], window[at])
    rows, cols, vals = [item_rows, first_row + np.arange(total)], [columns, first_sum + np.arange(total)], \
        [-sizes, np.ones(total)]
    upper = np.empty(total)
    for lvl in range(top + 1):
        cells = by_level[lvl]
        ids = first_id[lvl] + np.arange(len(cells))
        upper[ids] = _window_budgets(cells, lvl, offset, cum_budget)
        below = by_level[lvl - 1] if lvl else ()
        if len(below):
            for half in (0, 1):
                child = 2 * cells + half
                at = np.minimum(np.searchsorted(below, child), len(below) - 1)
                found = below[at] == child
                rows.append(first_row + ids[found])
                cols.append(first_sum + first_id[lvl - 1] + at[found])
                vals.append(-np.ones(int(found.sum())))
    return (np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)), upper


def _solve(cost, blocks, n_rows: int, n_cols: int, upper, a_ub=None, b_ub=None):
    """linprog (HiGHS) over equality rows from COO `blocks`, 0 <= variables <= upper; (value or None
    if HiGHS failed, nonzeros, solution)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    rows, cols, vals = (np.concatenate(part) for part in zip(*blocks))
    matrix = coo_matrix((vals, (rows, cols)), shape=(n_rows, n_cols)).tocsr()
    bounds = np.column_stack([np.zeros(n_cols), upper])
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=matrix, b_eq=np.zeros(n_rows), bounds=bounds, method="highs")
    nonzeros = matrix.nnz + (a_ub.nnz if a_ub is not None else 0)
    return (None if res.status != 0 else -float(res.fun)), nonzeros, res.x


def _closure_rows(closure, n_cols: int, upper: np.ndarray):
    """(C) of point 4a as rows `A x <= 0`: x_child - x_parent, a row per pair of `closure` (child
    interval, parent interval); a child whose parent is MISSED gets upper bound 0 in `upper`
    instead. None when no row is left."""
    from scipy.sparse import coo_matrix

    pairs = np.asarray(closure, dtype=np.int64).reshape(-1, 2)
    missed = pairs[:, 1] == MISSED
    upper[pairs[missed, 0]] = 0.0
    pairs = pairs[~missed]
    m = len(pairs)
    if not m:
        return None
    rows = np.tile(np.arange(m), 2)
    vals = np.concatenate([np.ones(m), -np.ones(m)])
    return coo_matrix((vals, (rows, pairs.T.ravel())), shape=(m, n_cols)).tocsr()


def _eviction_rows(a, b, s, caps, closure=()):
    """The eviction LP's constraints (points 4, 4a) over the columns x, then the chain's z: the chain's
    COO equality rows, their number, the columns' upper bounds and the (C) rows (None: none)."""
    n = len(a)
    block, seg_caps = _chain(a, b, s, np.arange(n), caps, 0, n)
    n_seg = len(seg_caps)
    upper = np.concatenate([np.ones(n), seg_caps])
    return block, n_seg, upper, _closure_rows(closure, n + n_seg, upper)


def _eviction_lp(a, b, s, w, caps, closure=()):
    """(value, rows, nonzeros, x) of the eviction LP (points 4, 4a) with capacities `caps`; None if HiGHS fails."""
    n = len(a)
    block, n_seg, upper, prefix = _eviction_rows(a, b, s, caps, closure)
    value, nonzeros, solution = _solve(np.concatenate([-w, np.zeros(n_seg)]), [block], n_seg, n + n_seg, upper,
                                       prefix, None if prefix is None else np.zeros(prefix.shape[0]))
    if value is None:
        return None
    # HiGHS's optimality tolerances are relative (1e-7): add a margin so rounding can only loosen it
    rows = n_seg + (0 if prefix is None else prefix.shape[0])
    return value + 1e-6 * float(w.sum()), rows, nonzeros, solution[:n]


def _prefetch_lp(a, b, s, w, caps, union_caps, budgets):
    """(value, rows, nonzeros) of the prefetch LP (point 5): columns x, y, then the chains' z and
    the hierarchies' S; None if HiGHS fails."""
    from scipy.sparse import coo_matrix

    n = len(a)
    xs, ys = np.arange(n), n + np.arange(n)
    items = lambda *parts: [np.concatenate(p) for p in zip(*parts)]  # noqa: E731
    # (G'): x over its interval, y on its last gap; (U): x and y over the interval
    blocks, upper, n_rows = [], [np.ones(2 * n)], 0
    for (starts, ends, sizes, columns), capacities in (
            (items((a, b, s, xs), (b, b, s, ys)), caps), (items((a, b, s, xs), (a, b, s, ys)), union_caps)):
        block, seg_caps = _chain(starts, ends, sizes, columns, capacities, n_rows, 2 * n + n_rows)
        blocks.append(block)
        upper.append(seg_caps)
        n_rows += len(seg_caps)
    # (P): the budget positions (gaps with a budget) within each interval
    lo, hi, cum, offsets = _budget_spans(a, b, budgets)
    has = lo <= hi
    upper[0][ys[~has]] = 0.0  # no PCIe time inside the interval: no prefetch hit
    for offset in offsets:
        block, sums = _hierarchy(lo[has], hi[has], s[has], ys[has], cum, offset, n_rows, 2 * n + n_rows)
        blocks.append(block)
        upper.append(sums)
        n_rows += len(sums)
    one_hit = coo_matrix((np.ones(2 * n), (np.concatenate([xs, xs]), np.concatenate([xs, ys]))),
                         shape=(n, 2 * n + n_rows)).tocsr()  # x_i + y_i <= 1
    cost = np.concatenate([-w, -w, np.zeros(n_rows)])
    value, nonzeros, _ = _solve(cost, blocks, n_rows, 2 * n + n_rows, np.concatenate(upper), one_hit, np.ones(n))
    if value is None:
        return None
    return value + 1e-6 * float(w.sum()), n_rows + n, nonzeros


def _knapsack(a, b, s, w, caps) -> float:
    """Fractional optimum of the sum of the gap constraints (PFOO-U): sum s_i len_i x_i <= budget."""
    lengths = (b - a + 1).astype(np.float64)
    covered = np.zeros(len(caps) + 1)
    np.add.at(covered, a, 1)
    np.add.at(covered, b + 1, -1)
    budget = float(caps[np.cumsum(covered)[:-1] > 0].sum())
    cost = s * lengths
    order = np.argsort(-(w / cost), kind="stable")
    filled = np.cumsum(cost[order])
    full = np.searchsorted(filled, budget, side="right")
    value = float(w[order[:full]].sum())
    if full < len(order):
        left = budget - (filled[full - 1] if full else 0.0)
        value += float(w[order[full]]) * left / float(cost[order[full]])
    return value


def row_bounds(per_server: list[Bounds], prompt_tokens: int) -> dict:
    """A row's bound fields (named in experiments/rows.py ROW_METRIC_DEFAULTS) from each replica's
    bounds on the calls routed to it, summed: hits are per replica, so the sum bounds the cluster."""
    def total(kind: str) -> float:
        return min(sum(getattr(b, kind).hit_tokens for b in per_server), prompt_tokens)

    parts = [getattr(b, kind) for b in per_server for kind in ("eviction", "prefetch", "any_tier")]
    # a bound that stands for another (no host) is counted once; replicas with equal sequences share
    # one Bounds (upper_bounds' reuse) and are counted each
    seen = [p for b in per_server for p in {id(p): p for p in (b.eviction, b.prefetch, b.any_tier)}.values()]
    for part in seen:
        log.info("bound: %s over %d intervals, %d rows, %d nonzeros in %.3f s", part.method, part.intervals,
                 part.rows, part.nonzeros, part.seconds)  # wall time stays out of the (reproducible) row
    rate = (lambda tokens: tokens / prompt_tokens) if prompt_tokens else (lambda tokens: 0.0)
    return {"bound_hit_rate": rate(total("eviction")), "bound_prefetch_hit_rate": rate(total("prefetch")),
            "bound_recompute_rate": 1.0 - rate(total("any_tier")) if prompt_tokens else 0.0,
            "bound_hit_tokens": total("eviction"), "bound_method": "+".join(dict.fromkeys(p.method for p in parts)),
            "bound_intervals": sum(b.eviction.intervals for b in per_server),
            "bound_rows": sum(p.rows for p in seen), "bound_nonzeros": sum(p.nonzeros for p in seen)}
