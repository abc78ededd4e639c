"""The cost-model fit (experiments.calibrate) recovers the parameters that made a run's timings."""

import json

import numpy as np
import pytest

from serving_integration.experiments import calibrate
from serving_integration.simulator.cost_model import CostModel

SHAPE = {"name": "t", "params": 4.2e6, "layers": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "dtype_bytes": 4,
         "peak_flops": 1.66e11, "mem_bandwidth": 2e10, "pcie_bandwidth": 1e10}


def synthetic_calls(truth: CostModel, n: int = 60, seed: int = 0, stalls: int = 0) -> list[dict]:
    """Calls one after another (batch 1), timed by `truth`; `stalls` of them delayed 2 s (another process)."""
    rng = np.random.default_rng(seed)
    calls, clock = [], 0.0
    for i in range(n):
        prompt = int(rng.integers(200, 3000))
        cached = int(rng.integers(0, prompt))
        host = int(rng.integers(0, cached + 1))
        out = int(rng.integers(2, 40))
        ttft = (truth.request_overhead_s + truth.prefill_s(prompt - cached, cached) + truth.pcie_s(host)
                + truth.step_overhead_s)
        decode = (out - 1) * truth.decode_step_s(1, prompt + out / 2)
        if i < stalls:
            decode += 2.0
        calls.append({"ok": True, "prompt_tokens": prompt, "cached_tokens": cached, "host_tokens": host,
                      "completion_tokens": out, "ttft_s": ttft, "latency_s": ttft + decode,
                      "start_s": clock, "end_s": clock + ttft + decode})
        clock += ttft + decode + 0.01
    return calls


@pytest.mark.parametrize("stalls", [0, 3])
def test_fit_recovers_the_timings_parameters(stalls):
    truth = CostModel(**SHAPE, mfu=0.3, bandwidth_efficiency=0.02, pcie_efficiency=0.005, step_overhead_s=0.01,
                      request_overhead_s=0.02)
    cost, report = calibrate.fit(synthetic_calls(truth, stalls=stalls), SHAPE)
    assert cost.mfu == pytest.approx(0.3, rel=0.1)
    assert cost.step_overhead_s == pytest.approx(0.01, rel=0.15)
    assert cost.request_overhead_s == pytest.approx(0.02, rel=0.15)  # in TTFT only, told from the step's
    assert cost.pcie_efficiency == pytest.approx(0.005, rel=0.15)
    assert report["success"]


def test_a_decoding_call_waits_for_another_calls_prefill_but_not_its_request_overhead():
    """Call b's first token comes while a decodes: a's decode time counts b's prefill step, not the
    HTTP and tokenization b spent before reaching the scheduler."""
    cost = CostModel(**SHAPE, mfu=0.3, bandwidth_efficiency=0.02, pcie_efficiency=0.005, step_overhead_s=0.01,
                     request_overhead_s=0.5)
    a = {"prompt_tokens": 100, "cached_tokens": 0, "completion_tokens": 50, "ttft_s": 0.6, "start_s": 0.0,
         "end_s": 10.0}
    b = {"prompt_tokens": 300, "cached_tokens": 100, "completion_tokens": 2, "ttft_s": 0.6, "start_s": 2.0,
         "end_s": 3.0}
    for c in (a, b):
        c["latency_s"] = c["end_s"] - c["start_s"]
    features = calibrate.features([a, b])
    ttft, decode = calibrate.predicted(cost, features)
    prefill_b = cost.prefill_s(200, 100) + cost.step_overhead_s
    assert ttft[1] == pytest.approx(prefill_b + 0.5)
    assert decode[0] == pytest.approx(49 * cost.decode_step_s(int(features["batch"][0]), features["kv"][0]) + prefill_b)


def test_a_parameter_the_run_cannot_see_is_named(tmp_path):
    """With a tiny decode memory term, bandwidth_efficiency ends on its bound: the preset says so."""
    truth = CostModel(**SHAPE, mfu=0.3, bandwidth_efficiency=1.0, pcie_efficiency=0.05, step_overhead_s=0.01)
    path = tmp_path / "calls.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in synthetic_calls(truth)))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2,
                                                         "num_key_value_heads": 2, "hidden_size": 128}))
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(1000, 128), "lm_head.weight": torch.zeros(1000, 128)},
              str(model_dir / "model.safetensors"))
    assert calibrate.model_shape(model_dir)["params"] == 1000 * 128  # the input embedding is a lookup
    cost, report = calibrate.fit_preset(path, tmp_path / "preset.yaml", model_dir=model_dir, peak_flops=1.66e11,
                                        mem_bandwidth=2e10, pcie_bandwidth=1e10)
    assert "bandwidth_efficiency" in report["at_bounds"]
    assert "not identified" in (tmp_path / "preset.yaml").read_text()
    # the preset reads back through conf/cost_model's schema (CostModel), as evaluate.py reads it
    from serving_integration.simulator.config import cost_model_preset

    again = cost_model_preset(tmp_path / "preset.yaml")
    assert again.name == cost.name and again.mfu == pytest.approx(cost.mfu, rel=1e-5)


def test_a_fit_stays_under_runs_until_promoted(tmp_path, monkeypatch, capsys):
    """calibrate writes its fit under runs/ (or --out); only --promote copies a preset into conf/cost_model."""
    from pathlib import Path

    truth = CostModel(**SHAPE, mfu=0.3, bandwidth_efficiency=0.02, pcie_efficiency=0.005, step_overhead_s=0.01)
    calls = tmp_path / "calls.jsonl"
    calls.write_text("\n".join(json.dumps(c) for c in synthetic_calls(truth)))
    monkeypatch.setattr(calibrate, "FITTED_DIR", tmp_path / "runs" / "calibrate")
    monkeypatch.setattr(calibrate, "CONF_DIR", tmp_path / "conf")
    monkeypatch.setattr(calibrate, "model_shape", lambda _: {k: SHAPE[k] for k in SHAPE if k not in (
        "name", "peak_flops", "mem_bandwidth", "pcie_bandwidth")})
    assert calibrate.main(["--calls", str(calls), "--name", "tiny-fit"]) == 0
    fitted = tmp_path / "runs" / "calibrate" / "tiny-fit.yaml"
    assert fitted.is_file() and not (tmp_path / "conf").exists()
    assert calibrate.main(["--promote", str(fitted)]) == 0
    assert (tmp_path / "conf" / "cost_model" / "tiny-fit.yaml").read_text() == fitted.read_text()
    (tmp_path / "bad.yaml").write_text("_target_: builtins.dict\nname: x\n")
    capsys.readouterr()
    assert calibrate.main(["--promote", str(tmp_path / "bad.yaml")]) == 2
    assert "not a fitted cost-model preset" in capsys.readouterr().err
    assert calibrate.main([]) == 2 and not Path(tmp_path / "conf" / "cost_model" / "x.yaml").exists()
