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
    """The published bytes of `path` (decompressed when it, or the copy found in its place, is .gz)."""
    path = located(path)
    raw = path.read_bytes()
    return gzip.decompress(raw) if path.suffix == ".gz" else raw


def published_name(path: Path) -> str:
    """The published file name: `3.json` for `3.json.gz`."""
    return path.name[:-3] if path.suffix == ".gz" else path.name
