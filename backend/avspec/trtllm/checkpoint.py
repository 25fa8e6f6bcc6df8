"""Export an avspec model directory as a TensorRT-LLM checkpoint, ready for `trtllm-build`.

TensorRT-LLM has no "avspec" architecture, but its LLaMA decoder computes the same function as
ours once the weights are laid out for it. Both are pre-norm decoders with RMSNorm, a fused
bias-free q/k/v projection (rows q, then k, then v, heads in order), GPT-NeoX-style rotary
embeddings (channel pairs (i, i + head_dim/2), base ROPE_BASE) and scale 1/sqrt(head_dim). They
differ in the MLP: ours is proj(gelu(fc(x))), TensorRT-LLM's LLaMA MLP is gated,
proj(act(fc(x)) * gate(x)). With `mlp_bias` on, a gate of zero weights and unit bias makes the
gate exactly 1, so the gated MLP is ours. The output layer is written out (`lm_head.weight`, a
copy of the embedding) rather than tied.

The one difference that remains is the activation: TensorRT-LLM's `gelu` is the tanh
approximation, ours is the exact (erf) GELU. The engine is therefore a target a hair away from
the torch one (measured on held-out text in tests/unit/trtllm/test_checkpoint.py); speculative
decoding stays lossless with respect to the engine, which is the target that verifies.

Written (TensorRT-LLM's unified checkpoint format, docs/source/architecture/checkpoint.md there):

- `config.json`: architecture `LlamaForCausalLM`, sizes, `hidden_act: gelu`, `mlp_bias: true`,
  `position_embedding_type: rope_gpt_neox`, a single-GPU mapping, no quantization;
- `rank0.safetensors`: the weights in `dtype`, named as in WEIGHT_NAMES;
- `avspec_export.json`: where it came from (source directory, sha256 of its weights).

`--build ENGINE_DIR` then runs `trtllm-build` with the flags the deployment needs (BUILD_FLAGS:
external draft tokens, `--max_draft_len` >= K, paged context FMHA for KV-cache reuse, generation
logits for `draft_logits` acceptance); it needs TensorRT-LLM installed (the NGC trtllm container).

    python -m avspec.trtllm.checkpoint models/target --out build/trtllm/target            # export
    python3 -m avspec.trtllm.checkpoint models/target --out /tmp/ckpt --build /engines/target
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from avspec.runtime.model_dir import WEIGHTS_FILE, ModelDirError, load_model_dir
from avspec.runtime.transformer import ROPE_BASE, Transformer

ARCHITECTURE = "LlamaForCausalLM"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CONFIG_FILE = "config.json"
WEIGHTS = "rank0.safetensors"
PROVENANCE = "avspec_export.json"

# TensorRT-LLM name <- avspec name, per layer i; `None` marks the tensors the gate trick adds.
WEIGHT_NAMES: dict[str, str | None] = {
    "transformer.layers.{i}.input_layernorm.weight": "blocks.{i}.attn_norm.weight",
    "transformer.layers.{i}.attention.qkv.weight": "blocks.{i}.qkv.weight",
    "transformer.layers.{i}.attention.dense.weight": "blocks.{i}.attn_out.weight",
    "transformer.layers.{i}.post_layernorm.weight": "blocks.{i}.mlp_norm.weight",
    "transformer.layers.{i}.mlp.fc.weight": "blocks.{i}.mlp_in.weight",
    "transformer.layers.{i}.mlp.fc.bias": None,
    "transformer.layers.{i}.mlp.gate.weight": None,
    "transformer.layers.{i}.mlp.gate.bias": None,
    "transformer.layers.{i}.mlp.proj.weight": "blocks.{i}.mlp_out.weight",
    "transformer.layers.{i}.mlp.proj.bias": None,
}
TOP_LEVEL_NAMES = {
    "transformer.vocab_embedding.weight": "embed.weight",
    "transformer.ln_f.weight": "final_norm.weight",
    "lm_head.weight": "embed.weight",
}


# trtllm-build flags the deployment relies on, whatever the sizes (TensorRT-LLM 0.16 names).
BUILD_FLAGS = (
    "--speculative_decoding_mode", "draft_tokens_external",
    "--use_paged_context_fmha", "enable",
    "--gather_generation_logits",
)  # fmt: skip
MAX_DRAFT_LEN = 8  # = max_draft_tokens of model_repository/{draft,target,speculative}


class ExportError(ValueError):
    """The source model directory, the dtype or the output directory is not usable."""


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def checkpoint_config(model: Transformer, dtype: str) -> dict:
    """The TensorRT-LLM `config.json` of `model` exported in `dtype`."""
    _check_dtype(dtype)
    c = model.config
    return {
        "architecture": ARCHITECTURE,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_length,
        "hidden_size": c.width,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_heads,
        "head_size": c.head_dim,
        "hidden_act": "gelu",
        "intermediate_size": model.blocks[0].mlp_in.out_features,
        # nn.RMSNorm without eps uses the float32 machine epsilon
        "norm_epsilon": float(torch.finfo(torch.float32).eps),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": ROPE_BASE,
        "rotary_scaling": None,
        "mlp_bias": True,
        "attn_bias": False,
        "tie_word_embeddings": False,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }


def checkpoint_weights(model: Transformer, dtype: str) -> dict[str, torch.Tensor]:
    """`model`'s weights under TensorRT-LLM LLaMA names, (out, in) layout, cast to `dtype`."""
    _check_dtype(dtype)
    source = {k: v.detach().float() for k, v in model.state_dict().items()}
    hidden = model.blocks[0].mlp_in.out_features
    added = {  # the gate trick: fc and proj without offset, gate(x) = 0 . x + 1
        "mlp.fc.bias": torch.zeros(hidden),
        "mlp.gate.weight": torch.zeros(hidden, model.config.width),
        "mlp.gate.bias": torch.ones(hidden),
        "mlp.proj.bias": torch.zeros(model.config.width),
    }
    out = {name: source[src] for name, src in TOP_LEVEL_NAMES.items()}
    for i in range(model.config.num_layers):
        for name, src in WEIGHT_NAMES.items():
            if src is None:
                out[name.format(i=i)] = added[name.split(".", 3)[3]]
            else:
                out[name.format(i=i)] = source[src.format(i=i)]
    # each tensor its own storage: safetensors refuses shared memory (tied or repeated tensors)
    return {k: v.to(DTYPES[dtype], copy=True).contiguous() for k, v in out.items()}


