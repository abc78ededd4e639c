"""An offline upper bound on the GPU-tier prefix hits of one replay, in the style of FOO
(Berger, Beckmann and Harchol-Balter, "Practical Bounds on Optimal Caching with Variable Object
Sizes", SIGMETRICS 2018).

Input: the realized request sequence of a simulator run (engine.Simulator.trace): every request's
admission and finish, in the order the simulator did them, with the prefix units (their prefix
identities, radix.prefix_keys) the request read and their token counts, and its output. Output: a
number of tokens no eviction policy can exceed in GPU hits on that same sequence with the same GPU
capacity C (`gpu_tokens`).

The model, and why it is a bound
--------------------------------
Events e = 0, 1, ... are the admissions and finishes; "gap g" is the state right after event g.
A key k (one prompt unit at one prefix position, or a call's output) has a memory size s_k: the
fewest tokens it is ever given (a pruned call may hold fewer tokens of a unit than another).

1. What every policy holds. From its admission A_r to its finish F_r a request r holds all its
   prompt tokens on the GPU: the matched path is loaded back and locked (locked nodes are never
   evicted), the missed tokens and the output are reserved privately. So after every event the
   GPU holds at least L(g) = sum of s_k over the distinct prompt keys of running requests plus
   their output tokens, whatever the policy did; and L(g) <= C because the run respected C.
2. How a hit happens. A read of k at admission b is a GPU hit only if k is on the GPU at b. The
   GPU gains a key only when it is accessed (an admission loads its matched path back, a finish
   inserts prompt and output) or by prefetch. Without prefetch, k therefore stayed on the GPU
   through every gap from its previous access p to b: the interval (p, b).
3. Intervals that are free. If k is held by a running request r' at gap b - 1, then A_r' <= p
   and F_r' > b (both are accesses of k), so r' holds k through the whole interval: k is counted
   in L already and the hit costs nothing more (the bound counts it as a hit; in the run it may
   have been a private copy and a miss, which only loosens the bound). An interval that starts at
   an admission always ends at the request's own finish or at a read while it still runs: free or
   hit-less. First accesses have no interval: always misses.
4. The LP. Every other interval i = (p, b) starts at a finish; it gets x_i in [0, 1] with weight
   w_i = the tokens read at b and size s_k. For every gap g:
        sum of s_i x_i over intervals i spanning g  <=  C - L(g),
   because such keys are on the GPU, are not running keys (3), and the running ones take L(g).
   The hits of any run (x_i = 1 for the intervals it kept) satisfy these constraints, so the LP
   optimum plus the free hits bounds its GPU hits. Dropping prefix closure (a unit is reused only
   after its whole prefix), the host tier, page rounding and the order of evictions within an
   admission only enlarge the feasible set: the result stays an upper bound.
5. Prefetch. A prefetched key leaves and re-enters the GPU inside its interval, so (2) does not
   hold for it: for a run with prefetch the bound adds the tokens that run prefetched and then
   read (`bound_method` says "+prefetched"): a bound on that run, not on every prefetch policy.

Solving. The constraint matrix has consecutive ones in each column (an interval matrix); the LP
is written with one running-load variable z_j per segment between interval endpoints:
z_j = z_{j-1} + (sizes of intervals starting at j) - (sizes of those ending before j), 0 <= z_j <=
min over the segment of C - L(g). That takes about 2 nonzeros per interval instead of one per gap
spanned, and scipy's HiGHS (scipy.optimize.linprog) solves it. Above `max_lp_intervals` the cheap
PFOO-U-style bound runs instead (the same paper's PFOO-U): the sum of all the gap constraints is
one knapsack constraint (sum of s_i x len_i x_i <= sum of capacities), whose fractional optimum,
filled greedily by w_i / (s_i len_i), bounds the LP from above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

# An event of the abstract sequence: (is_admission, request index, prompt keys, their tokens as
# read, output key or None, output tokens)
Event = tuple


@dataclass
class Bound:
    hit_tokens: float  # upper bound on GPU-hit prompt tokens
    method: str  # "lp" (HiGHS) or "pfoo_u" (the knapsack relaxation)
    free_tokens: int  # hits held by a running request (counted without a variable)
    intervals: int  # LP variables x
    rows: int  # LP equality rows (segments)
    nonzeros: int
    seconds: float


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


def intervals(events: Iterable[Event], capacity: int):
    """(free hit tokens, starts p, ends b - 1, sizes, weights, capacity C - L(g) after each event)."""
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
    load, free = 0, 0
    starts, ends, sizes, weights = [], [], [], []
    caps = np.empty(len(events), dtype=np.float64)
    for e, (admit, _, keys, lens, out, out_tokens) in enumerate(events):
        if admit:
            for k, t in zip(keys, lens):
                if k in running:
                    free += t
                    continue
                p = last_finish.pop(k, None)
                if p is not None and t > 0:
                    if size[k] == 0:
                        free += t
                    else:
                        starts.append(p)
                        ends.append(e - 1)
                        sizes.append(size[k])
                        weights.append(t)
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
            load -= out_tokens
            if out is not None:
                last_finish[out] = e
        caps[e] = capacity - load
    return (free, np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64),
            np.asarray(sizes, dtype=np.float64), np.asarray(weights, dtype=np.float64), np.maximum(caps, 0.0))


def upper_bound(events: Iterable[Event], capacity: int, max_lp_intervals: int = 300_000) -> Bound:
    started = time.perf_counter()
    free, a, b, s, w, caps = intervals(events, capacity)
    n = len(a)
    if n == 0:
        return Bound(float(free), "lp", free, 0, 0, 0, time.perf_counter() - started)
    if n > max_lp_intervals:
        value = _knapsack(a, b, s, w, caps)
        return Bound(free + value, "pfoo_u", free, n, 1, n, time.perf_counter() - started)
    value, rows, nnz = _lp(a, b, s, w, caps)
    if value is None:  # the solver failed: the relaxation still bounds it
        return Bound(free + _knapsack(a, b, s, w, caps), "pfoo_u", free, n, 1, n, time.perf_counter() - started)
    return Bound(free + value, "lp", free, n, rows, nnz, time.perf_counter() - started)


def _lp(a, b, s, w, caps):
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    points = np.unique(np.concatenate([a, b + 1]))  # segment j covers gaps points[j] .. points[j+1]-1
    seg_caps = np.minimum.reduceat(caps[: points[-1]], points[:-1])
    n_seg = len(points) - 1
    first = np.searchsorted(points, a)
    after = np.searchsorted(points, b + 1)  # the segment just past the interval
    n = len(a)
    # rows j: z_j - z_{j-1} - sum_{first_i = j} s_i x_i + sum_{after_i = j} s_i x_i = 0
    inside = after < n_seg
    seg = np.arange(n_seg)
    rows = np.concatenate([first, after[inside], seg, seg[1:]])
    cols = np.concatenate([np.arange(n), np.arange(n)[inside], n + seg, n + seg[:-1]])
    vals = np.concatenate([-s, s[inside], np.ones(n_seg), -np.ones(n_seg - 1)])
    matrix = coo_matrix((vals, (rows, cols)), shape=(n_seg, n + n_seg)).tocsr()
    cost = np.concatenate([-w, np.zeros(n_seg)])
    bounds = np.column_stack([np.zeros(n + n_seg), np.concatenate([np.ones(n), seg_caps])])
    res = linprog(cost, A_eq=matrix, b_eq=np.zeros(n_seg), bounds=bounds, method="highs")
    if res.status != 0:
        return None, n_seg, matrix.nnz
    # HiGHS's optimality tolerances are relative (1e-7): add a margin so rounding can only loosen it
    value = -float(res.fun)
    return value + 1e-6 * float(w.sum()), n_seg, matrix.nnz


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
