"""Outputs written all at once, and never over what they must not replace. One mechanism for every
file and folder the project's commands write.

- A file is written to a temporary sibling ``.NAME.tmp-PID-RANDOM[.SUFFIX]`` and renamed over
  NAME (``os.replace``, atomic on POSIX) only when complete.
- A folder is built in a temporary sibling ``.NAME.tmp-PID-RANDOM``; when complete it is swapped
  with the old NAME in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``: at every instant NAME
  is the old complete folder or the new one), and the old one, now in the sibling, is removed. Where
  the file system cannot exchange, the old NAME is renamed aside to ``.NAME.old-PID-RANDOM`` first;
  a kill between those two renames leaves the old copy aside, and the next write of NAME (or
  :func:`recover`) puts it back. Siblings of dead processes are cleaned then too; those of a live
  process (a parallel sweep job) are left alone (process ids: one machine per output folder).
- A Hydra job's run folder (train.py, evaluate.py) is one such folder (:func:`hydra_run_dir`): the
  job writes into the temporary sibling, Hydra's own files (.hydra/, the log) included, so a killed
  run leaves the previous run folder whole, never a mix of two runs.
- An output may not be, or hold, any of the command's inputs (:func:`check_output`), and a folder
  is only replaced when it is empty or holds the marker file :data:`MARKER` naming a command
  allowed to replace it: a folder some user or other tool made is never removed.
- Everything is created with the process's umask (``mkstemp``/``mkdtemp`` alone would give
  0600/0700).

Failures are :class:`OutputError`: one line naming the path.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

MARKER = ".pbkv-output"  # in every folder atomic_dir writes: the name of the command that made it


class OutputError(OSError):
    """An output that cannot or must not be written; the message names the path."""

    def __str__(self) -> str:  # OSError's str() would prefix "[Errno N]"
        return self.args[0] if self.args else ""


def process_umask() -> int:
    """The umask, read without changing it (the os.umask round trip races with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path)))).resolve()


def check_output(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """Refuse an output that is one of the inputs or holds one (an input inside it): replacing it
    would replace or remove what the command reads. (An output inside an input folder is allowed:
    it adds to the folder and changes nothing the command read.)"""
    target = _resolved(out)
    for given in inputs:
        if given is None or str(given) == "":
            continue
        source = _resolved(given)
        if target == source:
            raise OutputError(f"output {out} is also an input; choose another output")
        if target in source.parents:
            raise OutputError(f"output {out} holds the input {given}; choose another output")


def describe(e: OSError, path: str | os.PathLike) -> str:
    """One line for a filesystem error on an output."""
    reasons = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EROFS: "read-only file system",
               errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.ENOTDIR: "a parent is not a directory", errno.EEXIST: "exists and is not a directory",
               errno.ENAMETOOLONG: "name too long", errno.EFBIG: "file too large"}
    return f"cannot write {path}: {reasons.get(e.errno, e.strerror or type(e).__name__)}"


WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _write_error(e: BaseException) -> bool:
    """An error of writing the output (reported as one line naming it), not of the command's work."""
    return isinstance(e, OSError) and not isinstance(e, OutputError) and e.errno in WRITE_ERRNOS


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_siblings(path: Path) -> dict[str, list[Path]]:
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(tmp|old)-(\d+)-[0-9a-f]+(\..*)?$")
    found: dict[str, list[Path]] = {"tmp": [], "old": []}
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return found
    for entry in entries:
        m = pattern.match(entry.name)
        if m and not _pid_alive(int(m.group(2))):
            found[m.group(1)].append(entry)
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def recover(path: str | os.PathLike) -> None:
    """Undo what a killed write of `path` left: the previous complete copy is renamed back when
    `path` is missing; temporary and set-aside siblings of dead processes are removed."""
    path = Path(path)
    stale = _stale_siblings(path)
    olds = sorted(stale["old"], key=lambda p: p.stat().st_mtime if p.exists() else 0)
    if olds and not os.path.lexists(path):
        olds[-1].rename(path)
        olds = olds[:-1]
    for sibling in stale["tmp"] + olds:
        _remove(sibling)


