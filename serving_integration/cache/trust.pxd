# C declarations for the compiled build of trust.py (serving_integration/compiled.py): the shadows'
# per-key records and caches become extension types, so the judge's hot loops read and write their
# fields as C struct members, not through Python's attribute lookup. The fields keep trust.py's
# types (object, or a C double where its value is a float throughout), so the compiled and
# interpreted judges agree to the bit (tests/simulator/test_compiled.py). Interpreted, this file is
# not read.

cdef class ShadowEntry:
    cdef public object size, first, stamp, score
    cdef public bint shared
    cdef public dict readers, parts


cdef class TimeShadowEntry(ShadowEntry):
    cdef public dict queued


cpdef tuple lru_rank(ShadowEntry entry)
cpdef tuple score_rank(ShadowEntry entry)


cdef class ShadowCache:
    cdef public object name, rank, total_hit_tokens
    cdef public double capacity, used, reserved, hit_tokens
    cdef public dict held, children
    cdef public list heap
    cpdef push(self, key, ShadowEntry entry, seq)
    cpdef victim(self, dict entries, dict locked, bint leaves_only=*)
    cpdef evict(self, key)


cdef class LruShadowCache(ShadowCache):
    cdef public dict live
    cpdef push(self, key, ShadowEntry entry, seq)
    cpdef victim(self, dict entries, dict locked, bint leaves_only=*)
    cpdef evict(self, key)
