"""Latency cost model of one serving GPU: prefill, decode steps and PCIe transfers.

    prefill(n new tokens after c cached)  = n * (2 * P + 4 * L * H * D * (c + n / 2)) / (F * mfu)
    decode_step(batch b, KV tokens T)     = overhead + max((W + T * kv) / (B * bw_eff), b * 2 * P / (F * mfu))
    pcie(t tokens)                        = t * kv / (pcie * pcie_eff)

P: active parameters; L, H, D: layers, query heads, head size (attention FLOPs grow with the
context); W: weight bytes; kv: KV bytes per token = 2 * L * kv_heads * D * dtype bytes; F: peak
dense bf16 FLOP/s; B: memory bandwidth; pcie: host link bandwidth. Efficiencies are assumptions,
named so that sweeps can change them. Presets live in conf/cost_model/ (Qwen3-14B on one H100,
and on one RTX A6000), e.g. `python evaluate.py cost_model=qwen3-14b-a6000`.

Sources. Qwen3-14B: 40 layers, 40 query / 8 KV heads, head size 128, 14.8e9 parameters (the model's
config.json on its model card); KV per token 2 * 40 * 8 * 128 * 2 B = 160 KiB. H100 SXM: 989 TFLOP/s
dense bf16, 3.35 TB/s HBM3, PCIe 5.0 x16 64 GB/s (NVIDIA H100 datasheet). RTX A6000: 154.8 TFLOP/s
dense bf16 tensor, 768 GB/s GDDR6, PCIe 4.0 x16 32 GB/s (NVIDIA RTX A6000 datasheet).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

TARGET = "serving_integration.simulator.cost_model.CostModel"  # the one `_target_` a preset may name


@dataclass(frozen=True)
class CostModel:
    name: str
    params: float  # active parameters
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # bytes/s
    pcie_bandwidth: float  # bytes/s, host <-> GPU
    mfu: float = 0.5  # share of peak FLOP/s reached in prefill
    bandwidth_efficiency: float = 0.75  # share of memory bandwidth reached in decode
    pcie_efficiency: float = 0.8
    step_overhead_s: float = 0.002  # scheduler + kernel launches per iteration

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        attention = 4 * self.layers * self.q_heads * self.head_dim * (cached_tokens + new_tokens / 2)
        return new_tokens * (2 * self.params + attention) / (self.peak_flops * self.mfu)

    def decode_step_s(self, batch: int, kv_tokens: float) -> float:
        memory = (self.weight_bytes + kv_tokens * self.kv_bytes_per_token) / (self.mem_bandwidth * self.bandwidth_efficiency)
        compute = batch * 2 * self.params / (self.peak_flops * self.mfu)
        return self.step_overhead_s + max(memory, compute)

    def pcie_s(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / (self.pcie_bandwidth * self.pcie_efficiency)

    def pcie_tokens(self, seconds: float) -> int:
        return int(seconds * self.pcie_bandwidth * self.pcie_efficiency / self.kv_bytes_per_token)


def from_preset(preset: Mapping[str, Any], where: str) -> CostModel:
    """A cost model from a preset's values (conf/cost_model/*.yaml, or the file calibrate wrote):
    its `_target_` may only name CostModel itself, every other key is one of CostModel's fields with
    a number (or the name), and nothing read from the file is ever called."""
    values = dict(preset)
    target = values.pop("_target_", TARGET)
    if target != TARGET:
        raise ValueError(f"{where}: _target_={target}: a cost-model preset builds {TARGET} only")
    fields = {f.name: f.type for f in dataclasses.fields(CostModel)}
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"{where}: {key} is not a CostModel field ({', '.join(fields)})")
        wanted = str if key == "name" else (int, float)
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise ValueError(f"{where}: {key}={value!r} is not a {'string' if key == 'name' else 'number'}")
    missing = [name for name, f in ((f.name, f) for f in dataclasses.fields(CostModel))
               if f.default is dataclasses.MISSING and name not in values]
    if missing:
        raise ValueError(f"{where}: missing CostModel field(s) {', '.join(missing)}")
    return CostModel(**values)


def read_preset(path) -> CostModel:
    """A preset YAML file, read as values (yaml.safe_load) and built by `from_preset`."""
    from pathlib import Path

    import yaml

    path = Path(path)
    try:
        preset = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: not a readable cost-model preset ({(str(e).splitlines() or [''])[0]})") from None
    if not isinstance(preset, dict):
        raise ValueError(f"{path}: a cost-model preset is a mapping of CostModel fields")
    return from_preset(preset, str(path))
