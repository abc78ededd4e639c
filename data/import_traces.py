"""python -m data.import_traces format=chat|native|who_and_when|tau_bench src=PATH out=DIR"""

from __future__ import annotations

import sys

from data.atomic import check_output, check_replaceable
from data.cli import run_command, store_traces
from data.formats import read_chat, read_native
from data.schema import Traces
from data.tau_bench import read_tau_bench
from data.tokenizer import TokenCounter
from data.who_and_when import read_who_and_when

FORMATS = ("chat", "native", "who_and_when", "tau_bench")


def read_traces(format: str, src: str, skip_bad_lines: bool = False) -> Traces:
    """Read and validate a trace source; also the Hydra target of imported `data` configs."""
    if format == "native":
        return read_native(src, skip_bad_lines)
    if format == "chat":
        return read_chat(src, TokenCounter.wordpiece(), skip_bad_lines)
    if format == "who_and_when":
        return read_who_and_when(src, skip_bad_lines=skip_bad_lines)
    if format == "tau_bench":
        return read_tau_bench(src, skip_bad_lines=skip_bad_lines)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}; got '{format}'")


def import_traces(cfg) -> None:
    check_output(cfg.out, [cfg.src])  # before the work: a refusal costs nothing
    from data.store import DATASET_WRITERS
    check_replaceable(cfg.out, DATASET_WRITERS)
    traces = read_traces(cfg.format, cfg.src, cfg.skip_bad_lines)
    for issue in traces.skipped:
        print(f"skipped {issue}", file=sys.stderr)
    if traces.skipped:
        print(f"skipped {len(traces.skipped)} invalid record(s)", file=sys.stderr)
    store_traces(cfg.format, traces, cfg, "data.import_traces", inputs=[cfg.src])
    print(f"wrote {cfg.out}")


def main(argv: list[str] | None = None) -> int:
    return run_command("import_traces", import_traces, argv)


if __name__ == "__main__":
    sys.exit(main())
