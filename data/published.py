"""Trace files as they are published or as the repository ships them, gzip-compressed (`NAME.gz`
instead of `NAME`): the real traces live in data/traces/ (each folder with its licence and a
PROVENANCE.md); PBKV_TRACES_DIR may point at another copy, compressed or as published."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from data import REPO

TRACES_DIR = Path(os.environ.get("PBKV_TRACES_DIR") or REPO / "data" / "traces")


def located(path: str | Path) -> Path:
    """`path` itself, or its compressed copy `path.gz` when only that exists."""
    path = Path(path)
    if path.suffix != ".gz" and not path.exists() and path.with_name(path.name + ".gz").exists():
        return path.with_name(path.name + ".gz")
    return path


def read_bytes(path: str | Path) -> bytes:
    """The published bytes of `path` (decompressed when it, or the copy found in its place, is .gz).
    Only a regular file is read (data.formats.read_source); an unreadable or damaged file is one
    issue naming it (TraceValidationError)."""
    from data.errors import Issue, TraceValidationError
    from data.formats import read_source

    path = located(path)
    raw = read_source(path)
    if path.suffix != ".gz":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError) as e:  # gzip's BadGzipFile, or a truncated copy
        raise TraceValidationError([Issue(str(path), None, "", f"cannot read: damaged gzip ({e})")]) from None


def published_name(path: Path) -> str:
    """The published file name: `3.json` for `3.json.gz`."""
    return path.name[:-3] if path.suffix == ".gz" else path.name
