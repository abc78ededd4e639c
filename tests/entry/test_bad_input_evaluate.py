"""evaluate.py with bad settings and outputs: one line naming the key, its value and what is
allowed, exit status 2, before any work, nothing written."""

import sys

import pytest
from omegaconf import OmegaConf

import evaluate as evaluate_py
from data.cli import compose_config
from data.config import data_config
from serving_integration.experiments.evaluate_checks import evaluate_schema, validate
from data.errors import run_reported
from tests.conftest import REPO, assert_bad_setting, refused_over_its_dataset

CASES = [
    ("kv.budget", -1, "kv.budget=-1: Input should be greater than or equal to 1"),
    ("kv.budget", 0, "kv.budget=0: Input should be greater than or equal to 1"),
    ("sim.concurrency", 0, "sim.concurrency=0: Input should be greater than or equal to 1"),
    ("sim.n_workflows", 0, "sim.n_workflows=0: Input should be greater than or equal to 1"),
    ("sim.max_prefill_tokens", 0, "sim.max_prefill_tokens=0: Input should be greater than or equal to 1"),
    ("sim.gpu_tokens", 0, "sim.gpu_tokens=0: Input should be greater than 0"),
    ("sim.gpu_tokens", 1.5, "sim.gpu_tokens=1.5: Input should be a valid integer"),
    ("sim.gpu_tokens", "lots", "sim.gpu_tokens=lots: Input should be a valid integer"),
    ("sim.hicache_ratio", -1.0, "sim.hicache_ratio=-1.0: Input should be greater than or equal to 0"),
    ("sim.hicache_ratio", float("nan"), "sim.hicache_ratio=nan: Input should be a finite number"),
    ("sim.page_size", 0, "sim.page_size=0: Input should be greater than or equal to 1"),
    ("sim.max_running_requests", 0, "sim.max_running_requests=0: Input should be greater than or equal to 1"),
    ("sim.predictor_cost_s", -0.1, "sim.predictor_cost_s=-0.1: Input should be greater than or equal to 0"),
    ("policies", [], "policies=[]: List should have at least 1 item"),
    ("policies", ["lru", "arc"], "policies[1]=arc: should be one of lru, lfu, tlru, kvflow, pbkv_lae, pbkv, oracle, "
                                 "pbkv_perfect"),
    ("policies", ["lru", "lru"], "policies=[lru,lru]: should not repeat a name"),
    ("prefetch", [], "prefetch=[]: List should have at least 1 item"),
    ("prefetch", ["eager"], "prefetch[0]=eager: should be one of none, conservative, aggressive"),
    ("split", "dev", "split=dev: should be one of train, val, test, all"),
    ("seed", -1, "seed=-1: Input should be greater than or equal to 0"),
    ("pbkv.gamma", -1, "pbkv.gamma=-1: Input should be greater than 0"),
    ("pbkv.gamma", 0, "pbkv.gamma=0: Input should be greater than 0"),
    ("pbkv.gamma", 1.5, "pbkv.gamma=1.5: Input should be less than or equal to 1"),
    ("pbkv.horizon", 0, "pbkv.horizon=0: Input should be greater than or equal to 1"),
    ("predictor.noise", 1.2, "predictor.noise=1.2: Input should be less than or equal to 1"),
    ("predictor.noise", -0.1, "predictor.noise=-0.1: Input should be greater than or equal to 0"),
    ("predictor.max_unknown", 2, "predictor.max_unknown=2: Input should be less than or equal to 1"),
    ("predictor.cost_s", -1, "predictor.cost_s=-1: Input should be greater than or equal to 0"),
    ("predictor.train", "transformer", "predictor.train=transformer: should be one of graphsage, intent_residual, "
                                       "markov, rgcn"),
    ("predictor.checkpoint", "/no/such.pt", "predictor.checkpoint=/no/such.pt: no such file or directory"),
    ("kv.method", "random", "kv.method=random: should be one of intent, streaming_llm, h2o, snapkv"),
    ("kv.layouts", [], "kv.layouts=[]: List should have at least 1 item"),
    ("kv.layouts", ["zigzag"], "kv.layouts[0]=zigzag: should be one of compaction, sentinel"),
    ("kv.policy", "oracle", "kv.policy=oracle: should be one of lru, lfu, tlru, pbkv_lae"),
    ("kv.chunk_tokens", 0, "kv.chunk_tokens=0: Input should be greater than or equal to 1"),
    ("kv.lam", -1, "kv.lam=-1: Input should be greater than or equal to 0"),
    ("tlru.threshold", -1, "tlru.threshold=-1: Input should be greater than or equal to 0"),
    ("kvflow.hold_step", -1, "kvflow.hold_step=-1: Input should be greater than or equal to 0"),
    ("cost_model.mfu", 0, "cost_model.mfu=0: Input should be greater than 0"),
    ("cost_model.pcie_efficiency", 1.5, "cost_model.pcie_efficiency=1.5: Input should be less than or equal to 1"),
    ("cost_model.layers", 0, "cost_model.layers=0: Input should be greater than or equal to 1"),
    ("cost_model.peak_flops", -1.0, "cost_model.peak_flops=-1.0: Input should be greater than 0"),
    ("data.path", "/no/such/dataset", "data.path=/no/such/dataset: no such directory"),
    ("data.split.val", 0.95, "data.split: val=0.95, test=0.1: val + test should be below 1 "
                             "(the rest is the train split)"),
    ("data.source.n_workflows", 0, "data.source.n_workflows=0: Input should be greater than or equal to 1"),
]


