"""python -m serving_integration.experiments.bench with bad options or outputs: one line, exit
status, nothing sent to a server, nothing written (no SGLang server is needed: all fail first)."""

import pytest

from serving_integration.experiments import bench


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """One dataset for the module (generating it takes seconds); every test leaves it as it was."""
    from data import generate

    out = tmp_path_factory.mktemp("bench-input") / "ds"
    assert generate.main([f"out={out}", "n_workflows=4"]) == 0
    return out


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("option, message", [
    (["--concurrency", "0"], "--concurrency=0: Input should be greater than or equal to 1"),
    (["--n-workflows", "-1"], "--n-workflows=-1: Input should be greater than or equal to 0"),
    (["--tool-time-scale", "-2"], "--tool-time-scale=-2.0: Input should be greater than or equal to 0"),
    (["--token-range", "500", "100"], "--token-range=[500,100]: token_range should be LOW HIGH with LOW < HIGH"),
    (["--request-timeout", "0"], "--request-timeout=0.0: Input should be greater than 0"),
    (["--split", "dev"], "--split=dev: should be one of train, val, test, all"),
])
def test_bad_options(dataset, tmp_path, capsys, monkeypatch, option, message):
    monkeypatch.setattr(bench, "ClosedLoopReplay", lambda *a, **k: pytest.fail("replayed with a bad option"))
    before = listing(tmp_path)
    assert bench.main(["--data", str(dataset), "--out", str(tmp_path / "out"), *option]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert listing(tmp_path) == before


def test_no_such_dataset(tmp_path, capsys):
    assert bench.main(["--data", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: --data={tmp_path / 'none'}: no such directory\n"


@pytest.mark.parametrize("flag", ["--out", "--save-trace"])
def test_outputs_over_the_dataset(dataset, tmp_path, capsys, monkeypatch, flag):
    monkeypatch.setattr(bench, "ClosedLoopReplay", lambda *a, **k: pytest.fail("replayed into its input"))
    before = listing(tmp_path), listing(dataset.parent)
    for target in (dataset, dataset.parent):
        argv = ["--data", str(dataset), "--out", str(tmp_path / "o")]
        argv += [flag, str(target)] if flag == "--save-trace" else []
        if flag == "--out":
            argv[3] = str(target)
        assert bench.main(argv) == 1
        err = capsys.readouterr().err
        assert ("is also an input" in err or "holds the input" in err) and len(err.splitlines()) == 1
    assert (listing(tmp_path), listing(dataset.parent)) == before


def test_out_is_a_file(dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "ClosedLoopReplay", lambda *a, **k: pytest.fail("replayed without an output"))
    (tmp_path / "f").write_text("keep")
    assert bench.main(["--data", str(dataset), "--out", str(tmp_path / "f"), "--split", "all"]) == 1
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'f'}: exists and is not a directory\n"
    assert (tmp_path / "f").read_text() == "keep"
