"""python -m data.generate / data.import_traces with bad settings, hostile files and bad outputs:
exit status, one line naming the problem, nothing written, nothing lost."""

import errno
import json

import pytest

from data import generate, import_traces, store
from data.atomic import MARKER
from tests.data.test_formats import chat_line, native_line


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def one_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def chat_src(tmp_path):
    src = tmp_path / "calls.jsonl"
    src.write_text("\n".join([chat_line(), chat_line(workflow_id="t2"), chat_line(workflow_id="t3")]) + "\n")
    return src


@pytest.mark.parametrize("override, message", [
    ("n_workflows=0", "n_workflows=0: Input should be greater than or equal to 1"),
    ("n_workflows=-5", "n_workflows=-5: Input should be greater than or equal to 1"),
    ("seed=-1", "seed=-1: Input should be greater than or equal to 0"),
    ("split.val=1.5", "split.val=1.5: Input should be less than 1"),
    ("split.val=0.95", "split: val=0.95, test=0.1: val + test should be below 1"),
    ("n_workflows=ten", "n_workflows=ten: Input should be a valid integer"),
    ("nosuchkey=1", "Could not override 'nosuchkey'"),
    ("workload=nosuch", "Could not find 'workload/nosuch'"),
])
def test_generate_bad_settings(tmp_path, capsys, override, message):
    assert generate.main([f"out={tmp_path / 'out'}", override]) == 2
    assert message in one_line(capsys)
    assert listing(tmp_path) == []


# the workloads' knobs (data/config.py): each out of its range is one line naming it, exit status 2
WORKLOAD_CASES = [
    (["n_workflows=2"], "n_workflows=2: too few to split: train, val and test need 3 (split.val=0.1, split.test=0.1)"),
    (["workload.extra_hop_prob=5"], "workload.extra_hop_prob=5.0: Input should be less than or equal to 1"),
    (["workload.extra_hop_prob=nan"], "workload.extra_hop_prob=nan: Input should be a finite number"),
    (["workload.hop_probs=[0.5,0.3,0.1]"], "workload.hop_probs=[0.5,0.3,0.1]: should sum to 1 (sums to 0.9)"),
    (["workload.hop_probs=[]"], "workload.hop_probs=[]: should not be empty"),
    (["workload.passage_tokens=-5"], "workload.passage_tokens=-5: Input should be greater than or equal to 1"),
    (["workload.passage_tokens=0"], "workload.passage_tokens=0: Input should be greater than or equal to 1"),
    (["workload.search_seconds=-1"], "workload.search_seconds=-1.0: Input should be greater than or equal to 0"),
    (["workload.passages_per_search=[10,4]"], "workload.passages_per_search=[10,4]: should be LOW HIGH with LOW <= HIGH"),
    (["workload.cue_noise=1.5"], "workload.cue_noise=1.5: Input should be less than or equal to 1"),
    (["workload.output_scale=0"], "workload.output_scale=0.0: Input should be greater than 0"),
    (["workload.system_prompt_tokens.verifier=0"],
     "workload.system_prompt_tokens.verifier=0: Input should be greater than or equal to 1"),
    (["workload=swebench", "workload.max_attempts=0"], "workload.max_attempts=0: Input should be greater than or equal to 1"),
    (["workload=swebench", "workload.fail_prob.hard=1.2"], "workload.fail_prob.hard=1.2: Input should be less than or "
                                                           "equal to 1"),
    (["workload=swebench", "workload.difficulty_probs.easy=0.5"],
     "workload.difficulty_probs={easy:0.5,medium:0.4,hard:0.25}: should sum to 1 (sums to 1.15)"),
    (["workload=swebench", "+workload.difficulty_probs.expert=0"],
     "workload.difficulty_probs={easy:0.35,medium:0.4,hard:0.25,expert:0.0}: should name exactly easy, medium, hard"),
    (["workload=financebench", "workload.react_steps.writer=0"],
     "workload.react_steps.writer=0: Input should be greater than or equal to 1"),
    (["workload.passage_tokens=many"], "workload.passage_tokens=many: Input should be a valid integer"),
    (["workload.colour=red"], "Could not override 'workload.colour': Key 'colour' not in 'HoverConfig'"),
]


@pytest.mark.parametrize("overrides, message", WORKLOAD_CASES, ids=[" ".join(o) for o, _ in WORKLOAD_CASES])
def test_generate_bad_workload_knobs(tmp_path, capsys, overrides, message):
    assert generate.main([f"out={tmp_path / 'out'}", *overrides]) == 2
    assert one_line(capsys) == f"error: {message}"
    assert listing(tmp_path) == []


def test_generate_needs_out(tmp_path, capsys):
    assert generate.main([]) == 2 and "out" in one_line(capsys)