def _sibling(path: Path, kind: str, suffix: str = "") -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def _made_by(path: Path) -> str | None:
    try:
        return (path / MARKER).read_text().strip() or None
    except OSError:
        return None


def check_replaceable(path: str | os.PathLike, replaces: Iterable[str]) -> None:
    """Refuse to replace a file where a folder is wanted, or a non-empty folder that does not
    carry a marker of one of the `replaces` commands."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        raise OutputError(f"output {path} exists and is not a directory; choose another output")
    if not any(path.iterdir()):
        return
    allowed = tuple(replaces)
    maker = _made_by(path)
    if maker not in allowed:
        why = f"it was made by {maker}" if maker else f"it has no {MARKER} marker"
        raise OutputError(f"output {path} is a non-empty directory that {' or '.join(allowed)} did not make "
                          f"({why}); it is left as it is: choose another output or remove it yourself")


def _prepare(path: Path, inputs) -> None:
    check_output(path, inputs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"cannot write {path}: a parent is not a directory") from None
    except OSError as e:
        raise OutputError(describe(e, path.parent)) from e
    recover(path)


@contextmanager
def atomic_file(path: str | os.PathLike, inputs: Iterable = ()) -> Iterator[Path]:
    """Yield a temporary path beside `path` (same suffix, so writers that go by the extension
    work); on success it replaces `path`, on any failure or interrupt it is removed."""
    path = Path(path)
    _prepare(path, inputs)
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"output {path} is a directory; a file was expected")
    tmp = _sibling(path, "tmp", path.suffix)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # open() applies the umask
        os.close(fd)
    except OSError as e:
        raise OutputError(describe(e, path)) from e
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if _write_error(e):
            raise OutputError(describe(e, path)) from e
        raise


@contextmanager
def built_once(path: str | os.PathLike, wait: bool = True) -> Iterator[bool]:
    """Hold the lock of the cache entry `path` (``.NAME.lock`` beside it; filelock's OS lock, freed
    when the holder dies) while checking for the entry and building it when missing: parallel
    sweep jobs that need the same dataset, predictor or embeddings take turns, so one builds it and
    the others find it built, instead of building it side by side. The entry itself is still
    written atomically; the lock file stays (empty). Yields True once held; with ``wait=False`` it
    yields False at once when another process holds it (that one is building the entry)."""
    from filelock import FileLock, Timeout

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(path.parent / f".{path.name}.lock")
        lock.acquire(blocking=wait)
        held = True
    except Timeout:  # before OSError: filelock's Timeout is a TimeoutError
        held = False
    except OSError as e:
        raise OutputError(describe(e, path)) from e
    try:
        yield held
    finally:
        if held:
            lock.release()


def temporary_sibling_dir(path: str | os.PathLike) -> Path:
    """A new empty ``.NAME.tmp-PID-RANDOM`` folder beside `path` (umask applied; cleaned by
    :func:`recover` once this process is gone), for callers that rename it into place themselves."""
    path = Path(path)
    _prepare(path, ())
    tmp = _sibling(path, "tmp")
    try:
        os.mkdir(tmp, 0o777)
    except OSError as e:
        raise OutputError(describe(e, path)) from e
    return tmp


@contextmanager
def atomic_dir(path: str | os.PathLike, command: str, inputs: Iterable = (),
               replaces: Iterable[str] | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success it replaces `path`. `command` is written
    to its marker; an existing non-empty `path` is only replaced when its marker names one of
    `replaces` (default: `command`)."""
    path = Path(path)
    _prepare(path, inputs)
    check_replaceable(path, (command,) if replaces is None else replaces)
    tmp = _sibling(path, "tmp")
    try:
        os.mkdir(tmp, 0o777)  # mkdir applies the umask
    except OSError as e:
        raise OutputError(describe(e, path)) from e
    try:
        yield tmp
        (tmp / MARKER).write_text(command + "\n")
        old = swap_in(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _write_error(e):
            raise OutputError(describe(e, path)) from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; False where the system or file system cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def swap_in(new: Path, path: Path) -> Path | None:
    """Put the complete folder `new` at `path`; returns where the previous `path` now is (for the
    caller to remove), or None when there was none."""
    if not os.path.lexists(path):
        new.rename(path)
        return None
    if _exchange(new, path):
        return new  # the previous output, under the temporary name
    old = _sibling(path, "old")  # no exchange here: set aside, then renamed in (recover() undoes a kill between)
    path.rename(old)
    try:
        new.rename(path)
    except BaseException:
        old.rename(path)  # the previous output stays
        raise
    return old


def check_run_dir(run_dir: str | os.PathLike, command: str, inputs: Iterable = ()) -> None:
    """Refuse a run folder that is or holds one of the inputs or the repository root, or that holds
    anything `command` did not write (a run folder it made carries its marker)."""
    check_command_output(run_dir, inputs)
    check_replaceable(run_dir, (command,))


def check_command_output(out: str | os.PathLike, inputs: Iterable = ()) -> None:
    """What every command checks of its output before any work: it is not, and does not hold, one
    of its inputs (:func:`check_output`) nor the repository root."""
    from data import REPO

    target = _resolved(out)
    if target == REPO.resolve() or target in REPO.resolve().parents:
        raise OutputError(f"output {out} is or holds the repository root; choose another output")
    check_output(out, inputs)


@contextmanager
def hydra_run_dir(run_dir: str | os.PathLike, command: str, cfg=None, inputs: Iterable = ()) -> Iterator[Path]:
    """A Hydra job's run folder written complete or not at all: checked (:func:`check_run_dir`),
    then built in a temporary sibling that replaces `run_dir` when the job succeeds (:func:`atomic_dir`).

    Hydra itself writes nothing into the run folder (conf/hydra/default.yaml: ``output_subdir: null``,
    the job log to the console only): while the job runs, ``${hydra:runtime.output_dir}`` is the
    temporary folder, and Hydra's files (.hydra/config.yaml, hydra.yaml, overrides.yaml and the job's
    log) are written there, so they always describe the outputs beside them. A folder left empty by a
    failed job (Hydra makes the run folder before the job starts) is removed."""
    run_dir = Path(run_dir)
    inputs = list(inputs)
    was_missing_or_empty = not os.path.lexists(run_dir) or (run_dir.is_dir() and not any(run_dir.iterdir()))
    try:
        check_run_dir(run_dir, command, inputs)
        with atomic_dir(run_dir, command, inputs) as tmp, _hydra_writes_into(tmp, run_dir, cfg):
            yield tmp
    except BaseException:
        if was_missing_or_empty and run_dir.is_dir() and not run_dir.is_symlink() and not any(run_dir.iterdir()):
            run_dir.rmdir()
        raise


@contextmanager
def _hydra_writes_into(tmp: Path, run_dir: Path, cfg) -> Iterator[None]:
    """Point Hydra's runtime.output_dir at `tmp` for the job, with Hydra's files and log there."""
    import logging

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write

    if not HydraConfig.initialized():  # called outside a Hydra job (tests): nothing of Hydra's to write
        yield
        return
    hydra_cfg = HydraConfig.instance().cfg
    runtime = hydra_cfg.hydra.runtime
    files = tmp / ".hydra"
    files.mkdir()
    if cfg is not None:
        OmegaConf.save(cfg, files / "config.yaml")
    OmegaConf.save(hydra_cfg, files / "hydra.yaml")  # names the run folder, not the temporary one
    OmegaConf.save(hydra_cfg.hydra.overrides.task, files / "overrides.yaml")
    log = logging.FileHandler(tmp / f"{hydra_cfg.hydra.job.name}.log")
    log.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(log)
    with read_write(runtime), open_dict(runtime):
        runtime.output_dir = str(tmp.resolve())
    try:
        yield
    finally:
        with read_write(runtime), open_dict(runtime):
            runtime.output_dir = str(run_dir.resolve())
        logging.getLogger().removeHandler(log)
        log.close()


def write_json(path: str | os.PathLike, obj, inputs: Iterable = ()) -> None:
    with atomic_file(path, inputs) as tmp:
        tmp.write_text(json.dumps(obj, indent=2))
