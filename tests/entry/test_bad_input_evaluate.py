"""evaluate.py with bad settings and outputs: one line naming the key, its value and what is
allowed, exit status 2, before any work, nothing written. (A number given to a float knob is shown
as the float it became: `pbkv.gamma=0` is reported as `pbkv.gamma=0.0`.)"""

import sys

import pytest
from omegaconf import OmegaConf

import evaluate as evaluate_py
from data.cli import compose_config
from data.errors import ConfigError, run_reported
from serving_integration.experiments.config import evaluated_policies, settings
from tests.conftest import REPO, refused_over_its_dataset

CASES = [
    ("kv.budget", -1, "kv.budget=-1: Input should be greater than or equal to 1"),
    ("kv.budget", 0, "kv.budget=0: Input should be greater than or equal to 1"),
    ("sim.concurrency", 0, "sim.concurrency=0: Input should be greater than or equal to 1"),
    ("sim.n_workflows", 0, "sim.n_workflows=0: Input should be greater than or equal to 1"),
    ("sim.max_prefill_tokens", 0, "sim.max_prefill_tokens=0: Input should be greater than or equal to 1"),
    ("sim.gpu_tokens", 0, "sim.gpu_tokens=0: Input should be greater than 0"),
    ("sim.hicache_ratio", -1.0, "sim.hicache_ratio=-1.0: Input should be greater than or equal to 0"),
    ("sim.hicache_ratio", float("nan"), "sim.hicache_ratio=nan: Input should be a finite number"),
    ("sim.page_size", 0, "sim.page_size=0: Input should be greater than or equal to 1"),
    ("sim.max_running_requests", 0, "sim.max_running_requests=0: Input should be greater than or equal to 1"),
    ("sim.predictor_cost_s", -0.1, "sim.predictor_cost_s=-0.1: Input should be greater than or equal to 0"),
    ("policies", [], "policies=[]: should not be empty"),
    ("policies", ["lru", "arc"], "policies[1]=arc: should be one of lru, lfu, tlru, kvflow_ideal, pbkv_lae, pbkv, "
                                 "pbkv_time, oracle, fifo, mru, filo, slru, priority, kvflow, kvflow_nolae, "
                                 "lru_prefetch, continuum, pbkv_perfect, pbkv_time_perfect"),
    ("policies", ["lru", "lru"], "policies=[lru,lru]: should not repeat a name"),
    ("prefetch", [], "prefetch=[]: should not be empty"),
    ("seeds", [0, 0], "seeds=[0,0]: should not repeat a name"),
    ("prefetch", ["eager"], "prefetch[0]=eager: should be one of none, conservative, aggressive"),
    ("split", "dev", "split=dev: should be one of train, val, test, all"),
    ("seed", -1, "seed=-1: Input should be greater than or equal to 0"),
    ("pbkv.gamma", -1, "pbkv.gamma=-1.0: Input should be greater than 0"),
    ("pbkv.gamma", 0, "pbkv.gamma=0.0: Input should be greater than 0"),
    ("pbkv.gamma", 1.5, "pbkv.gamma=1.5: Input should be less than or equal to 1"),
    ("pbkv.horizon", 0, "pbkv.horizon=0: Input should be greater than or equal to 1"),
    ("predictor.noise", 1.2, "predictor.noise=1.2: Input should be less than or equal to 1"),
    ("predictor.noise", -0.1, "predictor.noise=-0.1: Input should be greater than or equal to 0"),
    ("predictor.max_unknown", 2, "predictor.max_unknown=2.0: Input should be less than or equal to 1"),
    ("predictor.train", "transformer", "predictor.train=transformer: should be one of graphsage, intent_residual, "
                                       "markov, rgcn"),
    ("predictor.checkpoint", "/no/such.pt", "predictor.checkpoint=/no/such.pt: no such file or directory"),
    ("kv.method", "random", "kv.method=random: should be one of intent, streaming_llm, h2o, snapkv"),
    ("kv.layouts", [], "kv.layouts=[]: should not be empty"),
    ("kv.layouts", ["zigzag"], "kv.layouts[0]=zigzag: should be one of compaction, sentinel"),
    ("kv.policy", "oracle", "kv.policy=oracle: should be one of lru, lfu, tlru, pbkv_lae, fifo, mru, filo, slru, "
                            "priority, lru_prefetch, continuum"),
    ("kv.chunk_tokens", 0, "kv.chunk_tokens=0: Input should be greater than or equal to 1"),
    ("kv.lam", -1, "kv.lam=-1.0: Input should be greater than or equal to 0"),
    ("tlru.threshold", -1, "tlru.threshold=-1: Input should be greater than or equal to 0"),
    ("kvflow.hold_step", 0, "kvflow.hold_step=0: Input should be greater than or equal to 1"),
    ("kvflow.ideal_hold_step", -1, "kvflow.ideal_hold_step=-1: Input should be greater than or equal to 0"),
    ("kvflow.agent_key", "global", "kvflow.agent_key=global: should be one of role, workflow"),
    ("continuum.ttl_estimator", "median", "continuum.ttl_estimator=median: should be one of cdf, mean"),
    ("continuum.hold_cost", 0, "continuum.hold_cost=0.0: Input should be greater than 0"),
    ("sim.scheduling", "lifo", "sim.scheduling=lifo: should be one of fcfs, program_fcfs, lpm, hrrn, spf"),
    ("tlru.next_prompt_estimate", -1, "tlru.next_prompt_estimate=-1: Input should be greater than or equal to 0"),
    ("pbkv.trust", "sometimes", "pbkv.trust=sometimes: should be one of outcome, accuracy, always"),
    ("pbkv.trust", ["accuracy", "never"], "pbkv.trust[1]=never: should be one of outcome, accuracy, always"),
    ("pbkv.trust_threshold", 0.95, "pbkv.trust_threshold=0.95, trust_margin=0.1: threshold +- margin must lie in "
                                   "[0, 1]"),
    ("pbkv.trust_window", 0, "pbkv.trust_window=0: Input should be greater than or equal to 1"),
    ("predictor.online_beta", 0, "predictor.online_beta=0.0: Input should be greater than 0"),
    ("predictor.noise_kind", "loud", "predictor.noise_kind=loud: should be one of uniform, adversarial"),
    ("sim.end_signal_loss", 1.5, "sim.end_signal_loss=1.5: Input should be less than or equal to 1"),
    ("sim.end_signal_delay_s", -1.0, "sim.end_signal_delay_s=-1.0: Input should be greater than or equal to 0"),
    ("sim.inactivity_timeout_s", 0.0, "sim.inactivity_timeout_s=0.0: Input should be greater than 0"),
    ("sim.replicas", 2, "sim.replicas=2 needs a routing policy (routing: round_robin, cache_aware, sticky, pbkv)"),
    ("sim.routing", "random", "sim.routing=random: should be one of none, round_robin, cache_aware, sticky, pbkv"),
    ("sim.router.cache_aware.cache_threshold", 5.0,
     "sim.router.cache_aware.cache_threshold=5.0: Input should be less than or equal to 1"),
    ("sim.router.pbkv.load_factor", 0.5, "sim.router.pbkv.load_factor=0.5: Input should be greater than or equal to 1"),
    ("sim.seed", 3, "sim.seed=3: the simulator's seed is set by seed (or seeds), not here"),
    ("wandb.mode", "loud", "wandb.mode=loud: should be one of online, offline, disabled"),
    ("cost_model.mfu", 0, "cost_model.mfu=0.0: Input should be greater than 0"),
    ("cost_model.pcie_efficiency", 1.5, "cost_model.pcie_efficiency=1.5: Input should be less than or equal to 1"),
    ("cost_model.layers", 0, "cost_model.layers=0: Input should be greater than or equal to 1"),
    ("cost_model.peak_flops", -1.0, "cost_model.peak_flops=-1.0: Input should be greater than 0"),
    ("data.path", "/no/such/dataset", "data.path=/no/such/dataset: no such directory"),
    ("data.split.val", 0.95, "data.split: val=0.95, test=0.1: val + test should be below 1 "
                             "(the rest is the train split)"),
    ("data.source.n_workflows", 0, "data.source.n_workflows=0: Input should be greater than or equal to 1"),
]


