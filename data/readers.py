"""Every trace format `data.import_traces` reads, by name: the one reader dispatch, also the Hydra
target of the imported `data` configs (conf/data/who_and_when.yaml, tau_bench.yaml)."""

from __future__ import annotations

from data.formats import read_chat, read_native
from data.schema import SegmentTable, Traces
from data.tau_bench import read_tau_bench
from data.tokenizer import TokenCounter
from data.who_and_when import read_who_and_when

FORMATS = ("chat", "native", "who_and_when", "tau_bench")


def read_traces(format: str, src: str, skip_bad_lines: bool = False, hidden_model: str | None = None,
                hidden_size: int | None = None, n_workflows: int | None = None) -> Traces:
    """Read and validate a trace source (``skip_bad_lines``: drop invalid records, listed in
    ``Traces.skipped``, instead of failing). The calls' hidden vectors (native and chat) must all
    have ``hidden_size`` values (None: as many as the first); model and size go to the meta.
    ``n_workflows``: keep only the source's first that many workflows (None: all)."""
    traces = _read(format, src, skip_bad_lines, hidden_model, hidden_size)
    return traces if n_workflows is None else first_workflows(traces, n_workflows, src)


def first_workflows(traces: Traces, n: int, src: str) -> Traces:
    """The first ``n`` workflows of ``traces`` in their order, with only the segments they read."""
    order = list(dict.fromkeys(c["workflow_id"] for c in traces.calls))
    if n > len(order):
        raise ValueError(f"{src}: n_workflows={n}, but the source holds {len(order)} workflows")
    kept = set(order[:n])
    calls = [c for c in traces.calls if c["workflow_id"] in kept]
    read = {seg for c in calls for seg in c["prompt_ids"]}
    segments = SegmentTable({k: v for k, v in traces.segments.items() if k in read})
    return Traces(calls, segments, traces.meta, traces.skipped)


def _read(format: str, src: str, skip_bad_lines: bool, hidden_model: str | None,
          hidden_size: int | None) -> Traces:
    hidden = {"model": hidden_model, "size": hidden_size}
    if format == "native":
        return read_native(src, skip_bad_lines, **hidden)
    if format == "chat":
        return read_chat(src, TokenCounter.wordpiece(), skip_bad_lines, **hidden)
    if format == "who_and_when":
        return read_who_and_when(src, skip_bad_lines=skip_bad_lines)
    if format == "tau_bench":
        return read_tau_bench(src, skip_bad_lines=skip_bad_lines)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}; got '{format}'")
