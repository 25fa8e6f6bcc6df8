"""Write a Hugging Face Llama checkpoint as a GGUF file that llama.cpp loads.

The other direction of `avspec.runtime.gguf.convert`, for a model that exists only as a
checkpoint (the trained draft) and must run on the llama.cpp engine, which loads GGUF only.
`write_llama_gguf` writes llama.cpp's "llama" architecture:

- metadata: the `llama.*` hyperparameters from `config.json`, `general.*` (name, file type,
  quantization version), and every `tokenizer.*` key of `tokenizer_gguf` copied with its value
  type (token list, merges, special ids, chat template): the file tokenizes exactly as that one;
- tensors: llama.cpp's names (`avspec.runtime.gguf.llama.gguf_tensor_name`), q/k rows permuted
  into its rotary layout (`permute_rotary_rows`), 1-D tensors (norms, biases) in F32, matrices
  in `tensor_type` (a Q8_0 matrix whose rows are not whole 32-value blocks falls back to F16);
  no `output.weight` for a tied checkpoint (llama.cpp then reuses `token_embd`);
- `shared_embedding_from`: a GGUF whose `token_embd.weight` the checkpoint's embedding was
  dequantized from (the draft shares its target's). That tensor's stored blocks are copied
  as they are, after checking that they dequantize to the checkpoint's embedding within one
  rounding to its stored dtype: requantizing them would lose precision against the source and
  make the draft's embedding differ from the target's.

The file is written under a temporary name beside `out` and renamed into place, so an existing
`out` is always complete. Problems raise ValueError (HFCheckpointError, GGUFError) naming the
file and what is wrong, before anything is written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    ReaderTensor,
    RopeScalingType,
)
from gguf.quants import dequantize, quantize

from avspec.runtime.gguf.llama import (
    ARCHITECTURE,
    gguf_tensor_name,
    permute_rotary_rows,
    rotary_heads,
)
from avspec.runtime.gguf.reader import GGUFError
from avspec.runtime.hf_config import (
    HFCheckpointError,
    HFConfig,
    check_llama_form,
    read_hf_config,
    read_required_json,
)
from avspec.runtime.hf_files import CONFIG_FILE
from avspec.runtime.hf_weights import check_weights, open_weights, weight_files, weight_plan
from avspec.runtime.transformer import TransformerConfig

Q = GGMLQuantizationType
# --type name -> (matrix type, general.file_type)
TENSOR_TYPES = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
# Hugging Face architectures llama.cpp runs as "llama" (Mistral: only with full attention over
# its context, which `read_hf_config` checks)
LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
EMBEDDING = "model.embed_tokens.weight"
TOKEN_EMBD = "token_embd.weight"
TOKENIZER_PREFIX = "tokenizer."


def write_llama_gguf(
    model_dir: Path | str,
    out: Path | str,
    tokenizer_gguf: Path | str,
    tensor_type: str = "q8_0",
    shared_embedding_from: Path | str | None = None,
    name: str | None = None,
) -> Path:
    """Write checkpoint `model_dir` as the llama GGUF `out` (replacing it); returns `out`.

    `tokenizer_gguf`: the GGUF whose `tokenizer.*` metadata is copied (its vocabulary must have
    the checkpoint's vocab_size tokens). `tensor_type`: one of TENSOR_TYPES, for the matrices.
    `shared_embedding_from`: see the module doc. `name`: `general.name` (default: the
    directory's name).
    """
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {sorted(TENSOR_TYPES)}, got {tensor_type!r}")
    model_dir, out = Path(model_dir), Path(out)
    spec = read_llama_checkpoint(model_dir)
    tokenizer = tokenizer_source(tokenizer_gguf, spec.config.vocab_size)
    matrix_type, file_type = TENSOR_TYPES[tensor_type]
    with checkpoint_tensors(model_dir, spec.config) as tensors:
        shared = None
        if shared_embedding_from is not None:
            embedding = tensors[EMBEDDING].get_tensor(EMBEDDING)
            shared = shared_embedding(shared_embedding_from, embedding)

        def fill(writer: GGUFWriter) -> None:
            _add_metadata(writer, spec, file_type, name or model_dir.resolve().name)
            _copy_tokenizer(tokenizer, writer)
            _add_tensors(writer, spec.config, tensors, matrix_type, shared)

        return _write(out, fill)


def read_llama_checkpoint(model_dir: Path) -> HFConfig:
    """The checked config of `model_dir`; ValueError unless it is a Llama-family checkpoint
    that llama.cpp's "llama" architecture expresses exactly."""
    if not model_dir.is_dir():
        raise HFCheckpointError(f"model directory {model_dir} does not exist")
    architectures = read_required_json(model_dir / CONFIG_FILE).get("architectures")
    if (
        not isinstance(architectures, list)
        or len(architectures) != 1
        or architectures[0] not in LLAMA_ARCHITECTURES
    ):
        raise HFCheckpointError(
            f"{model_dir / CONFIG_FILE}: architectures {architectures!r} is not a Llama-family "
            f"checkpoint; the GGUF writer handles {', '.join(LLAMA_ARCHITECTURES)}"
        )
    spec = read_hf_config(model_dir)
    check_llama_form(spec.config)
    scaling = spec.config.rope_scaling
    if scaling is not None and scaling.kind != "linear":
        raise HFCheckpointError(
            f"{model_dir / CONFIG_FILE}: rope scaling {scaling.kind!r} is not supported by the "
            "GGUF writer (only 'linear')"
        )
    return spec


def shared_embedding(source: Path | str, embedding: torch.Tensor) -> ReaderTensor:
    """The stored `token_embd.weight` of GGUF `source`, checked to be the tensor `embedding` (a
    checkpoint's, in its stored dtype) was dequantized from; ValueError otherwise."""
    reader = _open_gguf(source, "shared-embedding GGUF")
    stored = next((t for t in reader.tensors if t.name == TOKEN_EMBD), None)
    if stored is None:
        raise GGUFError(f"{source}: holds no {TOKEN_EMBD}")
    shape = tuple(int(n) for n in reversed(stored.shape.tolist()))
    if shape != tuple(embedding.shape):
        raise ValueError(
            f"{source}: {TOKEN_EMBD} has shape {shape}, the checkpoint's embedding "
            f"{tuple(embedding.shape)}: not its source"
        )
    values = torch.from_numpy(
        np.array(dequantize(np.asarray(stored.data), stored.tensor_type), dtype=np.float32)
    ).reshape(shape)
    # rounding to the checkpoint's dtype moves a value by at most half its relative eps
    bound = torch.finfo(embedding.dtype).eps / 2 * values.abs() + torch.finfo(torch.float32).tiny
    excess = ((values - embedding.float()).abs() - bound).max().item()
    if excess > 0:
        raise ValueError(
            f"{source}: its {TOKEN_EMBD} ({stored.tensor_type.name}) is not the tensor the "
            f"checkpoint's embedding was dequantized from (differs by more than "
            f"{embedding.dtype} rounding): write without a shared embedding, or name its source"
        )
    return stored


def tokenizer_source(path: Path | str, vocab_size: int) -> GGUFReader:
    """GGUF `path` opened for its tokenizer metadata; ValueError unless its vocabulary has
    `vocab_size` tokens."""
    reader = _open_gguf(path, "tokenizer GGUF")
    tokens = reader.fields.get(f"{TOKENIZER_PREFIX}ggml.tokens")
    if tokens is None:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens (not a tokenizer GGUF)")
    if len(tokens.data) != vocab_size:
        raise GGUFError(
            f"{path}: its vocabulary has {len(tokens.data)} tokens, the checkpoint's vocab_size "
            f"is {vocab_size}: not its tokenizer"
        )
    return reader


@contextmanager
def checkpoint_tensors(model_dir: Path, config: TransformerConfig) -> Iterator[dict[str, Any]]:
    """Each tensor of the checkpoint (checked against `config`) -> its open safetensors file,
    in llama.cpp's file order: embedding, blocks, final norm, output."""
    plan = weight_plan(config)
    weights_file, files = weight_files(model_dir)
    with ExitStack() as stack:
        handles = {p: stack.enter_context(open_weights(p)) for p in sorted(set(files.values()))}
        check_weights(weights_file, files, handles, plan, config)
        order = {EMBEDDING: 0, "model.norm.weight": 2, "lm_head.weight": 3}
        names = sorted(plan, key=lambda n: order.get(n, 1))
        yield {name: handles[files[name]] for name in names}


def _open_gguf(path: Path | str, what: str) -> GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{what} {path} does not exist")
    try:
        return GGUFReader(path, "r")
    except (OSError, ValueError, IndexError, KeyError) as err:
        raise GGUFError(f"{path}: not a readable GGUF file: {type(err).__name__}: {err}") from None


def _add_metadata(writer: GGUFWriter, spec: HFConfig, file_type: LlamaFileType, name: str) -> None:
    config = spec.config
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_block_count(config.num_layers)
    writer.add_embedding_length(config.width)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    if config.rope_scaling is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
    assert config.norm_eps is not None  # a Llama config has its epsilon (hf_config)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _add_tensors(
    writer: GGUFWriter,
    config: TransformerConfig,
    tensors: dict[str, Any],
    matrix_type: GGMLQuantizationType,
    shared: ReaderTensor | None,
) -> None:
    for hf_name, handle in tensors.items():
        name = gguf_tensor_name(hf_name)
        if shared is not None and name == TOKEN_EMBD:
            writer.add_tensor(name, np.asarray(shared.data), raw_dtype=shared.tensor_type)
            continue
        value = handle.get_tensor(hf_name).float()
        heads = rotary_heads(name, config)
        if heads is not None:
            value = permute_rotary_rows(value, heads)
        kind = _stored_type(value, matrix_type)
        writer.add_tensor(name, quantize(value.numpy(), kind), raw_dtype=kind)


def _stored_type(value: torch.Tensor, matrix_type: GGMLQuantizationType) -> GGMLQuantizationType:
    """F32 for 1-D tensors; `matrix_type` for matrices, F16 where rows are not whole blocks."""
    if value.dim() == 1:
        return Q.F32
    block, _ = GGML_QUANT_SIZES[matrix_type]
    return matrix_type if value.shape[-1] % block == 0 else Q.F16


def _copy_tokenizer(source: GGUFReader, writer: GGUFWriter) -> None:
    """Every `tokenizer.*` key of `source`, with its value type (and array element type)."""
    for key, field in source.fields.items():
        if not key.startswith(TOKENIZER_PREFIX):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise GGUFError(f"{source.data.filename}: {key} is a nested array (unsupported)")
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[1])
        else:
            writer.add_key_value(key, field.contents(), kind)


def _write(out: Path, fill: Callable[[GGUFWriter], None]) -> Path:
    """Run `fill(writer)` on a GGUFWriter for a temporary file beside `out`, write it, and
    rename it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(handle)
    writer = GGUFWriter(scratch, ARCHITECTURE)
    try:
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(scratch, 0o644)  # mkstemp made it private
        os.replace(scratch, out)
    except BaseException:
        writer.close()
        Path(scratch).unlink(missing_ok=True)
        raise
    return out
