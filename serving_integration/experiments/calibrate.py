"""Fit the cost model's efficiencies to a real server's per-request timings (a bench run).

    python -m serving_integration.experiments.calibrate --calls runs/bench/hover/calls.jsonl \\
        --model-dir .cache/pbkv/models/tiny-llama --name cpu-tiny-llama \\
        --peak-flops 1.66e11 --mem-bandwidth 2e10 --pcie-bandwidth 1e10

The model's shape (layers, heads, head size, parameter count, dtype) is read from its directory
(config.json and the safetensors header); the hardware's nominal peak FLOP/s, memory bandwidth and
host-link bandwidth are given. What is fitted (scipy.optimize.least_squares on the times, in seconds) are the
cost model's free parameters (serving_integration/simulator/cost_model.py): `mfu`,
`bandwidth_efficiency`, `pcie_efficiency`, `step_overhead_s` and `request_overhead_s`, from every
successful call of calls.jsonl:

    TTFT                 = request_overhead_s + prefill_s(missed, cached) + pcie_s(host hits) + step_overhead_s
    latency - TTFT       = (output tokens - 1) * decode_step_s(batch, KV tokens)
                           + the prefill steps (TTFT less request_overhead_s) of the calls whose
                             prefill ran while this call decoded

where a call's decode batch is the number of calls in flight during it (from their start and end
times) and its KV tokens the batch times its context. The preset is written under runs/
(runs/calibrate/NAME.yaml, or --out); the fit's residuals are printed. Making it a preset of
conf/ is a separate, explicit step, so no run rewrites tracked configuration:

    python -m serving_integration.experiments.calibrate --promote runs/calibrate/cpu-tiny-llama.yaml

copies a fitted preset to conf/cost_model/NAME.yaml (NAME from its `name`) after checking it builds
a cost model; then `python evaluate.py cost_model=NAME`.
On a GPU: run the bench client against the GPU server, then this command with that GPU's datasheet
peak FLOP/s, memory and PCIe bandwidths (docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from data import CONF_DIR, REPO

ROBUST_SCALE_S = 0.05  # residuals beyond about 50 ms weigh linearly, not quadratically
FITTED = ("mfu", "bandwidth_efficiency", "pcie_efficiency", "step_overhead_s", "request_overhead_s")
START = {"mfu": 0.3, "bandwidth_efficiency": 0.5, "pcie_efficiency": 0.5, "step_overhead_s": 0.01,
         "request_overhead_s": 0.01}
BOUNDS = {"mfu": (1e-4, 1.0), "bandwidth_efficiency": (1e-4, 1.0), "pcie_efficiency": (1e-4, 1.0),
          "step_overhead_s": (1e-5, 1.0), "request_overhead_s": (1e-5, 1.0)}
# input embedding tables: a lookup per token, no multiply (Kaplan et al. 2020 count parameters without them)
EMBEDDING_TABLES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
DTYPE_BYTES = {"float32": 4, "F32": 4, "bfloat16": 2, "BF16": 2, "float16": 2, "F16": 2}


def model_shape(model_dir: str | Path) -> dict:
    """The cost model's shape fields from a Hugging Face model directory; `params` counts the weights
    a token is multiplied by (every tensor but the input embedding table)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    params, dtype = 0, None
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith(EMBEDDING_TABLES):
                    continue
                tensor = f.get_slice(key)
                params += math.prod(tensor.get_shape())
                dtype = dtype or tensor.get_dtype()
    if not params:
        raise ValueError(f"{model_dir}: no safetensors weights found")
    heads = config["num_attention_heads"]
    return {"params": float(params), "layers": config["num_hidden_layers"], "q_heads": heads,
            "kv_heads": config.get("num_key_value_heads", heads),
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "dtype_bytes": DTYPE_BYTES.get(dtype or config.get("dtype") or config.get("torch_dtype"), 2)}


def read_calls(path: str | Path) -> list[dict]:
    calls = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            call = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
        if call.get("ok") and not math.isnan(call.get("ttft_s", math.nan)) and call.get("completion_tokens", 0) >= 1:
            calls.append(call)
    if len(calls) < len(FITTED) + 1:
        raise ValueError(f"{path}: {len(calls)} usable calls (ok, streamed, with output); need at least {len(FITTED) + 1}")
    return calls


