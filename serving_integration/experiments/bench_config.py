"""The checked options of `python -m serving_integration.experiments.bench` (an argparse command:
it wraps a running SGLang server). Each option's default, range and help live here once; the parser
takes its defaults from this class and a bad value is one line naming the flag,
``--concurrency=0: Input should be greater than or equal to 1`` (exit status 2)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import List, Optional

from data.errors import ConfigError
from data.knobs import MISSING, above, at_least, build, check, each, knob, nonempty, one_of, shown

SPLITS = ("train", "val", "test", "all")


def _existing_dir(value) -> Optional[str]:
    return None if Path(value).is_dir() else "no such directory"


@dataclass
class BenchConfig:
    url: str = knob("http://127.0.0.1:30000", "any SGLang endpoint (its /generate)", nonempty)
    data: str = knob(MISSING, "a trace dataset dir (data.generate / data.import_traces)", nonempty, _existing_dir)
    split: str = knob("test", "train | val | test | all", one_of(SPLITS))
    n_workflows: int = knob(0, "replay only the first N workflows (0: all)", at_least(0))
    concurrency: int = knob(8, "live workflows (closed loop)", at_least(1))
    tool_time_scale: float = knob(1.0, "multiply the traces' tool times", at_least(0))
    token_range: List[int] = knob(None, "synthesized token ids are drawn from [LOW, HIGH): keep it inside the "
                                        "model's vocabulary", each(at_least(0)), factory=lambda: [1000, 30000])
    request_timeout: float = knob(600.0, "seconds one request may take", above(0))
    out: str = knob(MISSING, "directory for summary.json and calls.jsonl", nonempty)
    gpu_tokens: int = knob(0, "row label (default: the server's KV capacity)", at_least(0))
    seed: int = knob(0, "recorded in the row (the replay is deterministic)", at_least(0))

    def __post_init__(self):
        check(self)
        low_high = list(self.token_range)
        if len(low_high) != 2 or low_high[0] >= low_high[1]:
            raise ConfigError(f"token_range={shown(low_high)}: token_range should be LOW HIGH with LOW < HIGH")


def default(name: str):
    """An option's default, for argparse."""
    field = next(f for f in fields(BenchConfig) if f.name == name)
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def check_options(options: dict) -> BenchConfig:
    """The parsed options as the checked BenchConfig; a bad one names its flag (``--n-workflows=-1: ...``)."""
    names = {f.name for f in fields(BenchConfig)}
    try:
        return build({k: v for k, v in options.items() if k in names}, BenchConfig)
    except ConfigError as e:
        raise ConfigError(re.sub(r"^(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
