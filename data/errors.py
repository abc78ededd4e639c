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
