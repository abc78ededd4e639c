"""train.py with bad settings and outputs over its input (hostile checkpoint files:
tests/models/test_bad_input_checkpoint.py)."""

import sys

import pytest
from omegaconf import OmegaConf

import train as train_py
from data.cli import compose_config
from data.config_checks import train_schema, validate
from data.errors import run_reported
from tests.conftest import REPO, assert_bad_setting, refused_over_its_dataset

CASES = [
    ("horizon", 0, "horizon=0: Input should be greater than or equal to 1"),
    ("seed", -3, "seed=-3: Input should be greater than or equal to 0"),
    ("torch_threads", 0, "torch_threads=0: Input should be greater than or equal to 1"),
    ("checkpoint_name", "", "checkpoint_name='': String should have at least 1 character"),
    ("datamodule.batch_size", 0, "datamodule.batch_size=0: Input should be greater than or equal to 1"),
    ("datamodule.max_path", -1, "datamodule.max_path=-1: Input should be greater than or equal to 1"),
    ("datamodule.text_source", "pixels", "datamodule.text_source=pixels: should be one of auto, hidden, encoder, "
                                         "none"),
    ("model.optimizer.lr", 0, "model.optimizer.lr=0: Input should be greater than 0"),
    ("model.optimizer.weight_decay", -1, "model.optimizer.weight_decay=-1: Input should be greater than or equal to 0"),
    ("trainer.max_epochs", -2, "trainer.max_epochs=-2: Input should be greater than or equal to -1"),
    ("data.path", "/no/such/dataset", "data.path=/no/such/dataset: no such directory"),
    ("data.split.test", 1.0, "data.split.test=1.0: Input should be less than 1"),
    ("data.source.n_workflows", 0, "data.source.n_workflows=0: Input should be greater than or equal to 1"),
]


@pytest.fixture(scope="module")
def base():
    cfg = compose_config("train", [])
    validate(cfg, train_schema())
    return cfg


@pytest.mark.parametrize("key, value, message", CASES, ids=[f"{k}={v}" for k, v, _ in CASES])
def test_bad_setting_is_one_line_naming_it(base, key, value, message):
    assert_bad_setting(base, train_schema(), key, value, message)


def test_run_dir_may_not_be_or_hold_the_dataset(base, tmp_path, capsys, monkeypatch):
    cfg = refused_over_its_dataset(train_py, "train", base, tmp_path, capsys, monkeypatch)
    OmegaConf.update(cfg, "horizon", 0, merge=False)
    assert run_reported(train_py.run, cfg, tmp_path / "run") == 2
    assert capsys.readouterr().err == "error: horizon=0: Input should be greater than or equal to 1\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ds", "meta.json"]


def test_command_line_exit_status_2_and_no_traceback(tmp_path, capsys, monkeypatch):
    """The Hydra entry point itself, in this process (a subprocess would spend seconds importing)."""
    monkeypatch.setattr(sys, "argv", ["train.py", f"--config-path={REPO / 'conf'}", f"hydra.run.dir={tmp_path / 'run'}",
                                      "model=markov", "logger=csv", "datamodule.batch_size=0"])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        train_py.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error: datamodule.batch_size=0: Input should be greater than or equal to 1" in err
    assert not (tmp_path / "run" / "predictor.pt").exists() and not (tmp_path / "run" / "metrics.json").exists()
