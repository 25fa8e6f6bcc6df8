"""Test oracle: what a TensorRT-LLM LLaMA engine computes from a checkpoint, in plain torch.

Written from TensorRT-LLM's layer definitions, not from avspec's modules, so a wrong name, layout
or gate in the exporter shows up as a logit mismatch:

- `RmsNorm`: x * rsqrt(mean(x^2) + norm_epsilon) * weight;
- `Attention` with `rope_gpt_neox`: q/k rotated by the "rotate half" rule, qkv rows = q | k | v,
  causal softmax(q k^T / sqrt(head_size)) v, then `dense`;
- `GatedMLP`: proj(act(fc(x)) * gate(x)), biases when `mlp_bias`; `ACT2FN["gelu"]` is the tanh
  approximation (`gelu="erf"` swaps in the exact one to isolate the mapping from that difference);
  `fused=True` computes it the way `trtllm-build`'s fused MLP does (`fuse_gate_mlp`: one GEMM
  over the rows [gate; fc] and biases [gate; fc], then `geglu`, which multiplies the first half
  by the GELU of the second);
- `ln_f`, then `lm_head`.

Full recomputation over one sequence, no cache: an oracle, not a runtime.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor


def _gelu(x: Tensor, kind: str) -> Tensor:
    if kind == "erf":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if kind == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(f"gelu kind must be 'erf' or 'tanh', got {kind!r}")


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: Tensor, base: float) -> Tensor:
    """x: [seq, heads, head_size] at positions 0..seq-1."""
    seq, _, size = x.shape
    inv_freq = 1.0 / base ** (torch.arange(0, size, 2, dtype=torch.float64) / size)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()[:, None, :]
    rotated = torch.cat([-x[..., size // 2 :], x[..., : size // 2]], -1)
    return x * cos + rotated * sin


def _gated_mlp(h: Tensor, w: dict[str, Tensor], p: str, bias: bool, gelu: str, fused: bool):
    def b(name: str) -> Tensor | float:
        return w[p + name] if bias else 0.0

    if fused:
        weight = torch.cat([w[p + "mlp.gate.weight"], w[p + "mlp.fc.weight"]])
        offset = torch.cat([w[p + "mlp.gate.bias"], w[p + "mlp.fc.bias"]]) if bias else 0.0
        first, second = (h @ weight.T + offset).chunk(2, -1)
        inner = first * _gelu(second, gelu)
    else:
        inner = _gelu(h @ w[p + "mlp.fc.weight"].T + b("mlp.fc.bias"), gelu)
        inner = inner * (h @ w[p + "mlp.gate.weight"].T + b("mlp.gate.bias"))
    return inner @ w[p + "mlp.proj.weight"].T + b("mlp.proj.bias")


def llama_logits(
    ckpt_dir: Path | str, input_ids: Sequence[int], gelu: str = "tanh", fused: bool = False
) -> Tensor:
    """Logits [seq, vocab] (float32) of the checkpoint in `ckpt_dir` for one token sequence."""
    ckpt_dir = Path(ckpt_dir)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["hidden_act"] == "gelu"
    assert cfg["position_embedding_type"] == "rope_gpt_neox"
    w = {k: v.float() for k, v in load_file(str(ckpt_dir / "rank0.safetensors")).items()}
    heads, size = cfg["num_attention_heads"], cfg["head_size"]
    eps, bias = cfg["norm_epsilon"], cfg["mlp_bias"]
    seq = len(input_ids)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()

    x = w["transformer.vocab_embedding.weight"][torch.tensor(list(input_ids))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (h @ w[p + "attention.qkv.weight"].T).split(heads * size, -1)
        q, k = (_rope(t.view(seq, heads, size), cfg["rotary_base"]) for t in (q, k))
        v = v.view(seq, heads, size)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(size)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", attn, v).reshape(seq, heads * size)
        x = x + out @ w[p + "attention.dense.weight"].T

        h = _rms_norm(x, w[p + "post_layernorm.weight"], eps)
        x = x + _gated_mlp(h, w, p, bias, gelu, fused)
    x = _rms_norm(x, w["transformer.ln_f.weight"], eps)
    return x @ w["lm_head.weight"].T