@pytest.fixture(scope="module")
def base():
    cfg = compose_config("evaluate", [])
    settings(cfg)  # the shipped config is valid
    return cfg


@pytest.mark.parametrize("key, value, message", CASES, ids=[f"{k}={v}" for k, v, _ in CASES])
def test_bad_setting_is_one_line_naming_it(base, key, value, message):
    cfg = base.copy()
    OmegaConf.update(cfg, key, value, merge=False)
    with pytest.raises(ConfigError) as e:
        settings(cfg)
    assert str(e.value) == message


@pytest.mark.parametrize("override, key", [("sim.gpu_tokens=1.5", "sim.gpu_tokens"), ("sim.gpu_tokens=lots", "sim.gpu_tokens"),
                                           ("pbkv.horizn=3", "pbkv.horizn"), ("sim.router.cache_aware.cache_threshold=high",
                                                                              "sim.router.cache_aware.cache_threshold")])
def test_a_wrong_type_or_unknown_key_fails_when_hydra_composes(override, key):
    with pytest.raises(Exception) as e:
        compose_config("evaluate", [override])
    assert key in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("override, message", [
    ("+pbkv.horizn=3", "pbkv.horizn: not a setting of pbkv (known: gamma, horizon, outcome_cumulative, "
                       "outcome_margin, outcome_min_calls, outcome_real_weight, outcome_return_z, outcome_sample, "
                       "outcome_seed, "
                       "outcome_slack, outcome_unit, outcome_window, outcome_z, time_tau_s, trust, trust_margin, "
                       "trust_threshold, trust_window)"),
    ("+colour=red", "colour: not a setting of evaluate.py"),
])
def test_a_key_added_with_plus_is_refused_by_the_checks(override, message):
    with pytest.raises(ConfigError) as e:
        settings(compose_config("evaluate", [override]))
    assert str(e.value).startswith(message)


