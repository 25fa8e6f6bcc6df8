"""The Llama architecture of a GGUF file: its config, tensor names, and q/k row order.

llama.cpp names Llama tensors `token_embd`, `blk.<i>.attn_q`, ... and writes the model's
hyperparameters under `llama.*` keys; `llama_config` turns those into the runtime's
`TransformerConfig` and `hf_tensor_name` maps each tensor to its Hugging Face name;
`gguf_tensor_name` is the other direction, for writing a GGUF (`avspec.runtime.gguf.writer`).

Rotary row order. Hugging Face Llama rotates channel pairs (i, i + head_dim/2) of each head
("rotate_half"); llama.cpp rotates adjacent pairs (2i, 2i + 1). Its converter therefore
permutes the rows of each head of `q_proj` and `k_proj` when it writes a GGUF: within a head
of d rows, row j of the first half goes to 2j and row j of the second half to 2j + 1
(`permute_rotary_rows`). `unpermute_rotary_rows` is the inverse, applied to `attn_q` (with the
query head count) and `attn_k` (with the key/value head count), weights and biases alike.
Without it the model still loads but attends with scrambled positions, so it is checked
numerically (tests compare logits with `transformers` reading the same file).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from avspec.runtime.gguf.reader import GGUFError, GGUFFile
from avspec.runtime.rope import RopeScaling
from avspec.runtime.transformer import TransformerConfig

ARCHITECTURE = "llama"
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_EPS = 1e-5

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def check_architecture(gguf: GGUFFile) -> None:
    """Raise GGUFError naming the file's architecture unless it is llama.cpp's "llama"."""
    architecture = gguf.architecture
    if architecture != ARCHITECTURE:
        raise GGUFError(
            f"{gguf.path}: architecture {architecture!r} is not supported; only Llama-family "
            f"GGUF files (general.architecture {ARCHITECTURE!r}) convert"
        )


def llama_config(gguf: GGUFFile) -> TransformerConfig:
    """The `TransformerConfig` (Llama form) that the file's `llama.*` metadata describes."""
    check_architecture(gguf)

    def key(name: str, default: object = ...) -> Any:
        full = f"{ARCHITECTURE}.{name}"
        return gguf.value(full) if default is ... else gguf.value(full, default)

    width = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(key("attention.key_length", width // num_heads))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFError(
            f"{gguf.path}: rope.dimension_count {rotary} != head_dim {head_dim}: partial "
            "rotary embeddings are not supported"
        )
    if "rope_freqs.weight" in gguf.tensor_names():
        raise GGUFError(
            f"{gguf.path}: holds rope_freqs.weight (Llama 3.1-style frequency scaling), "
            "which this converter does not map"
        )
    vocab = key("vocab_size", None)
    if vocab is None:
        vocab = len(gguf.value("tokenizer.ggml.tokens"))
    names = gguf.tensor_names()
    bias = any(n.endswith("attn_q.bias") for n in names)
    try:
        return TransformerConfig(
            num_layers=int(key("block_count")),
            width=width,
            num_heads=num_heads,
            vocab_size=int(vocab),
            max_length=int(key("context_length")),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(key("feed_forward_length")),
            mlp="swiglu",
            norm_eps=float(key("attention.layer_norm_rms_epsilon", DEFAULT_RMS_EPS)),
            qkv_bias=bias,
            out_bias=bias,
            mlp_bias=any(n.endswith("ffn_up.bias") for n in names),
            tie_embeddings="output.weight" not in names,
            rope_theta=float(key("rope.freq_base", DEFAULT_ROPE_THETA)),
            rope_style="half",
            rope_scaling=_rope_scaling(gguf),
        )
    except ValueError as err:
        raise GGUFError(f"{gguf.path}: unsupported model shape: {err}") from None


def _rope_scaling(gguf: GGUFFile) -> RopeScaling | None:
    kind = gguf.value(f"{ARCHITECTURE}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind != "linear":
        raise GGUFError(f"{gguf.path}: rope scaling {kind!r} is not supported (only 'linear')")
    return RopeScaling("linear", float(gguf.value(f"{ARCHITECTURE}.rope.scaling.factor")))


def hf_tensor_name(name: str) -> str:
    """The Hugging Face `LlamaForCausalLM` name of GGUF tensor `name`; GGUFError if unknown."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is not None:
        layer, part, kind = match.groups()
        for gguf_part, hf_part in _PER_LAYER.items():
            if gguf_part == f"{part}.{kind}":
                return f"model.layers.{layer}.{hf_part}"
            if gguf_part == part:
                return f"model.layers.{layer}.{hf_part}.{kind}"
    raise GGUFError(f"tensor {name!r} is not part of the Llama architecture")


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of the Hugging Face `LlamaForCausalLM` tensor `hf_name` (the inverse of
    `hf_tensor_name`); GGUFError if it is not part of the Llama architecture."""
    for name, hf in _TOP_LEVEL.items():
        if hf == hf_name:
            return name
    match = _HF_LAYER_NAME.fullmatch(hf_name)
    if match is not None:
        layer, module, kind = match.groups()
        for gguf_part, hf_part in _PER_LAYER.items():
            if hf_part == f"{module}.{kind}":
                return f"blk.{layer}.{gguf_part}"
            if hf_part == module:
                return f"blk.{layer}.{gguf_part}.{kind}"
    raise GGUFError(f"tensor {hf_name!r} is not part of the Llama architecture")


def rotary_heads(name: str, config: TransformerConfig) -> int | None:
    """The head count whose rows llama.cpp permuted in tensor `name` (q: query heads, k:
    key/value heads), or None for a tensor it left alone."""
    if ".attn_q." in name:
        return config.num_heads
    if ".attn_k." in name:
        return config.num_kv_heads
    return None


def permute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's reordering of q/k rows (HF "rotate_half" layout -> adjacent pairs)."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"{rows} rows do not split into {heads} heads of even size")
    grouped = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `permute_rotary_rows`: GGUF q/k rows back to the Hugging Face order."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"{rows} rows do not split into {heads} heads of even size")
    grouped = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)
