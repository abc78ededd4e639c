"""Validation errors that name the file, line, field and reason."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Issue:
    file: str
    line: int | None  # 1-based; None where the source is not line-oriented
    field: str  # dotted path such as "prompt[2].tokens"; "" for the whole line
    reason: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        what = f" field '{self.field}':" if self.field else ""
        return f"{where}:{what} {self.reason}"


class TraceValidationError(ValueError):
    """Raised when a trace source holds invalid records; nothing has been written."""

    MAX_SHOWN = 20

    def __init__(self, issues: list[Issue]):
        self.issues = list(issues)
        shown = "\n".join(f"  {issue}" for issue in self.issues[: self.MAX_SHOWN])
        more = len(self.issues) - self.MAX_SHOWN
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(f"{len(self.issues)} invalid record(s):\n{shown}{tail}")


class ConfigError(ValueError):
    """A configuration value outside its allowed range: one line naming the key, the value and
    what is allowed. Commands exit with status 2 on it, before doing any work."""


EXIT_CONFIG = 2  # a setting out of range, an unknown name, a malformed override
EXIT_INTERRUPTED = 130  # SIGINT, as a shell reports it


def run_reported(body, *args) -> int:
    """Run a command's body; a known failure becomes one line on stderr and an exit status, never
    a traceback: 2 for a bad setting, 1 for bad input data or an output that cannot be written,
    130 for an interrupt. Outputs are written atomically, so none of these leaves a partial one."""
    import sys

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        body(*args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {config_error_line(e)}", file=sys.stderr)
        return EXIT_CONFIG
    except TraceValidationError as e:
        print(f"error: {e}\nnothing was written", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no output was written or changed", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


# OmegaConf's wording of a value the schema's type refuses -> the wording of the range checks
_TYPE_REASONS = {"Integer": "Input should be a valid integer", "Float": "Input should be a valid number",
                 "bool": "Input should be a valid boolean"}


def config_error_line(e: Exception) -> str:
    """One line for a Hydra / OmegaConf error. A value of the wrong type for its schema (an override
    merged at compose time) reads as the range checks do: ``n_workflows=ten: Input should be a
    valid integer``; others give their first line, with the key they name."""
    import re

    cause = e.__cause__ if getattr(e.__cause__, "full_key", None) else e
    line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    key = getattr(cause, "full_key", None)
    wrong = re.match(r"Value '(.*)' (?:of type '\w+' could not be converted to (Integer|Float)|is not a valid (bool))",
                     line)
    if key and wrong:
        return f"{key}={wrong.group(1)}: {_TYPE_REASONS[wrong.group(2) or wrong.group(3)]}"
    if cause is not e:  # a failed override: the override's line, then why
        return f"{(str(e).strip().splitlines() or [''])[0].rstrip('.')}: {line}"
    return f"{key}: {line}" if key and key not in line else line