def features(calls: list[dict]) -> dict:
    """Per call: missed, cached and host-hit tokens, decode steps, decode batch and KV tokens."""
    starts = np.array([c["start_s"] for c in calls])
    ends = np.array([c["end_s"] for c in calls])
    first_tokens = starts + np.array([c["ttft_s"] for c in calls])
    batch, kv, interrupts = [], [], []
    for i, c in enumerate(calls):
        live = (starts < c["end_s"]) & (ends > first_tokens[i])  # calls in flight while this one decodes
        batch.append(max(int(live.sum()), 1))
        kv.append(batch[-1] * (c["prompt_tokens"] + c["completion_tokens"] / 2))
        # prefills of other calls that ran while this one decoded (SGLang runs them first)
        inside = (first_tokens > first_tokens[i]) & (first_tokens < c["end_s"])
        inside[i] = False
        interrupts.append(np.flatnonzero(inside))
    return {"missed": np.array([c["prompt_tokens"] - c["cached_tokens"] for c in calls], float),
            "cached": np.array([c["cached_tokens"] for c in calls], float),
            "host": np.array([c.get("host_tokens", 0) for c in calls], float),
            "steps": np.array([c["completion_tokens"] - 1 for c in calls], float),
            "batch": np.array(batch, float), "kv": np.array(kv, float), "interrupts": interrupts,
            "ttft": np.array([c["ttft_s"] for c in calls], float),
            "decode": np.array([max(c["latency_s"] - c["ttft_s"], 1e-6) for c in calls], float)}


def predicted(cost, f: dict) -> tuple[np.ndarray, np.ndarray]:
    prefill = np.array([cost.prefill_s(int(m), int(c)) + cost.pcie_s(h) + cost.step_overhead_s
                        for m, c, h in zip(f["missed"], f["cached"], f["host"])])
    # a decoding call waits for other calls' prefill steps, not for their HTTP and tokenization
    decode = np.array([s * cost.decode_step_s(int(b), k) + prefill[others].sum()
                       for s, b, k, others in zip(f["steps"], f["batch"], f["kv"], f["interrupts"])])
    return prefill + cost.request_overhead_s, decode


def fit(calls: list[dict], base: dict):
    """The fitted CostModel and a report of its residuals."""
    from scipy.optimize import least_squares

    from serving_integration.simulator.cost_model import CostModel

    f = features(calls)
    use_decode = f["steps"] > 0
    lo = np.log([BOUNDS[k][0] for k in FITTED])
    hi = np.log([BOUNDS[k][1] for k in FITTED])

    def model(x):
        return CostModel(**base, **dict(zip(FITTED, np.exp(x))))

    def residuals(x):
        ttft, decode = predicted(model(x), f)
        return np.concatenate([ttft - f["ttft"], decode[use_decode] - f["decode"][use_decode]])

    x0 = np.clip(np.log([START[k] for k in FITTED]), lo, hi)
    # soft_l1: a call stalled by another process on a shared machine must not set the fit (Huber-like)
    result = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=ROBUST_SCALE_S)
    cost = model(result.x)
    ttft, decode = predicted(cost, f)
    report = {"calls": len(calls), "ttft_mean_s": (float(f["ttft"].mean()), float(ttft.mean())),
              "decode_mean_s": (float(f["decode"].mean()), float(decode.mean())),
              "rms_residual_s": float(np.sqrt(np.mean(result.fun ** 2))), "success": bool(result.success)}
    return cost, report


def preset_yaml(cost, source: str, report: dict) -> str:
    from dataclasses import asdict

    lines = [f"# {cost.name}: fitted by `python -m serving_integration.experiments.calibrate` from {source}",
             f"# ({report['calls']} calls; rms residual {report['rms_residual_s']:.3f} s). Nominal peak FLOP/s,",
             "# memory and host-link bandwidths are inputs; mfu, the efficiencies, step and request overheads are fitted"
             + (f"\n# (at a bound, so not identified by that run: {', '.join(report['at_bounds'])})."
                if report.get("at_bounds") else "."),
             "defaults:", "  - schema                 # serving_integration/simulator/cost_model.py CostModel: "
             "each field's range and help", "  - _self_", ""]
    for key, value in asdict(cost).items():
        # floats with a mantissa dot: YAML 1.1 (PyYAML) reads `1e+11` as a string
        lines.append(f"{key}: {value!r}" if not isinstance(value, float) else f"{key}: {value:.6e}")
    return "\n".join(lines) + "\n"


def at_bounds(cost) -> list[str]:
    """Fitted parameters that ended on a bound: the run did not pin them down (say so beside the fit)."""
    return [k for k in FITTED if any(math.isclose(getattr(cost, k), b, rel_tol=1e-3) for b in BOUNDS[k])]


