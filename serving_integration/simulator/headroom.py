r"""Where the eviction bound's extra GPU hits lie: the bound's LP solution against the run's own
hits, interval by interval, on the run's own request sequence.

In a run without prefetch, a read of key :math:`k` at admission :math:`b` that no running request
holds is an interval :math:`i = (p, b)` of bound.py (point 4): :math:`k` was left in the cache by
the finish at event :math:`p` and read at :math:`b`, and the read is a GPU hit only if the run kept
:math:`k` on the GPU through the whole interval (:math:`h_i \in \{0, 1\}`). The eviction LP keeps a
share :math:`x_i \in [0, 1]` of it. With :math:`w_i` the tokens read, the bound's headroom over
the run is

.. math::
    \Delta = \sum_i w_i (x_i - h_i),

the LP's interval hits less the run's (the free hits of running requests are left out: the bound
counts all those of inserted keys, the run misses those whose holder had a private copy). The LP
solved here keeps prefix closure (bound.py, point 4a: a key counts only as far as the key before
it in the read is kept), as a radix cache's hits do; where every key is read at its full size its
value is the bound's. :math:`\Delta` is split three ways, each summing to it:

- by reuse distance in time: the seconds from the finish at :math:`p` to the admission at
  :math:`b`, in the bins of ``DISTANCE_EDGES_S``;
- by what the reading workflow did during the interval: waiting on a tool (from one of its calls'
  finish to its next call's issue), queued (issued, not admitted), running (one of its calls
  admitted, not finished), or not started (before its first call was issued: a prefix that
  another workflow left); each interval's term is split by the share of its time in each;
- and how many workflows keep cache: at each gap between events, the
  reading workflows of the kept intervals that span it (the run's: :math:`h_i = 1`; the LP's:
  :math:`x_i \ge 1/2`), counted once each, averaged over the gaps. Fewer workflows kept by the LP
  than by the run is the thrash signature: the optimum keeps some workflows whole where LRU keeps
  a slice of each.

Shares are of the run's prompt tokens; hits are counted in prompt units before page rounding
(engine.Request.gpu_units).

How loose the LP is (``integer=True``): the same model with every :math:`x_i \in \{0, 1\}`
(bound.integer_solution), searched for ``INTEGER_NODES`` branch-and-bound nodes. The search proves
a dual bound on that integer optimum, itself a valid bound on every run's GPU hits (each run's hits
are a 0/1 point) and at most the LP's, and finds a 0/1 plan below it: the integer optimum lies
between the two. LP - dual is the part of the bound that only fractional keeps reach; the plan's
hits are reachable in the model, which is still a relaxation of a radix cache (bound.py, points
1-4a), so not proven reachable by a policy.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from serving_integration.simulator.bound import eviction_solution, integer_solution, sequence_from_trace

DISTANCE_EDGES_S = (1.0, 10.0, 60.0)
DISTANCE_BINS = ("lt1s", "1to10s", "10to60s", "ge60s")  # headroom_reuse_<bin>: under 1 s, ..., 60 s and more
PHASES = ("tool", "queued", "running", "not_started")
# Branch-and-bound nodes of the integer search: a count, so every run gets the same answer. The root
# node alone (presolve, cuts, heuristics) takes most of the time: 2 s on hover (1 seed, 0.25 of the
# working set), about 70 s on tau-bench and 120 s on Who&When at 0.5 (one core)
INTEGER_NODES = 1


def headroom_fields(servers, integer: bool = False) -> dict:
    """The row fields (`headroom_*`, `kept_workflows_*`) of a run without prefetch, summed over its
    servers; {} when a server's LP is too large to solve (bound.py's fallback has no solution). With
    `integer`, also `headroom_integer_plan_hit_rate` and `headroom_integer_bound_hit_rate`: the best
    0/1 plan's GPU hit rate and the integer optimum's proven bound (free hits included, as the row's
    bound_hit_rate), when every server's search found a plan."""
    parts = [server_headroom(s.trace, s.tree.gpu_capacity, integer) for s in servers]
    if any(p is None for p in parts):
        return {}
    prompt = sum(s.counters.prompt_tokens for s in servers) or 1
    fields = {"headroom_bound_hit_rate": sum(p["lp_tokens"] for p in parts) / prompt,
              "headroom_run_hit_rate": sum(p["run_tokens"] for p in parts) / prompt}
    if integer and all(p["integer"] is not None for p in parts):
        fields["headroom_integer_plan_hit_rate"] = sum(p["integer"][0] for p in parts) / prompt
        fields["headroom_integer_bound_hit_rate"] = sum(p["integer"][1] for p in parts) / prompt
    for i, name in enumerate(DISTANCE_BINS):
        fields[f"headroom_reuse_{name}"] = float(sum(p["by_distance"][i] for p in parts)) / prompt
    for phase in PHASES:
        fields[f"headroom_phase_{phase}"] = float(sum(p["by_phase"][phase] for p in parts)) / prompt
    fields["kept_workflows_bound"] = float(np.mean([p["kept_lp"] for p in parts]))
    fields["kept_workflows_run"] = float(np.mean([p["kept_run"] for p in parts]))
    return fields


