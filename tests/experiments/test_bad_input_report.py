"""python -m serving_integration.experiments.report (runs=[...] out=DIR) with outputs over its runs or over folders it
did not make, and with files that are not evaluate.py summaries: nothing deleted, one line."""

import json
import stat

import pytest

import evaluate as evaluate_py
from data.atomic import MARKER, process_umask
from data.cli import compose_config
from serving_integration.experiments import report


def tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A folder of two evaluate.py runs (run in this process) and an unrelated file beside them."""
    root = tmp_path_factory.mktemp("runs")
    for i, gpu in enumerate((40000, 80000)):
        cfg = compose_config("evaluate", [f"data.cache_dir={root.parent / 'cache'}", "data.source.n_workflows=12",
                                          "split=all", "policies=[lru,pbkv_lae]", "wandb.enabled=false",
                                          f"sim.gpu_tokens={gpu}", "sim.concurrency=4"])
        evaluate_py.run(cfg, root / "sweep" / str(i))
    (root / "notes.txt").write_text("unrelated")
    return root


def run_report(capsys, *runs, out):
    status = report.main([f"runs=[{','.join(map(str, runs))}]", f"out={out}"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1
    return status, err


def test_evaluate_outputs_are_whole_and_follow_the_umask(runs):
    run = runs / "sweep" / "0"
    assert json.loads((run / "summary.json").read_text())["rows"][0]["policy"] == "lru"
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["hit_rate.png", "latency.png",
                                                                                   "summary.json"]
    assert not [p for p in run.iterdir() if ".tmp-" in p.name]
    for name in ("summary.json", "hit_rate.png"):
        assert stat.S_IMODE((run / name).stat().st_mode) == 0o666 & ~process_umask()


@pytest.mark.parametrize("where, message", [("run", "is also an input"), ("parent", "holds the input"),
                                            ("grandparent", "holds the input")])
def test_out_over_its_runs_deletes_nothing(runs, capsys, where, message):
    before = tree(runs)
    out = {"run": runs / "sweep" / "0", "parent": runs / "sweep", "grandparent": runs}[where]
    status, err = run_report(capsys, runs / "sweep" / "0", runs / "sweep" / "1", out=out)
    assert status == 1 and message in err and str(out) in err
    assert tree(runs) == before


def test_out_over_a_folder_or_file_it_did_not_make(runs, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "draft.md").write_text("keep")
    (tmp_path / "file").write_text("keep")
    status, err = run_report(capsys, runs / "sweep", out=mine)
    assert status == 1 and f"output {mine} is a non-empty directory" in err
    status, err = run_report(capsys, runs / "sweep", out=tmp_path / "file")
    assert status == 1 and "exists and is not a directory" in err
    assert tree(tmp_path) == {"mine/draft.md": b"keep", "file": b"keep"}


def test_report_replaces_its_own_report_and_fails_cleanly_on_foreign_json(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert run_report(capsys, runs / "sweep", out=out)[0] == 0
    assert (out / MARKER).read_text().strip() == report.COMMAND and (out / "report.md").is_file()
    first = tree(out)
    for name, text, message in [("bad.json", "{trunc", "not a summary.json of evaluate.py (JSONDecodeError"),
                                ("norows.json", '{"x": 1}', "not a summary.json of evaluate.py (KeyError"),
                                ("rowless.json", '{"rows": [{"policy": "lru"}]}', "row 0 lacks"),
                                ("empty.json", '{"rows": []}', "nothing to report")]:
        (tmp_path / name).write_text(text)
        status, err = run_report(capsys, tmp_path / name, out=out)
        assert status == 1 and message in err and name in err
    status, err = run_report(capsys, tmp_path / "nothing-here", out=out)
    assert status == 1 and "no summary.json there" in err
    assert tree(out) == first
    assert run_report(capsys, runs / "sweep" / "0", out=out)[0] == 0  # its own report: replaced
    assert tree(out) != first and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_an_interrupt_keeps_the_previous_report(runs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "report"
    assert run_report(capsys, runs / "sweep", out=out)[0] == 0
    first = tree(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(report, "setting_tables", interrupted)
    status, err = run_report(capsys, runs / "sweep" / "1", out=out)
    assert status == 130 and err.strip() == "interrupted: no output was written or changed"
    assert tree(out) == first and [p.name for p in tmp_path.iterdir()] == ["report"]


@pytest.mark.parametrize("argv, message", [
    (["out=x"], "error: runs: required (evaluate.py run folders, sweep folders or summary.json files (a list, or one path))"),
    (["runs=[]", "out=x"], "error: runs=[]: should be a path or a non-empty list of paths"),
    (["runs=[a]"], "error: out: required (the report folder (replaced as a whole; only one this command made))"),
    (["runs=[a]", "out=x", "colour=red"], "error: Could not override 'colour': Key 'colour' not in 'ReportConfig'")])
def test_a_bad_setting_is_one_line_and_exit_2(argv, message, capsys):
    assert report.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[0] == message
