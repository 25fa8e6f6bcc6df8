"""Build the target engine from a Hugging Face checkpoint with TensorRT-LLM's own tools.

    python3 -m avspec.trtllm.hf_engine TARGET_DIR --out CKPT_DIR --build ENGINE_DIR \
        [--examples DIR] [--dtype float16] [--max-batch-size 64] [--max-seq-len 512]

A Hugging Face target (`config.json` with "architectures" LlamaForCausalLM, Qwen2ForCausalLM or
MistralForCausalLM) needs no custom exporter: TensorRT-LLM's stock example converter writes the
unified checkpoint (`<examples>/llama/convert_checkpoint.py` for Llama and Mistral,
`<examples>/qwen/convert_checkpoint.py` for Qwen2), then `trtllm-build` runs with the flags the
deployment needs (`build_command`: BUILD_FLAGS, external draft tokens, `--max_draft_len` >= K,
paged context FMHA for KV-cache reuse, generation logits for `draft_logits` acceptance). This is
the only engine build path: every served pair is a Hugging Face checkpoint. It has not run with
TensorRT-LLM here (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from avspec.runtime.hf_checkpoint import read_hf_config
from avspec.runtime.model_dir import check_model_dir

# Where the TensorRT-LLM examples live in the container (docker/Dockerfile puts the v0.16.0
# examples there when the image has none); TRTLLM_EXAMPLES overrides it.
DEFAULT_EXAMPLES = "/opt/tensorrt_llm/examples"
CONVERTERS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # TensorRT-LLM converts Mistral with the llama example
    "Qwen2ForCausalLM": "qwen",
}
CONVERT_DTYPES = ("float16", "bfloat16", "float32")
# trtllm-build flags the deployment relies on, whatever the sizes (TensorRT-LLM 0.16 names).
BUILD_FLAGS = (
    "--speculative_decoding_mode", "draft_tokens_external",
    "--use_paged_context_fmha", "enable",
    "--gather_generation_logits",
)  # fmt: skip
MAX_DRAFT_LEN = 8  # = max_draft_tokens of model_repository/{draft,target,speculative}


class ExportError(ValueError):
    """The target directory, the dtype, the sizes or the TensorRT-LLM tools are not usable."""


def examples_dir() -> Path:
    return Path(os.environ.get("TRTLLM_EXAMPLES") or DEFAULT_EXAMPLES)


def convert_command(
    architecture: str,
    model_dir: Path | str,
    checkpoint_dir: Path | str,
    examples: Path | str,
    dtype: str = "float16",
    tp_size: int = 1,
) -> list[str]:
    """The stock converter's command line for `architecture`; with `tp_size` > 1 the weights
    are split that many ways (`--tp_size`, converted by as many workers), and `trtllm-build`
    then writes one engine per rank from the checkpoint's mapping."""
    if architecture not in CONVERTERS:
        raise ExportError(f"no TensorRT-LLM converter for {architecture!r}: {sorted(CONVERTERS)}")
    if dtype not in CONVERT_DTYPES:
        raise ExportError(f"dtype must be one of {CONVERT_DTYPES}, got {dtype!r}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ExportError(f"tp_size must be a positive int, got {tp_size!r}")
    script = Path(examples) / CONVERTERS[architecture] / "convert_checkpoint.py"
    split = ["--tp_size", str(tp_size), "--workers", str(tp_size)] if tp_size > 1 else []
    return [
        "python3", str(script),
        "--model_dir", str(model_dir),
        "--output_dir", str(checkpoint_dir),
        "--dtype", dtype,
        *split,
    ]  # fmt: skip


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
    """The `trtllm-build` command line for the converted target (sizes checked here, not there)."""
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
    parser.add_argument("model_dir", help="Hugging Face checkpoint directory (the target)")
    parser.add_argument("--out", required=True, help="TensorRT-LLM checkpoint directory")
    parser.add_argument("--build", required=True, metavar="ENGINE_DIR", help="engine directory")
    parser.add_argument("--examples", type=Path, default=None, help="TensorRT-LLM examples dir")
    parser.add_argument("--dtype", default="float16", help=f"one of {CONVERT_DTYPES}")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--max-draft-len", type=int, default=MAX_DRAFT_LEN)
    parser.add_argument(
        "--tp-size", type=int, default=1, help="tensor parallelism: GPUs the target is split over"
    )
    args = parser.parse_args(argv)
    try:
        check_model_dir(args.model_dir)  # a directory that is not a Hugging Face checkpoint
        config = read_hf_config(args.model_dir)  # fails early, naming the field, before a build
        if args.max_seq_len > config.max_position_embeddings:
            raise ExportError(
                f"max_seq_len {args.max_seq_len} exceeds the target's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        convert = convert_command(
            config.architecture, args.model_dir, args.out, args.examples or examples_dir(),
            args.dtype, args.tp_size,
        )  # fmt: skip
        build = build_command_of(args)
        if not Path(convert[1]).is_file():
            raise ExportError(
                f"{convert[1]} not found: set TRTLLM_EXAMPLES to the TensorRT-LLM examples of the "
                "installed version"
            )
        print("running:", " ".join(convert), flush=True)
        if subprocess.run(convert, check=False).returncode:
            raise ExportError(f"{convert[1]} failed")
        print("running:", " ".join(build), flush=True)
        build_engine(build)
        print(f"engine written to {args.build}")
    except (ExportError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