def server_headroom(trace, capacity: int, integer: bool = False) -> dict | None:
    """One server's attribution (module docstring), or None above the LP's size limit; with `integer`,
    "integer" holds bound.integer_solution's (plan, dual) (None where it found no plan)."""
    events = sequence_from_trace(trace)
    _, starts, ends, _, weights, keys, x = eviction_solution(events, capacity)
    if x is None:
        return None
    readers = [trace[e + 1] for e in ends]  # the admission that reads each interval
    hit = np.array([_read_on_gpu(r, k) for r, k in zip(readers, keys)], dtype=np.float64)
    delta = weights * (x - hit)
    began = np.array([trace[p].finished for p in starts])
    read = np.array([r.admitted for r in readers])
    by_distance = np.bincount(np.searchsorted(DISTANCE_EDGES_S, read - began, side="right"), weights=delta,
                              minlength=len(DISTANCE_BINS))
    timelines = _timelines(trace)
    by_phase = dict.fromkeys(PHASES, 0.0)
    for d, t0, t1, r in zip(delta, began, read, readers):
        for phase, share in _phase_shares(timelines[r.wf.id], t0, t1).items():
            by_phase[phase] += d * share
    workflow = [r.wf.id for r in readers]
    return {"lp_tokens": float(weights @ x), "run_tokens": float(weights @ hit), "by_distance": by_distance,
            "by_phase": by_phase, "kept_lp": _kept_workflows(starts, ends, workflow, x >= 0.5, len(events)),
            "kept_run": _kept_workflows(starts, ends, workflow, hit > 0, len(events)),
            "integer": integer_solution(events, capacity, INTEGER_NODES) if integer else None}


def _read_on_gpu(request, key) -> bool:
    """Whether `request` found `key` on the GPU at admission: the GPU part of a match is a prefix."""
    return request.call.keys.index(key) < request.gpu_units


def _timelines(trace) -> dict:
    """Workflow id -> its calls' (issued, admitted, finished) times on this server, in order."""
    calls: dict = {}
    for r in trace:
        calls.setdefault(r.wf.id, {})[id(r)] = (r.scheduled, r.admitted, r.finished)
    return {wf: sorted(times.values()) for wf, times in calls.items()}


def _phase_shares(timeline, t0: float, t1: float) -> dict:
    """The share of [t0, t1] the workflow spent in each phase (all of it in the phase at t0 when
    the interval has no length)."""
    segments = []  # (start, end, phase), covering the whole line
    previous_end = -np.inf
    for issued, admitted, finished in timeline:
        segments += [(previous_end, issued, "tool" if np.isfinite(previous_end) else "not_started"),
                     (issued, admitted, "queued"), (admitted, finished, "running")]
        previous_end = finished
    segments.append((previous_end, np.inf, "tool"))
    length = t1 - t0
    shares: dict = defaultdict(float)
    for start, end, phase in segments:
        if length <= 0:
            if start <= t0 < end:
                return {phase: 1.0}
            continue
        overlap = min(end, t1) - max(start, t0)
        if overlap > 0:
            shares[phase] += overlap / length
    return shares


def _kept_workflows(starts, ends, workflow: list, kept, n_events: int) -> float:
    """The mean over gaps of the distinct workflows whose kept intervals span the gap."""
    by_workflow: dict = defaultdict(list)
    for a, b, wf, k in zip(starts, ends, workflow, kept):
        if k:
            by_workflow[wf].append((a, b))
    coverage = np.zeros(n_events + 1)
    for spans in by_workflow.values():  # the union of a workflow's spans, so it counts once per gap
        spans.sort()
        lo, hi = spans[0]
        for a, b in spans[1:]:
            if a > hi + 1:
                coverage[lo] += 1
                coverage[hi + 1] -= 1
                lo, hi = a, b
            else:
                hi = max(hi, b)
        coverage[lo] += 1
        coverage[hi + 1] -= 1
    return float(np.cumsum(coverage)[:n_events].mean()) if n_events else 0.0
