"""Tiny GGUF files written with ggml's own `gguf.GGUFWriter`, for the converter's tests.

`llama_weights` draws a random Llama in Hugging Face layout (names and row order of
`LlamaForCausalLM`), weights spread so attention is not uniform and logits are peaked.
`write_llama_gguf` writes it as llama.cpp would: llama.cpp's tensor names, q/k rows permuted
into its rotary layout (`permute_rotary_rows`), `llama.*` hyperparameters, a byte-level BPE
tokenizer (`tokenizer.ggml.*`, 3 control tokens, the 256 byte symbols, a few merges) and a
ChatML template; each tensor stored in the quantization type asked for (quantized by
`gguf.quants.quantize`, or passed as ready-made blocks for the K types, which the package can
only dequantize).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from tokenizers import pre_tokenizers

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ c", "Ġc a", "Ġca p")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
F32 = GGMLQuantizationType.F32


@dataclass(frozen=True)
class TinyLlama:
    """Shape of the tiny model (vocab fixed by the tokenizer)."""

    layers: int = 2
    width: int = 64
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 256
    context: int = 64
    theta: float = 10000.0
    eps: float = 1e-5
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def vocabulary() -> tuple[list[str], list[str]]:
    """(tokens in id order, merges): control tokens, the 256 byte symbols, merged pieces."""
    tokens = [*SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    tokens += ["".join(m.split(" ")) for m in MERGES]
    return tokens, list(MERGES)


def llama_weights(shape: TinyLlama, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights under `LlamaForCausalLM` names, in Hugging Face row order."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(vocabulary()[0])
    w, hd = shape.width, shape.head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * 1.5 / math.sqrt(cols)

    def norm() -> torch.Tensor:
        return 1 + 0.2 * torch.randn(w, generator=gen)

    weights = {"model.embed_tokens.weight": torch.randn(vocab, w, generator=gen)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": matrix(shape.heads * hd, w),
            p + "self_attn.k_proj.weight": matrix(shape.kv_heads * hd, w),
            p + "self_attn.v_proj.weight": matrix(shape.kv_heads * hd, w),
            p + "self_attn.o_proj.weight": matrix(w, shape.heads * hd),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": matrix(shape.hidden, w),
            p + "mlp.up_proj.weight": matrix(shape.hidden, w),
            p + "mlp.down_proj.weight": matrix(w, shape.hidden),
        }
    weights["model.norm.weight"] = norm()
    if not shape.tied:
        weights["lm_head.weight"] = matrix(vocab, w)
    return weights


def permute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k reordering: within each head, rows of the first half go to
    the even rows and rows of the second half to the odd rows (written here independently of
    the converter's inverse, so a wrong inverse cannot cancel it)."""
    d = weight.shape[0] // heads
    order = torch.arange(weight.shape[0]).reshape(heads, 2, d // 2).transpose(1, 2).reshape(-1)
    return weight[order]


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a `LlamaForCausalLM` tensor."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    parts = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


def encode_tensor(values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """The bytes (or float array) GGUFWriter stores for `values` in type `kind`."""
    if kind == GGMLQuantizationType.Q4_K:
        return q4_k_blocks(values)
    if kind == GGMLQuantizationType.Q6_K:
        return q6_k_blocks(values)
    return quantize(values.astype(np.float32), kind)


def q4_k_blocks(values: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks (256 values) for a matrix whose rows are integers 0..15 times one
    scale per row: d = that scale, dmin = 0, every 6-bit sub-block scale 1 and min 0, nibbles =
    the integers. Layout (ggml): d f16, dmin f16, 12 bytes of packed scales/mins, 128 bytes of
    nibbles (each 32 bytes hold values j (low nibble) and j + 32 (high) of a 64-value group)."""
    rows, cols = values.shape
    scale = np.abs(values).max(axis=1) / 15
    scale[scale == 0] = 1
    q = np.clip(np.round(values / scale[:, None]), 0, 15).astype(np.uint8)
    blocks = q.reshape(rows, cols // 256, 4, 2, 32)
    nibbles = blocks[:, :, :, 0, :] | (blocks[:, :, :, 1, :] << 4)  # (rows, n, 4, 32)
    out = np.zeros((rows, cols // 256, 144), dtype=np.uint8)
    d = np.broadcast_to(scale.astype(np.float16)[:, None], (rows, cols // 256)).copy()
    out[:, :, 0:2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    out[:, :, 4:8] = 1  # sub-block scales 0-3 (mins 0-3 stay 0)
    out[:, :, 12:16] = 1  # scales 4-7 in the low nibbles, mins 4-7 (high nibbles) 0
    out[:, :, 16:] = nibbles.reshape(rows, cols // 256, 128)
    return out.reshape(rows, -1)


def q6_k_blocks(values: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks (256 values) for a matrix whose rows are integers -32..31 times one
    scale per row (-32 present, so the scale is the largest |value| / 32): d = that scale,
    every int8 sub-block scale 1, the 6-bit quant q + 32 split into ql (low 4 bits) and qh
    (high 2 bits). Layout (ggml): 128 bytes ql, 64 bytes qh, 16
    int8 scales, d f16. In each 128-value half, value l + 32 k (k = 0..3, l = 0..31) keeps its
    low bits in ql[l + 32 (k % 2)] (low nibble for k < 2, high for k >= 2) and its high bits
    in qh[l] at bit 2 k."""
    rows, cols = values.shape
    scale = np.abs(values).max(axis=1) / 32
    scale[scale == 0] = 1
    q = (np.clip(np.round(values / scale[:, None]), -32, 31) + 32).astype(np.uint8)
    halves = q.reshape(rows, cols // 256, 2, 4, 32)  # (rows, n, half, k, l)
    low, high = halves & 0x0F, halves >> 4
    ql = np.concatenate(
        [low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)],
        axis=-1,
    )  # (rows, n, half, 64)
    qh = (
        high[:, :, :, 0]
        | (high[:, :, :, 1] << 2)
        | (high[:, :, :, 2] << 4)
        | (high[:, :, :, 3] << 6)
    )  # (rows, n, half, 32)
    out = np.zeros((rows, cols // 256, 210), dtype=np.uint8)
    out[:, :, :128] = ql.reshape(rows, cols // 256, 128)
    out[:, :, 128:192] = qh.reshape(rows, cols // 256, 64)
    out[:, :, 192:208] = 1
    d = np.broadcast_to(scale.astype(np.float16)[:, None], (rows, cols // 256)).copy()
    out[:, :, 208:210] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return out.reshape(rows, -1)


def write_tensor_gguf(path: Path, values: np.ndarray, kind: GGMLQuantizationType) -> Path:
    """A GGUF holding one tensor `t` (row-major `values`) stored as `kind`."""
    writer = GGUFWriter(str(path), "llama")
    stored = encode_tensor(values, kind)
    raw = None if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else kind
    writer.add_tensor("t", stored, raw_dtype=raw)
    _finish(writer)
    return path


def write_llama_gguf(
    path: Path,
    shape: TinyLlama,
    weights: dict[str, torch.Tensor],
    types: dict[str, GGMLQuantizationType] | None = None,
    architecture: str = "llama",
    permute: bool = True,
) -> Path:
    """Write `weights` (Hugging Face names and order) as a llama.cpp GGUF; `types` maps a
    Hugging Face name to its stored type (default F32); `permute` False skips llama.cpp's q/k
    row permutation (a file no llama.cpp converter would write)."""
    types = types or {}
    tokens, merges = vocabulary()
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.width)
    writer.add_feed_forward_length(shape.hidden)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    types_list = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (
        len(tokens) - len(SPECIALS)
    )
    writer.add_token_types(types_list)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, value in weights.items():
        gguf = gguf_name(name)
        if permute and ".attn_q." in gguf:
            value = permute_rotary_rows(value, shape.heads)
        elif permute and ".attn_k." in gguf:
            value = permute_rotary_rows(value, shape.kv_heads)
        kind = types.get(name, F32)
        stored = encode_tensor(value.numpy(), kind)
        raw = None if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else kind
        writer.add_tensor(gguf, stored, raw_dtype=raw)
    _finish(writer)
    return path


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
