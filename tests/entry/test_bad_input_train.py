"""train.py with bad settings and outputs over its input (hostile checkpoint files:
tests/models/test_bad_input_checkpoint.py)."""

import sys

import pytest
from omegaconf import OmegaConf

import train as train_py
from data.cli import compose_config
from data.errors import run_reported
from models.config import train_config
from tests.conftest import REPO, assert_bad_setting, refused_over_its_dataset

CASES = [
    ("horizon", 0, "horizon=0: Input should be greater than or equal to 1"),
    ("seed", -3, "seed=-3: Input should be greater than or equal to 0"),
    ("torch_threads", 0, "torch_threads=0: Input should be greater than or equal to 1"),
    ("checkpoint_name", "", "checkpoint_name='': should be a file name ending in .pt (no folder, not starting with a dot)"),
    ("datamodule.batch_size", 0, "datamodule.batch_size=0: Input should be greater than or equal to 1"),
    ("datamodule.max_path", -1, "datamodule.max_path=-1: Input should be greater than or equal to 1"),
    ("datamodule.text_source", "pixels", "datamodule.text_source=pixels: should be one of auto, hidden, encoder, "
                                         "none"),
    ("model.optimizer.lr", 0, "model.optimizer.lr=0.0: Input should be greater than 0"),
    ("model.optimizer.weight_decay", -1, "model.optimizer.weight_decay=-1.0: Input should be greater than or equal to 0"),
    ("trainer.max_epochs", -2, "trainer.max_epochs=-2: Input should be greater than or equal to -1"),
    ("data.path", "/no/such/dataset", "data.path=/no/such/dataset: no such directory"),
    ("data.split.test", 1.0, "data.split.test=1.0: Input should be less than 1"),
    ("data.source.n_workflows", 0, "data.source.n_workflows=0: Input should be greater than or equal to 1"),
    ("data.source.n_workflows", 2, "data.source.n_workflows=2: too few to split: train, val and test need 3 "
                                   "(split.val=0.1, split.test=0.1)"),
    ("data.source.workload.passage_tokens", 0, "data.source.workload.passage_tokens=0: Input should be greater than "
                                               "or equal to 1"),
    ("data.split.val", 0.95, "data.split: val=0.95, test=0.1: val + test should be below 1 (the rest is the train "
                             "split)"),
]

# the predictor families' knobs (models/config.py): (model, key, value, message)
MODEL_CASES = [
    ("graphsage", "model.predictor.layers", 0, "model.predictor.layers=0: Input should be greater than or equal to 1"),
    ("graphsage", "model.predictor.identity_dropout", 5, "model.predictor.identity_dropout=5.0: Input should be less "
                                                         "than or equal to 1"),
    ("graphsage", "model.predictor.dropout", 2, "model.predictor.dropout=2.0: Input should be less than 1"),
    ("graphsage", "model.predictor.dim", -1, "model.predictor.dim=-1: Input should be greater than or equal to 1"),
    ("graphsage", "model.predictor.max_steps", 0, "model.predictor.max_steps=0: Input should be greater than or "
                                                  "equal to 1"),
    ("rgcn", "model.predictor.num_bases", 0, "model.predictor.num_bases=0: Input should be greater than or equal to 1"),
    ("intent_residual", "model.predictor.decay", -1, "model.predictor.decay=-1.0: Input should be greater than or "
                                                     "equal to 0"),
    ("intent_residual", "model.predictor.prior.alpha", 0, "model.predictor.prior.alpha=0.0: Input should be greater "
                                                          "than 0"),
    ("markov", "model.predictor.order", -1, "model.predictor.order=-1: Input should be greater than or equal to 0"),
    ("markov", "model.predictor.backoff", 0, "model.predictor.backoff=0.0: Input should be greater than 0"),
    ("graphsage", "model.text_encoder.batch_size", 0, "model.text_encoder.batch_size=0: Input should be greater "
                                                      "than or equal to 1"),
    ("graphsage", "callbacks.early_stopping.patience", -1, "callbacks.early_stopping.patience=-1: Input should be "
                                                           "greater than or equal to 0"),
    ("graphsage", "trainer.log_every_n_steps", 0, "trainer.log_every_n_steps=0: Input should be greater than or "
                                                  "equal to 1"),
]


@pytest.mark.parametrize("model, key, value, message", MODEL_CASES, ids=[f"{m}:{k}={v}" for m, k, v, _ in MODEL_CASES])
def test_bad_model_knob_is_one_line_naming_it(model, key, value, message):
    assert_bad_setting(compose_config("train", [f"model={model}"]), train_config, key, value, message)


@pytest.mark.parametrize("override, message", [
    ("model.predictor.colour=1", "Could not override 'model.predictor.colour': Key 'colour' not in 'GraphSAGETarget'"),
    ("model.predictor.layers=two", "model.predictor.layers=two: Input should be a valid integer"),
    ("data.source.workload.cue_noise=high", "data.source.workload.cue_noise=high: Input should be a valid number"),
])
def test_unknown_key_or_wrong_type_fails_at_compose_time(override, message, capsys):
    from data.errors import run_reported

    assert run_reported(compose_config, "train", [override]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.fixture(scope="module")
def base():
    cfg = compose_config("train", [])
    train_config(cfg)
    return cfg


@pytest.mark.parametrize("key, value, message", CASES, ids=[f"{k}={v}" for k, v, _ in CASES])
def test_bad_setting_is_one_line_naming_it(base, key, value, message):
    assert_bad_setting(base, train_config, key, value, message)


def test_run_dir_may_not_be_or_hold_the_dataset(base, tmp_path, capsys, monkeypatch):
    cfg = refused_over_its_dataset(train_py, "models.training.train", base, tmp_path, capsys, monkeypatch)
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