def test_generate_never_replaces_a_folder_it_did_not_make(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert generate.main([f"out={mine}", "n_workflows=5", "overwrite=true"]) == 1
    assert f"output {mine} is a non-empty directory" in one_line(capsys)
    (tmp_path / "file").write_text("x")
    assert generate.main([f"out={tmp_path / 'file'}", "n_workflows=5", "overwrite=true"]) == 1
    assert "exists and is not a directory" in one_line(capsys)
    assert listing(tmp_path) == ["file", "mine", "mine/thesis.tex"]


@pytest.mark.slow  # four generate runs
def test_overwrite_replaces_only_its_own_output_and_an_interrupt_keeps_the_old(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ds"
    assert generate.main([f"out={out}", "n_workflows=5"]) == 0
    before = store.load(out).n_workflows
    assert (out / MARKER).read_text().strip() == "data.generate"
    assert generate.main([f"out={out}", "n_workflows=6"]) == 1
    assert "exists (pass overwrite=true" in one_line(capsys)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("datasets.Dataset.to_parquet", interrupted)
    assert generate.main([f"out={out}", "n_workflows=7", "overwrite=true"]) == 130
    assert one_line(capsys) == "interrupted: no output was written or changed"
    monkeypatch.undo()
    assert store.load(out).n_workflows == before and [p.name for p in tmp_path.iterdir()] == ["ds"]
    assert generate.main([f"out={out}", "n_workflows=7", "overwrite=true"]) == 0
    assert store.load(out).n_workflows == 7


@pytest.mark.parametrize("override, message", [
    ("format=csv", "format=csv: should be one of chat, native, who_and_when"),
    ("src=/no/such/file", "src=/no/such/file: no such file or directory"),
    ("split.test=-0.1", "split.test=-0.1: Input should be greater than or equal to 0"),
    ("skip_bad_lines=maybe", "skip_bad_lines=maybe: Input should be a valid boolean"),
])
def test_import_bad_settings(tmp_path, chat_src, capsys, override, message):
    argv = ["format=chat", f"src={chat_src}", f"out={tmp_path / 'out'}"]
    argv = [a for a in argv if a.split("=")[0] != override.split("=")[0]] + [override]
    assert import_traces.main(argv) == 2
    assert message in one_line(capsys)
    assert listing(tmp_path) == ["calls.jsonl"]


@pytest.mark.parametrize("field, value", [("step", 2**63), ("step", -1), ("output_tokens", 2**80),
                                          ("output_tokens", 2**31)])
def test_numbers_beyond_the_columns_are_file_line_errors(tmp_path, capsys, field, value):
    src = tmp_path / "n.jsonl"
    src.write_text(native_line() + "\n" + native_line(**{field: value}) + "\n")
    assert import_traces.main(["format=native", f"src={src}", f"out={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert f"{src}:2: field '{field}':" in err and "Traceback" not in err and "nothing was written" in err
    assert listing(tmp_path) == ["n.jsonl"]


def test_huge_hidden_values_and_token_counts_are_rejected(tmp_path, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text(chat_line(hidden=[1e39]) + "\n" + chat_line(prompt_tokens=2**63) + "\n")
    assert import_traces.main(["format=chat", f"src={src}", f"out={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert f"{src}:1: field 'hidden[0]':" in err and f"{src}:2: field 'prompt_tokens':" in err
    assert listing(tmp_path) == ["c.jsonl"]


@pytest.mark.parametrize("out", ["src", "parent"])
def test_import_never_replaces_or_holds_its_source(tmp_path, chat_src, capsys, out):
    target = chat_src if out == "src" else tmp_path
    content = chat_src.read_text()
    assert import_traces.main(["format=chat", f"src={chat_src}", f"out={target}", "overwrite=true"]) == 1
    assert ("is also an input" if out == "src" else "holds the input") in one_line(capsys)
    assert listing(tmp_path) == ["calls.jsonl"] and chat_src.read_text() == content


@pytest.mark.parametrize("code, reason", [(errno.EROFS, "read-only file system"),
                                          (errno.ENOSPC, "no space left on device")])
def test_import_filesystem_errors_are_one_line(tmp_path, chat_src, capsys, monkeypatch, code, reason):
    import data.atomic

    def fails(*args, **kwargs):
        raise OSError(code, "simulated")
    monkeypatch.setattr(data.atomic.os, "mkdir", fails)
    assert import_traces.main(["format=chat", f"src={chat_src}", f"out={tmp_path / 'out'}"]) == 1
    assert one_line(capsys) == f"error: cannot write {tmp_path / 'out'}: {reason}"
    assert listing(tmp_path) == ["calls.jsonl"]


def test_import_into_a_file_or_under_one(tmp_path, chat_src, capsys):
    (tmp_path / "f").write_text("keep")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        assert import_traces.main(["format=chat", f"src={chat_src}", f"out={out}", "overwrite=true"]) == 1
        assert "not a directory" in one_line(capsys)
    assert listing(tmp_path) == ["calls.jsonl", "f"] and (tmp_path / "f").read_text() == "keep"


def test_import_writes_a_dataset_with_the_marker(tmp_path, chat_src, capsys):
    assert import_traces.main(["format=chat", f"src={chat_src}", f"out={tmp_path / 'out'}"]) == 0
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["stats"]["workflows"] == 3
    assert (tmp_path / "out" / MARKER).read_text().strip() == "data.import_traces"
