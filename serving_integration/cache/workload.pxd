# C declarations for the compiled build of workload.py (serving_integration/compiled.py): a call and
# a workflow become extension types (Cython's own dataclasses: the same fields, __init__, repr,
# pickling and dataclasses.fields), so the simulator's compiled modules, which cimport these
# declarations, read their fields as C struct members. A call's fields are readonly (the frozen
# dataclass's promise); every field keeps the type workload.py gives it. Interpreted, this file is
# not read.

cdef class SimCall:
    cdef readonly object agent, units, lens, keys, output_unit, output_tokens, tool_time, hidden


cdef class SimWorkflow:
    cdef public object id, order, task, calls, next_call, start_time
