"""Latency cost model of one serving GPU: prefill, decode steps and PCIe transfers.

    prefill(n new tokens after c cached)  = n * (2 * P + 4 * L * H * D * (c + n / 2)) / (F * mfu)
    decode_step(batch b, KV tokens T)     = overhead + max((W + T * kv) / (B * bw_eff), b * 2 * P / (F * mfu))
    pcie(t tokens)                        = t * kv / (pcie * pcie_eff)
    request                               = request_overhead_s, once per call before it reaches the queue

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

from dataclasses import MISSING, dataclass

from data.knobs import above, at_least, at_most, check, knob, nonempty


@dataclass(frozen=True)
class CostModel:
    """conf/cost_model: one serving GPU and the model on it (the schema of those presets)."""

    name: str = knob(MISSING, "the preset's name, carried by every row", nonempty)
    params: float = knob(MISSING, "active parameters", above(0))
    layers: int = knob(MISSING, "transformer layers", at_least(1))
    q_heads: int = knob(MISSING, "query heads", at_least(1))
    kv_heads: int = knob(MISSING, "KV heads", at_least(1))
    head_dim: int = knob(MISSING, "head size", at_least(1))
    dtype_bytes: int = knob(MISSING, "bytes per weight and KV value", at_least(1))
    peak_flops: float = knob(MISSING, "dense bf16 FLOP/s", above(0))
    mem_bandwidth: float = knob(MISSING, "memory bandwidth, bytes/s", above(0))
    pcie_bandwidth: float = knob(MISSING, "host <-> GPU bandwidth, bytes/s", above(0))
    mfu: float = knob(0.5, "share of peak FLOP/s reached in prefill", above(0), at_most(1))
    bandwidth_efficiency: float = knob(0.75, "share of memory bandwidth reached in decode", above(0), at_most(1))
    pcie_efficiency: float = knob(0.8, "share of the host link's bandwidth reached", above(0), at_most(1))
    step_overhead_s: float = knob(0.002, "scheduler + kernel launches per iteration", at_least(0))
    request_overhead_s: float = knob(0.0, "per call, before the scheduler sees it (the HTTP hops, a router's "
                                     "included, and tokenization): it delays the call and counts in its TTFT, "
                                     "while no scheduler step waits on it", at_least(0))

    def __post_init__(self):
        check(self)
        # the formulas' constant factors, computed once (a replay calls them a few times per call),
        # each the very product the formula computed inline, so every time is the same float
        for name, value in (("kv_bytes_per_token", 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes),
                            ("weight_bytes", self.params * self.dtype_bytes),
                            ("_attention_factor", 4 * self.layers * self.q_heads * self.head_dim),
                            ("_two_params", 2 * self.params),
                            ("_prefill_flops", self.peak_flops * self.mfu),
                            ("_decode_bandwidth", self.mem_bandwidth * self.bandwidth_efficiency),
                            ("_pcie_rate", self.pcie_bandwidth * self.pcie_efficiency)):
            object.__setattr__(self, name, value)  # frozen: not fields, so not part of the schema

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        attention = self._attention_factor * (cached_tokens + new_tokens / 2)
        return new_tokens * (self._two_params + attention) / self._prefill_flops

    def decode_step_s(self, batch: int, kv_tokens: float) -> float:
        memory = (self.weight_bytes + kv_tokens * self.kv_bytes_per_token) / self._decode_bandwidth
        compute = batch * 2 * self.params / self._prefill_flops
        return self.step_overhead_s + max(memory, compute)

    def pcie_s(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / self._pcie_rate

    @property
    def pcie_tokens_per_s(self) -> float:
        """KV tokens the host link carries per second (pcie_tokens is its whole part over a window)."""
        return self.pcie_bandwidth * self.pcie_efficiency / self.kv_bytes_per_token

    def pcie_tokens(self, seconds: float) -> int:
        return int(seconds * self.pcie_bandwidth * self.pcie_efficiency / self.kv_bytes_per_token)