def fit_preset(calls_path: str | Path, out: str | Path, *, name: str = "cpu-tiny-llama", model_dir: str | Path,
               peak_flops: float, mem_bandwidth: float, pcie_bandwidth: float):
    """Fit the cost model to a bench run's calls.jsonl and write it as a conf/cost_model preset at `out`."""
    from data.atomic import atomic_file

    base = {"name": name, **model_shape(model_dir), "peak_flops": peak_flops, "mem_bandwidth": mem_bandwidth,
            "pcie_bandwidth": pcie_bandwidth}
    cost, report = fit(read_calls(calls_path), base)
    report["at_bounds"] = at_bounds(cost)
    with atomic_file(Path(out)) as tmp:
        tmp.write_text(preset_yaml(cost, Path(calls_path).name, report))
    return cost, report


def describe(cost, report: dict) -> str:
    bounded = f"; at a bound (not identified by this run): {', '.join(report['at_bounds'])}" if report["at_bounds"] else ""
    return (f"fitted on {report['calls']} calls: " + ", ".join(f"{k}={getattr(cost, k):.4g}" for k in FITTED) + "\n"
            f"mean TTFT real {report['ttft_mean_s'][0]:.3f} s, model {report['ttft_mean_s'][1]:.3f} s; "
            f"mean decode real {report['decode_mean_s'][0]:.3f} s, model {report['decode_mean_s'][1]:.3f} s; "
            f"rms residual {report['rms_residual_s']:.3f} s{bounded}")


# This machine's CPU (AMD EPYC, Zen 4, 2 cores at 2.6 GHz): 2 x 2.6e9 x 32 fp32 FLOP per cycle
# (AVX-512 FMA); memory and host-copy bandwidths are round nominal figures.
CPU_PEAK_FLOPS, CPU_MEM_BANDWIDTH, CPU_COPY_BANDWIDTH = 1.66e11, 2e10, 1e10


FITTED_DIR = REPO / "runs" / "calibrate"  # where fits go; conf/cost_model only by --promote


def promote(fitted: str | Path) -> Path:
    """Copy a fitted preset to conf/cost_model/NAME.yaml (atomically), once it builds a CostModel."""
    from data.atomic import atomic_file
    from data.errors import ConfigError
    from serving_integration.simulator.config import cost_model_preset

    text = Path(fitted).read_text()
    try:  # values only: a preset names no code (cost_model_preset builds CostModel and nothing else)
        cost = cost_model_preset(fitted)
    except ConfigError as e:
        raise ValueError(f"{fitted}: not a fitted cost-model preset ({e})") from None
    target = CONF_DIR / "cost_model" / f"{cost.name}.yaml"
    with atomic_file(target) as tmp:
        tmp.write_text(text)
    return target


def main(argv=None) -> int:
    from serving_integration.server.tiny_model import DEFAULT_DIR

    p = argparse.ArgumentParser(prog="python -m serving_integration.experiments.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", help="a bench run's calls.jsonl (streamed, so TTFT is known)")
    p.add_argument("--promote", metavar="FITTED_YAML",
                   help="copy this fitted preset to conf/cost_model/NAME.yaml instead of fitting")
    p.add_argument("--model-dir", default=str(DEFAULT_DIR), help="the served model's directory (shape)")
    p.add_argument("--name", default="cpu-tiny-llama")
    p.add_argument("--peak-flops", type=float, default=CPU_PEAK_FLOPS, help="nominal peak FLOP/s of the serving device")
    p.add_argument("--mem-bandwidth", type=float, default=CPU_MEM_BANDWIDTH, help="nominal memory bandwidth, bytes/s")
    p.add_argument("--pcie-bandwidth", type=float, default=CPU_COPY_BANDWIDTH, help="nominal host-link bandwidth, bytes/s")
    p.add_argument("--out", help="default runs/calibrate/NAME.yaml")
    args = p.parse_args(argv)
    if bool(args.calls) == bool(args.promote):
        print("error: give --calls (fit a preset) or --promote FITTED_YAML (copy one into conf/cost_model)",
              file=sys.stderr)
        return 2
    if args.promote:
        try:
            print(f"promoted {args.promote} to {promote(args.promote)}")
        except Exception as e:  # an unreadable file, bad YAML or a config that builds no CostModel: one line
            print(f"error: {args.promote}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        return 0
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.name):
        print(f"error: --name {args.name}: a preset name (letters, digits, _ . -), not a path", file=sys.stderr)
        return 2
    out = Path(args.out or FITTED_DIR / f"{args.name}.yaml")
    try:
        from data.atomic import check_command_output

        check_command_output(out, [args.calls, args.model_dir])  # never over the calls it fits
        cost, report = fit_preset(args.calls, out, name=args.name, model_dir=args.model_dir, peak_flops=args.peak_flops,
                                  mem_bandwidth=args.mem_bandwidth, pcie_bandwidth=args.pcie_bandwidth)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(cost, report))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
