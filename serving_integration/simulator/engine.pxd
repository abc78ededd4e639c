# C declarations for the compiled build of engine.py (serving_integration/compiled.py): a server
# becomes an extension type, so its event handlers read and write its state as C struct members, not
# through Python's attribute lookup. Every field keeps the Python type engine.py gives it (object;
# the queues typed as the containers they always are), so the compiled and interpreted replays agree
# to the bit (tests/simulator/test_compiled.py); __dict__ keeps a server open to other attributes.
# Interpreted, this file is not read.

cdef class Server:
    cdef dict __dict__
    cdef public object policy, now, config, tree, ledger, counters, prefetch, cost, decisions
    cdef public object _decoded, _decode_context, prefilled_tokens, tracks_workflows, calls, _decode_seq
    cdef public object waiting
    cdef public list prefilling, clocks, trace, _decode_ends
    cdef public dict decoding, prefetched, running
    cdef public set ever_cached
