# C declarations for the compiled build of trust.py (serving_integration/compiled.py): the shadows'
# per-key records and caches become extension types, so the judge's hot loops read and write their
# fields as C struct members, not through Python's attribute lookup. The fields keep trust.py's
# types (object, or a C double or integer where its value is one throughout), so the compiled and
# interpreted judges agree to the bit (tests/simulator/test_compiled.py). Interpreted, this file is
# not read.

cpdef agents_value(dict values, dict agents)
cpdef double sum_parts(dict parts)

# log_sum_exp's exp and log: the C library's when compiled (trust.py imports math's, which call them)
cdef extern from "math.h":
    cpdef double exp(double x)
    cpdef double log(double x)


# A key's stamp (a count of touches, an int) and score (a float: a sum of float parts, or a log) are C
# numbers: the heaps compare them on every sift; which shadows hold it, its charge and its locks are C
# fields the judge reads where it would otherwise look the key up in a dict
cdef class ShadowEntry:
    cdef public object key, size, first
    cdef public long long stamp
    cdef public double score, charge
    cdef public Py_ssize_t score_slot, lru_slot, locks
    cdef public bint shared, in_score, in_lru
    cdef public dict readers, parts
    cpdef set_part(self, workflow, table)
    cpdef drop_reader(self, workflow)
    cpdef rescore(self)


cdef class TimeShadowEntry(ShadowEntry):
    cdef public dict queued
    cpdef set_part(self, workflow, table)
    cpdef rescore(self)


cpdef double log_sum_exp(terms, more=*)


cdef class ShadowCache:
    cdef public object name, total_hit_tokens
    cdef public double capacity, used, reserved, hit_tokens
    cdef public bint by_score
    cdef public dict held, children
    cdef public list order
    cdef bint before(self, ShadowEntry a, ShadowEntry b) except -1
    cdef Py_ssize_t slot(self, ShadowEntry entry) noexcept
    cpdef bint holds(self, ShadowEntry entry) except -1
    cpdef hold(self, ShadowEntry entry, charge, double before)
    cdef int _put(self, ShadowEntry entry, Py_ssize_t i) except -1
    cdef bint _up(self, ShadowEntry entry, Py_ssize_t i) except -1
    cdef int _down(self, ShadowEntry entry, Py_ssize_t i) except -1
    cpdef place(self, ShadowEntry entry)
    cpdef drop(self, ShadowEntry entry)
    cpdef reorder(self, ShadowEntry entry, bint locked)
    cpdef victim(self, bint leaves_only=*)
    cpdef evict(self, ShadowEntry entry)


# The judge: its fields as struct members (Python objects, as trust.py stores them; the shadows and
# dicts typed), its hot private methods as C calls; __dict__ keeps instances open to new attributes
# (benchmarks/simulator_speed.py wraps a judge's observe_* methods to time them)
cdef class OutcomeTrust:
    cdef dict __dict__
    cdef public object values, share, seed, margin, min_calls, z, return_z, slack, by_node, decay, clock, shadows
    cdef public object prompt_tokens, total_prompt_tokens, _dd, _dp, _pp, sampled_calls, trusted, switches
    cdef public object host_tier, cumulative, real_weight
    cdef public list _since, judged
    cdef public dict parent, ends, entries, tables, keys_of, _revised, running, _sampled
    cdef public ShadowCache score_shadow
    cdef public ShadowCache lru_shadow
    cpdef is_sampled(self, workflow)
    cpdef _release(self, keys, reserved, held_now)
    cpdef _hold(self, workflow, agent, keys, sizes)
    cpdef _refresh(self)
    cpdef _make_room(self)
    cpdef _forget(self, key)
    cpdef list _hits(self, keys, sizes)
    cpdef list _judged_hits(self, list hits, gpu_cached)
    cpdef _decide(self)


cdef class TimeOutcomeTrust(OutcomeTrust):
    cdef public dict queued_keys
    cpdef _refresh(self)
