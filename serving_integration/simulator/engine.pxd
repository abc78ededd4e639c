# C declarations for the compiled build of engine.py (serving_integration/compiled.py): a server
# becomes an extension type, so its event handlers read and write its state as C struct members, not
# through Python's attribute lookup. Every field keeps the Python type engine.py gives it (object;
# the queues typed as the containers they always are), so the compiled and interpreted replays agree
# to the bit (tests/simulator/test_compiled.py); __dict__ keeps a server open to other attributes.
# Interpreted, this file is not read. A request is an extension type too (a Cython dataclass: the
# same fields and defaults), and the workload's calls, workflows and the tree's nodes are read
# through their own declarations, cimported (the build's name covers those files).

from serving_integration.cache.workload cimport SimCall, SimWorkflow
from serving_integration.simulator.radix cimport Node, RadixTree


cdef class Request:
    # in the dataclass's order (its __init__ takes the fields in declaration order)
    cdef public SimWorkflow wf
    cdef public SimCall call
    cdef public object arrival
    cdef public Node last_node
    cdef public object gpu_hit, host_hit, miss, private, host_load, prefill_left, context, decode_left
    cdef public object ttft, scheduled, admitted, finished, gpu_units, clocks, queued_at_prefilled, server


cdef class Counters:
    # in the dataclass's order
    cdef public object prompt_tokens, gpu_hit_tokens, host_hit_tokens, miss_tokens, recomputed_tokens, kv_tokens_read
    cdef public object eviction_requested_tokens, evicted_gpu_tokens, prefetched_tokens, prefetch_used_tokens
    cdef public object predictor_calls, predictor_time_s, ttfts, latencies, latency_workflows
    cdef public object time_tool_s, time_queue_s, time_prefill_s, time_decode_s, time_pcie_s, time_predictor_s
    cdef public object ended_by_signal, ended_by_timeout, live_timeouts


cdef class Server:
    cdef dict __dict__
    cdef public RadixTree tree
    cdef public Counters counters
    cdef public object policy, now, config, ledger, prefetch, cost, decisions
    cdef public object _decoded, _decode_context, prefilled_tokens, tracks_workflows, calls, _decode_seq
    cdef public object waiting
    cdef public list prefilling, clocks, trace, _decode_ends
    cdef public dict decoding, prefetched, running
    cdef public set ever_cached
