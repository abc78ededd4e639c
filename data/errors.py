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
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        key = getattr(e, "full_key", None)
        print(f"error: {key}: {line}" if key and key not in line else f"error: {line}", file=sys.stderr)
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
