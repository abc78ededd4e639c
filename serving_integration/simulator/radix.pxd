# C declarations for the compiled build of radix.py (serving_integration/compiled.py): a node becomes
# an extension type, so the tree's walks, flushes and evictions read and write its fields as C struct
# members, not through Python's attribute lookup. Every field keeps the type radix.py gives it
# (object, a C double where it is a float throughout, a C integer for counters and flags), so the
# compiled and interpreted trees agree to the bit (tests/simulator/test_compiled.py). Interpreted,
# this file is not read.

cdef class Node:
    cdef public object id, units, lens, num_tokens, hit_count, key_id, end_key, priority
    cdef public object depth_tokens, max_depth_tokens, _gpu_entry, _host_entry
    cdef public Node parent
    cdef public dict children
    cdef public bint on_gpu, on_host
    cdef public Py_ssize_t lock_ref, gpu_children
    cdef public double last_access_time, creation_time


cpdef Py_ssize_t _common(tuple node_units, units, Py_ssize_t start)


# The tree itself: its methods read and write its fields as C struct members, and the engine, which
# cimports this declaration, reads them so too and calls the replay's methods (cpdef: a C call from
# compiled code, a method as before from Python). No __dict__: a cpdef method of a class with one
# looks for an override in it on every call.
cdef class RadixTree:
    cdef public object gpu_capacity, host_capacity, partial_eviction, priority, on_delete, on_split, on_evict
    cdef public object _ids, _seq, gpu_used, host_used, private_gpu, gpu_locked
    cdef public double clock
    cdef public Node root
    cdef public list _gpu_heap, _host_heap
    cdef public dict _dirty, by_key, by_id

    cpdef double tick(self)
    cpdef refresh(self, Node node)
    cpdef _flush(self)
    cpdef refresh_many(self, nodes)
    cpdef refresh_ids(self, node_ids)
    cpdef Node _new_node(self, Node parent, tuple units, tuple lens)
    cpdef Node _split(self, Node node, at)
    cpdef _delete(self, Node node)
    cpdef list match(self, units, lens)
    cpdef tuple insert(self, units, lens, refresh=*)
    cpdef _set_gpu(self, Node node, on)
    cpdef backup(self, Node node)
    cpdef load_back(self, list path)
    cpdef gpu_free(self)
    cpdef gpu_evictable_tokens(self)
    cpdef list evict_gpu(self, tokens, allow=*)
    cpdef evict_host(self, tokens)
    cpdef lock(self, Node node)
    cpdef unlock(self, Node node)
