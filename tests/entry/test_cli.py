"""The data entry points, run as a user runs them."""

import json
import subprocess
import sys

import pytest

from data import store
from tests.conftest import REPO, WHO_AND_WHEN
from tests.data.test_formats import chat_line


def run(*args):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a generate run in a subprocess
def test_generate_writes_a_dataset(tmp_path):
    out = tmp_path / "hover"
    done = run("data.generate", "workload=hover", "n_workflows=50", "seed=0", f"out={out}")
    assert done.returncode == 0, done.stderr
    ds = store.load(out)
    assert ds.n_workflows == 50 and ds.meta["workload"] == "hover" and "reusable share" in done.stdout


def test_import_with_one_corrupted_line_fails_and_writes_nothing(tmp_path):
    src = tmp_path / "calls.jsonl"
    src.write_text("\n".join([chat_line(), chat_line(workflow_id="t2"), '{"workflow_id": "t3", "agent": ', chat_line()]))
    out = tmp_path / "out"
    done = run("data.import_traces", "format=chat", f"src={src}", f"out={out}")
    assert done.returncode != 0
    assert f"{src}:3:" in done.stderr and "malformed JSON" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls.jsonl"]


@pytest.mark.slow  # three imports in subprocesses
def test_import_native_and_chat_and_who_and_when(tmp_path):
    chat = tmp_path / "c.jsonl"
    chat.write_text("\n".join([chat_line(), chat_line(workflow_id="t2")]) + "\n")
    assert run("data.import_traces", "format=chat", f"src={chat}", f"out={tmp_path / 'c'}").returncode == 0
    native = tmp_path / "n.jsonl"
    subprocess.run  # the native file is written by the project's own exporter
    from data.formats import native_records, write_jsonl_atomic
    ds = store.load(tmp_path / "c")
    write_jsonl_atomic(native, native_records(ds.rows(), ds.segment_table()))
    done = run("data.import_traces", "format=native", f"src={native}", f"out={tmp_path / 'n'}")
    assert done.returncode == 0, done.stderr
    assert store.load(tmp_path / "n").rows() == [dict(r, source_prompt_tokens=None, source_completion_tokens=None)
                                                 for r in ds.rows()]
    done = run("data.import_traces", "format=who_and_when", f"src={WHO_AND_WHEN}", f"out={tmp_path / 'ww'}")
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "ww" / "meta.json").read_text())
    assert meta["stats"]["workflows"] == 184 and "WordPiece" in meta["tokenizer"]


def test_unknown_format_is_a_clear_error(tmp_path):
    done = run("data.import_traces", "format=csv", f"src={tmp_path}", f"out={tmp_path / 'x'}")
    assert done.returncode == 2 and "format=csv: should be one of chat, native, who_and_when, tau_bench" in done.stderr
