"""data.atomic, the one output mechanism: whole outputs or the previous ones, never over an input
or a folder another tool made, stale siblings of killed runs cleaned, files made with the umask."""

import os
import stat
import subprocess
import sys

import pytest

from data.atomic import MARKER, OutputError, atomic_dir, atomic_file, check_output, recover, write_json


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_outputs_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        with atomic_dir(tmp_path / "d", "test") as tmp:
            (tmp / "f").write_text("1")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o750
    assert (tmp_path / "d" / MARKER).read_text().strip() == "test"


def test_a_failure_or_interrupt_keeps_the_previous_output(tmp_path):
    write_json(tmp_path / "m.json", {"v": 1})
    with atomic_dir(tmp_path / "d", "test") as tmp:
        (tmp / "f").write_text("old")
    for error in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(error):
            with atomic_file(tmp_path / "m.json") as tmp:
                tmp.write_text("{trunc")
                raise error()
        with pytest.raises(error):
            with atomic_dir(tmp_path / "d", "test") as tmp:
                (tmp / "f").write_text("new")
                raise error()
    assert (tmp_path / "m.json").read_text() == '{\n  "v": 1\n}' and (tmp_path / "d" / "f").read_text() == "old"
    assert listing(tmp_path) == ["d", f"d/{MARKER}", "d/f", "m.json"]


def test_a_kill_between_the_renames_is_undone_on_the_next_run(tmp_path):
    """A killed process's siblings: the set-aside old copy comes back, temporaries go."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    old = tmp_path / f".out.old-{dead}-abcd1234"
    old.mkdir()
    (old / MARKER).write_text("test\n")
    (old / "f").write_text("previous")
    (tmp_path / f".out.tmp-{dead}-00ff00ff").mkdir()  # the new copy, never renamed in
    (tmp_path / f".m.json.tmp-{dead}-0a0b0c0d.json").write_text("{half")
    live = tmp_path / f".out.tmp-{os.getppid()}-11112222"  # a live process's work in progress
    live.mkdir()
    recover(tmp_path / "out")
    recover(tmp_path / "m.json")
    assert (tmp_path / "out" / "f").read_text() == "previous"
    assert listing(tmp_path) == [live.name, "out", f"out/{MARKER}", "out/f"]


def test_never_over_an_input_nor_a_folder_made_by_someone_else(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    for out in (run, tmp_path, run / "summary.json"):
        with pytest.raises(OutputError, match="is also an input|holds the input"):
            with atomic_dir(out, "test", inputs=[run / "summary.json"]):
                pass
    with pytest.raises(OutputError, match=f"did not make .it has no {MARKER} marker"):
        with atomic_dir(run, "test"):
            pass
    (run / MARKER).write_text("other.command\n")
    with pytest.raises(OutputError, match="made by other.command"):
        with atomic_dir(run, "test"):
            pass
    with pytest.raises(OutputError, match="exists and is not a directory"):
        with atomic_dir(tmp_path / "notes.txt", "test"):
            pass
    with pytest.raises(OutputError, match="is a directory; a file was expected"):
        write_json(run, {})
    with pytest.raises(OutputError, match="a parent is not a directory"):
        write_json(tmp_path / "notes.txt" / "x.json", {})
    assert listing(tmp_path) == ["notes.txt", "run", f"run/{MARKER}", "run/summary.json"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    check_output(run / "report", [run])  # adding a folder inside an input folder is fine


def test_filesystem_errors_are_one_line_naming_the_output(tmp_path, monkeypatch):
    import errno

    import data.atomic as atomic

    write_json(tmp_path / "x.json", {"v": 1})
    with pytest.raises(OutputError, match=f"^cannot write {tmp_path}/x.json: no space left on device$"):
        with atomic_file(tmp_path / "x.json"):
            raise OSError(errno.ENOSPC, "No space left on device")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(atomic.os, "mkdir", read_only)
    monkeypatch.setattr(atomic.os, "open", read_only)
    with pytest.raises(OutputError, match=f"^cannot write {tmp_path}/d: read-only file system$"):
        with atomic_dir(tmp_path / "d", "test"):
            pass
    with pytest.raises(OutputError, match="read-only file system"):
        write_json(tmp_path / "x.json", {})
    monkeypatch.undo()
    assert listing(tmp_path) == ["x.json"] and '"v": 1' in (tmp_path / "x.json").read_text()
