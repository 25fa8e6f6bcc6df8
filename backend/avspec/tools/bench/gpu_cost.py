"""A modelled step cost for a memory-bound GPU target: a roofline per forward, as a StepCost.

No GPU has run this project's served path, so GPU figures are replays priced by this model and
reported as modelled, never as measured. One forward over `tokens` tokens in `rows` rows costs

    launch_ms + max(weight bytes / (bandwidth x bw_efficiency),
                    2 x params x tokens / (peak FLOP/s x flop_efficiency))
              + rows x context x KV bytes per token / (bandwidth x bw_efficiency)

the weights streamed once per forward until the tokens fill the compute, plus each row reading
its own KV cache. The target is `verify` (by tokens) with the KV term as `verify_row_ms`; the
draft is an autoregressive model priced the same way per pass, by rows; the step adds a fixed
`overhead_ms` (the served path's hops and the verifier).

The defaults, with their sources:
- H100 SXM5: 3.35 TB/s HBM3 and 989 dense bf16 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet);
- Llama-3.1-8B: 8.03e9 parameters, 32 layers x 8 KV heads x head dim 128, so 131,072 KV bytes
  per token in bf16 (the model's config.json);
- draft Llama-3.2-1B: 1.24e9 parameters, 16 layers x 8 KV heads x head dim 64, so 32,768 KV
  bytes per token (its config.json);
- efficiencies 0.8 of bandwidth and 0.6 of peak compute, a launch cost of 0.3 ms per forward
  (kernel launches under CUDA graphs) and a 2 ms step overhead: assumptions, not measurements.
  With them an 8B bf16 decode step at batch 1 costs 6.3 ms, about 160 tokens/s, in the range
  published for TensorRT-LLM on an H100.
"""

from __future__ import annotations

from dataclasses import dataclass

from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost


@dataclass(frozen=True)
class Gpu:
    name: str
    bandwidth_gb_s: float  # memory bandwidth, GB/s
    peak_tflops: float  # dense bf16
    bw_efficiency: float = 0.8
    flop_efficiency: float = 0.6
    launch_ms: float = 0.3  # per forward

    @property
    def bytes_per_ms(self) -> float:
        return self.bandwidth_gb_s * 1e6 * self.bw_efficiency

    @property
    def flops_per_ms(self) -> float:
        return self.peak_tflops * 1e9 * self.flop_efficiency


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    kv_bytes_per_token: float
    bytes_per_param: float = 2.0  # bf16


H100_SXM = Gpu("H100 SXM5", bandwidth_gb_s=3350.0, peak_tflops=989.0)
LLAMA_8B = Model("Llama-3.1-8B", params=8.03e9, kv_bytes_per_token=2 * 32 * 8 * 128 * 2)
LLAMA_1B = Model("Llama-3.2-1B", params=1.24e9, kv_bytes_per_token=2 * 16 * 8 * 64 * 2)


def forward_ms(model: Model, gpu: Gpu, tokens: int) -> float:
    """ms of one forward over `tokens` tokens, without the per-row KV reads."""
    weights = model.params * model.bytes_per_param / gpu.bytes_per_ms
    compute = 2.0 * model.params * tokens / gpu.flops_per_ms
    return gpu.launch_ms + max(weights, compute)


def kv_ms(model: Model, gpu: Gpu, rows: int, context: int) -> float:
    """ms for `rows` rows to read `context` tokens of KV cache each."""
    return rows * context * model.kv_bytes_per_token / gpu.bytes_per_ms


def knee_tokens(model: Model, gpu: Gpu) -> float:
    """Tokens at which one forward turns from streaming weights to compute."""
    return model.bytes_per_param * gpu.flops_per_ms / (2.0 * gpu.bytes_per_ms)


def gpu_step_cost(
    target: Model = LLAMA_8B,
    draft: Model = LLAMA_1B,
    gpu: Gpu = H100_SXM,
    context: int = 512,
    overhead_ms: float = 2.0,
) -> StepCost:
    """The StepCost of `target` verifying and `draft` drafting on `gpu`, rows at `context`.

    Both curves are piecewise linear with one knee, so tables through the knee and beyond it
    are exact (a CostTable extends its last segment)."""
    if context < 0 or overhead_ms < 0:
        raise ValueError(f"need context >= 0 and overhead_ms >= 0, got {context}, {overhead_ms}")
    rows = _ladder(knee_tokens(draft, gpu))
    tokens = _ladder(knee_tokens(target, gpu))
    draft_ms = [forward_ms(draft, gpu, r) + kv_ms(draft, gpu, r, context) for r in rows]
    return StepCost(
        CostTable(rows, draft_ms, name="draft_pass"),
        CostTable(tokens, [forward_ms(target, gpu, t) for t in tokens], name="verify"),
        overhead_ms=overhead_ms,
        verify_row_ms=kv_ms(target, gpu, 1, context),
    )


def _ladder(knee: float) -> list[int]:
    """Powers of two to 4096 and the integers around `knee`."""
    sizes = {2**i for i in range(13)} | {max(1, int(knee)), int(knee) + 1}
    return sorted(sizes)
