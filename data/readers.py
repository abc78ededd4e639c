"""Every trace format `data.import_traces` reads, by name: the one reader dispatch, also the Hydra
target of the imported `data` configs (conf/data/who_and_when.yaml, tau_bench.yaml)."""

from __future__ import annotations

from data.formats import read_chat, read_native
from data.schema import Traces
from data.tau_bench import read_tau_bench
from data.tokenizer import TokenCounter
from data.who_and_when import read_who_and_when

FORMATS = ("chat", "native", "who_and_when", "tau_bench")


def read_traces(format: str, src: str, skip_bad_lines: bool = False) -> Traces:
    """Read and validate a trace source (``skip_bad_lines``: drop invalid records, listed in
    ``Traces.skipped``, instead of failing)."""
    if format == "native":
        return read_native(src, skip_bad_lines)
    if format == "chat":
        return read_chat(src, TokenCounter.wordpiece(), skip_bad_lines)
    if format == "who_and_when":
        return read_who_and_when(src, skip_bad_lines=skip_bad_lines)
    if format == "tau_bench":
        return read_tau_bench(src, skip_bad_lines=skip_bad_lines)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}; got '{format}'")