def test_known_names_come_from_the_code(base):
    from serving_integration.cache.policies import POLICIES

    assert set(evaluated_policies()) == {*POLICIES, "pbkv_perfect", "pbkv_time_perfect"}
    cfg = base.copy()
    OmegaConf.update(cfg, "policies", list(evaluated_policies()), merge=False)
    settings(cfg)


def test_a_checkpoint_whose_horizon_is_not_pbkv_horizon_is_refused(base, tmp_path):
    """One K per run: the rows are labelled with pbkv.horizon, the checkpoint predicts its own K."""
    from models import save_predictor
    from models.markov import MarkovPredictor

    path = tmp_path / "predictor.pt"
    save_predictor(MarkovPredictor.from_sequences(["<unk>", "a", "b"], 3, [[1, 2, 1]], order=1), path)
    cfg = base.copy()
    OmegaConf.update(cfg, "predictor.checkpoint", str(path), merge=False)
    settings(cfg)  # K = 3 = pbkv.horizon
    OmegaConf.update(cfg, "pbkv.horizon", 5, merge=False)
    with pytest.raises(ConfigError) as e:
        settings(cfg)
    assert str(e.value) == f"pbkv.horizon=5: predictor.checkpoint={path} predicts 3 steps; set pbkv.horizon=3"


def test_run_checks_before_any_work_and_writes_nothing(base, tmp_path, capsys, monkeypatch):
    cfg = base.copy()
    OmegaConf.update(cfg, "sim.concurrency", 0, merge=False)
    monkeypatch.setattr(evaluate_py, "evaluate", lambda *a: pytest.fail("evaluated a bad config"))
    assert run_reported(evaluate_py.run, cfg, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err == "error: sim.concurrency=0: Input should be greater than or equal to 1\n"
    assert list(tmp_path.iterdir()) == []


def test_run_dir_may_not_be_or_hold_the_dataset(base, tmp_path, capsys, monkeypatch):
    refused_over_its_dataset(evaluate_py, "evaluate.evaluate", base, tmp_path, capsys, monkeypatch)
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


def test_a_value_hydra_cannot_compose_exits_2_too(tmp_path):
    """A wrong type fails while Hydra composes (before evaluate.py's own checks): still exit status 2,
    with Hydra's message naming the key, and nothing written."""
    import subprocess

    done = subprocess.run([sys.executable, "evaluate.py", f"hydra.run.dir={tmp_path / 'run'}", "sim.gpu_tokens=lots"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "sim.gpu_tokens" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
