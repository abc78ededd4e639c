"""python -m data.import_traces format=chat|native|who_and_when|tau_bench src=PATH out=DIR
(knobs: data.config.ImportConfig; the readers: data/readers.py)"""

from __future__ import annotations

import sys

from data.atomic import check_output, check_replaceable
from data.cli import run_command, store_traces
from data.config import ImportConfig
from data.readers import read_traces


def import_traces(cfg) -> None:
    check_output(cfg.out, [cfg.src])  # before the work: a refusal costs nothing
    from data.store import DATASET_WRITERS
    check_replaceable(cfg.out, DATASET_WRITERS)
    traces = read_traces(cfg.format, cfg.src, cfg.skip_bad_lines, cfg.hidden_model, cfg.hidden_size, cfg.n_workflows)
    for issue in traces.skipped:
        print(f"skipped {issue}", file=sys.stderr)
    if traces.skipped:
        print(f"skipped {len(traces.skipped)} invalid record(s)", file=sys.stderr)
    store_traces(cfg.format, traces, cfg, "data.import_traces", inputs=[cfg.src])
    print(f"wrote {cfg.out}")


def main(argv: list[str] | None = None) -> int:
    return run_command("import_traces", ImportConfig, import_traces, argv)


if __name__ == "__main__":
    sys.exit(main())
