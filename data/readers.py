"""Every trace format `data.import_traces` reads, by name: the one reader dispatch, also the Hydra
target of the imported `data` configs (conf/data/who_and_when.yaml, tau_bench.yaml)."""

from __future__ import annotations

from data.formats import read_chat, read_native
from data.schema import Traces
from data.tau_bench import read_tau_bench
from data.tokenizer import TokenCounter
from data.who_and_when import read_who_and_when

FORMATS = ("chat", "native", "who_and_when", "tau_bench")


def read_traces(format: str, src: str, skip_bad_lines: bool = False, hidden_model: str | None = None,
                hidden_size: int | None = None) -> Traces:
    """Read and validate a trace source (``skip_bad_lines``: drop invalid records, listed in
    ``Traces.skipped``, instead of failing). The calls' hidden vectors (native and chat) must all
    have ``hidden_size`` values (None: as many as the first); model and size go to the meta."""
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