def checked(cfg):
    """evaluate.py's checks: the serving groups, then the data node."""
    validate(cfg, evaluate_schema())
    data_config(cfg.data)


@pytest.fixture(scope="module")
def base():
    cfg = compose_config("evaluate", [])
    validate(cfg, evaluate_schema())  # the shipped config is valid
    return cfg


@pytest.mark.parametrize("key, value, message", CASES, ids=[f"{k}={v}" for k, v, _ in CASES])
def test_bad_setting_is_one_line_naming_it(base, key, value, message):
    assert_bad_setting(base, checked, key, value, message)


def test_known_names_come_from_the_code(base):
    from serving_integration.cache.policies import POLICIES
    from serving_integration.experiments.evaluation import POLICIES as EVALUATED

    assert set(EVALUATED) == {*POLICIES, "pbkv_perfect"}
    cfg = base.copy()
    OmegaConf.update(cfg, "policies", list(EVALUATED), merge=False)
    validate(cfg, evaluate_schema())


def test_run_checks_before_any_work_and_writes_nothing(base, tmp_path, capsys, monkeypatch):
    cfg = base.copy()
    OmegaConf.update(cfg, "sim.concurrency", 0, merge=False)
    monkeypatch.setattr(evaluate_py, "evaluate", lambda *a: pytest.fail("evaluated a bad config"))
    assert run_reported(evaluate_py.run, cfg, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err == "error: sim.concurrency=0: Input should be greater than or equal to 1\n"
    assert list(tmp_path.iterdir()) == []


def test_run_dir_may_not_be_or_hold_the_dataset(base, tmp_path, capsys, monkeypatch):
    refused_over_its_dataset(evaluate_py, "evaluate", base, tmp_path, capsys, monkeypatch)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ds", "meta.json"]


def test_command_line_exit_status_2_and_no_traceback(tmp_path, capsys, monkeypatch):
    """The Hydra entry point itself, in this process (a subprocess would spend seconds importing)."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["evaluate.py", f"--config-path={REPO / 'conf'}", f"hydra.run.dir={run_dir}",
                                      "wandb.enabled=false", "kv.budget=-1"])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        evaluate_py.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: kv.budget=-1: Input should be greater than or equal to 1" in err
    assert not (run_dir / "summary.json").exists() and not list(run_dir.glob("*.png"))
