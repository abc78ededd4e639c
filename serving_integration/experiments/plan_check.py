"""What a results plan (conf/results.yaml) may run: the project's own commands with values.

A plan is a file, so it is read as values and never as code: each step's command must start with
one of the project's entry points (`train.py`, `evaluate.py`, or `-m` and one of :data:`MODULES`),
and no argument may name a callable (a Hydra `_target_` or its kin, `hydra.callbacks`) or bring
configs from elsewhere (`--config-dir`, `hydra.searchpath`). Anything else is refused in one line
before any step runs."""

from __future__ import annotations

import re
import shlex

SCRIPTS = ("train.py", "evaluate.py")
MODULES = ("data.generate", "data.import_traces", "models.intentkv.train",
           "serving_integration.experiments.bench", "serving_integration.experiments.bench_collect",
           "serving_integration.experiments.calibrate",
           "serving_integration.experiments.validate_sim", "serving_integration.experiments.report",
           "benchmarks.simulator_speed", "benchmarks.predictor_latency", "benchmarks.predictor_table")
# override keys that make Hydra call or load something named by the text
CODE_KEYS = re.compile(r"(^|[.+~/])(_target_|_partial_|_args_|_recursive_|_convert_)(\W|$)|hydra\.callbacks|"
                       r"hydra\.searchpath|^--?(config-dir|config-path|config-name|cd|cp|cn)\b|^-(cd|cp|cn)$")


def check_command(command, where: str) -> None:
    """Refuse a plan command that is not one of the project's entry points with plain arguments."""
    if not isinstance(command, str) or not command.strip():
        raise ValueError(f"{where}: a command is a non-empty string")
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise ValueError(f"{where}: command {command!r} does not parse ({e})") from None
    if words[0] == "-m":
        if len(words) < 2 or words[1] not in MODULES:
            raise ValueError(f"{where}: -m {words[1] if len(words) > 1 else ''}: a plan runs only the project's "
                             f"modules ({', '.join(MODULES)})")
        arguments = words[2:]
    elif words[0] in SCRIPTS:
        arguments = words[1:]
    else:
        raise ValueError(f"{where}: {words[0]}: a plan runs {', '.join(SCRIPTS)} or -m MODULE, "
                         "never other code")
    for word in arguments:
        if CODE_KEYS.search(word.split("=", 1)[0]) or "_target_" in word:
            raise ValueError(f"{where}: argument {word!r} names code or configs from elsewhere; "
                             "a plan holds values only")
