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
