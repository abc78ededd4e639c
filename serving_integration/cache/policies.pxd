# C declarations for the compiled build of policies.py (serving_integration/compiled.py): the
# workflow ledger and its per-workflow rows become extension types, so the ledger's bookkeeping on
# every call and prediction reads and writes their fields as C struct members, not through Python's
# attribute lookup. Every field keeps the Python type policies.py gives it (the containers typed as
# the ones it always stores), so the compiled and interpreted replays agree to the bit
# (tests/simulator/test_compiled.py); __dict__ keeps a ledger open to other attributes (a test wraps
# its methods). Interpreted, this file is not read.

cdef class _WorkflowRows:
    cdef public dict row, shared
    cdef public list nodes, agents, part
    cdef public object width, value


cdef class WorkflowLedger:
    cdef dict __dict__
    cdef public object gamma, _name_columns
    cdef public dict users, nodes_of, reuse_value, next_value, steps_to, unchecked, columns, _rows, _score, _parts
    cdef public list listeners
