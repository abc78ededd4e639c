"""python -m models.intentkv.train with bad settings or an output it must not replace."""

import pytest

from data.errors import run_reported
from models.intentkv import train as ikv


@pytest.mark.parametrize("arg, message", [
    ("steps=0", "steps=0: Input should be greater than or equal to 1"),
    ("budgets=[1.5]", "budgets[0]=1.5: Input should be less than or equal to 1"),
    ("lr=0", "lr=0.0: Input should be greater than 0"),
    ("test=1", "test=1.0: Input should be less than 1"),
    ("window=600", "window=600, stride=255: window should be at most 510 and a multiple of stride"),
    ("out=", "out='': should not be empty"),
])
def test_bad_settings(tmp_path, capsys, monkeypatch, arg, message):
    monkeypatch.setattr(ikv, "run", lambda cfg: pytest.fail("trained with a bad setting"))
    argv = [f"out={tmp_path / 'o'}", arg] if not arg.startswith("out=") else [arg]
    assert run_reported(ikv.main, argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arg", ["steps=many", "no_such_setting=1"])
def test_wrong_type_or_unknown_key(tmp_path, capsys, arg):
    assert run_reported(ikv.main, [f"out={tmp_path / 'o'}", arg]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and arg.split("=")[0] in err
    assert list(tmp_path.iterdir()) == []


def test_never_replaces_a_folder_it_did_not_make(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ikv, "run", lambda cfg: pytest.fail("trained into a foreign folder"))
    (tmp_path / "paper.tex").write_text("keep")
    assert run_reported(ikv.main, [f"out={tmp_path}"]) == 1
    assert f"output {tmp_path} is a non-empty directory" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["paper.tex"]