def export_checkpoint(
    model_dir: Path | str, out_dir: Path | str, dtype: str = "float16", force: bool = False
) -> Path:
    """Write the TensorRT-LLM checkpoint of the avspec model in `model_dir` into `out_dir`.

    Refuses (ExportError, nothing written) a bad source directory, an unknown dtype, or a
    non-empty `out_dir` unless `force`.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    try:
        model, _ = load_model_dir(model_dir)
    except ModelDirError as err:
        raise ExportError(f"cannot export {model_dir}: {err}") from None
    config = checkpoint_config(model, dtype)
    weights = checkpoint_weights(model, dtype)
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"output directory {out_dir} is not empty (use --force to overwrite)")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out_dir / WEIGHTS))
    source_weights = model_dir / WEIGHTS_FILE
    provenance = {
        "source": str(model_dir),
        "source_sha256": hashlib.sha256(source_weights.read_bytes()).hexdigest(),
        "dtype": dtype,
        "mapping": "avspec Transformer -> TensorRT-LLM LlamaForCausalLM (gate = 1, mlp_bias)",
    }
    (out_dir / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    return out_dir


def build_command_of(args: argparse.Namespace) -> list[str]:
    """`build_command` from a parsed command line (out, build, sizes, dtype)."""
    return build_command(
        args.out, args.build, args.max_batch_size, args.max_seq_len, args.max_draft_len,
        args.dtype,
    )  # fmt: skip


def build_command(
    checkpoint_dir: Path | str,
    engine_dir: Path | str,
    max_batch_size: int = 64,
    max_seq_len: int = 512,
    max_draft_len: int = MAX_DRAFT_LEN,
    dtype: str = "float16",
) -> list[str]:
    """The `trtllm-build` command line for the exported target (sizes checked here, not there)."""
    for name, value in (
        ("max_batch_size", max_batch_size),
        ("max_seq_len", max_seq_len),
        ("max_draft_len", max_draft_len),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExportError(f"{name} must be a positive int, got {value!r}")
    if max_seq_len < 2:
        raise ExportError(
            f"max_seq_len must be >= 2 (one input token and one output), got {max_seq_len}"
        )
    gemm = "auto" if dtype == "float32" else dtype
    return [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(engine_dir),
        "--gemm_plugin", gemm,
        *BUILD_FLAGS,
        "--max_draft_len", str(max_draft_len),
        "--max_batch_size", str(max_batch_size),
        "--max_input_len", str(max_seq_len - 1),
        "--max_seq_len", str(max_seq_len),
    ]  # fmt: skip


def build_engine(command: Sequence[str]) -> None:
    """Run `trtllm-build`; ExportError if it is not installed or fails."""
    if shutil.which(command[0]) is None:
        raise ExportError(
            f"{command[0]} not found: engine builds need TensorRT-LLM (the NGC trtllm container, "
            "docs/gpu.md); the checkpoint was written"
        )
    result = subprocess.run(list(command), check=False)
    if result.returncode:
        raise ExportError(f"{command[0]} failed with exit status {result.returncode}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="avspec model directory (e.g. models/target)")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--dtype", default="float16", help=f"one of {sorted(DTYPES)}")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--build", metavar="ENGINE_DIR", help="then run trtllm-build into it")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--max-draft-len", type=int, default=MAX_DRAFT_LEN)
    args = parser.parse_args(argv)
    try:
        command = None
        if args.build:
            command = build_command_of(args)
        out = export_checkpoint(args.model_dir, args.out, args.dtype, args.force)
        print(f"wrote {out}/{CONFIG_FILE} and {out}/{WEIGHTS} ({args.dtype})")
        if command:
            print("running:", " ".join(command), flush=True)
            build_engine(command)
            print(f"engine written to {args.build}")
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
