"""Load a Hugging Face Llama-family checkpoint directory into the project's `Transformer`.

A directory holds `config.json`, the weights as `model.safetensors` or as shards listed in
`model.safetensors.index.json` (its `weight_map`), and optionally `generation_config.json`
(tokenizer files are read elsewhere). The jobs, one module each: the config
(`avspec.runtime.hf_config`), the weights (`avspec.runtime.hf_weights`), writing one
(`avspec.runtime.hf_writer`). Loading checks everything before allocating the model, so a caller
never holds a half-loaded one; any problem raises `HFCheckpointError` naming the file and the
field or tensor. The config and writer names are re-exported here, the one import for callers.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from avspec.runtime.hf_config import (
    ARCHITECTURES,
    HFCheckpointError,
    HFConfig,
    check_llama_form,
    read_hf_config,
)
from avspec.runtime.hf_weights import (
    SERVING_DTYPES,
    check_weights,
    copy_weights,
    open_weights,
    weight_files,
    weight_plan,
)
from avspec.runtime.hf_writer import llama_config_json, save_hf_model
from avspec.runtime.transformer import Transformer, TransformerConfig

__all__ = [
    "ARCHITECTURES",
    "SERVING_DTYPES",
    "HFCheckpointError",
    "HFConfig",
    "HFModelInfo",
    "check_llama_form",
    "llama_config_json",
    "load_hf_model",
    "read_hf_config",
    "save_hf_model",
]


@dataclass(frozen=True)
class HFModelInfo:
    """A loaded model's description: for the launcher's log line and the pair check.

    `kv_bytes_per_token` is what one token of one sequence slot costs in the KV cache (keys
    and values of every layer in the serving dtype); on the CPU the cache reserves as much
    again for its read workspaces (`avspec.runtime.kv_cache`).
    """

    directory: Path
    architecture: str
    dtype: torch.dtype
    checkpoint_dtypes: tuple[str, ...]
    num_parameters: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    max_length: int
    kv_bytes_per_token: int
    config: TransformerConfig


def load_hf_model(
    directory: Path | str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_length: int | None = None,
) -> tuple[Transformer, HFModelInfo]:
    """Load a checkpoint directory as a `Transformer` in eval mode, weights in `dtype` on `device`.

    `max_length` is the context the caller will serve (the rotary table and KV cache bound);
    default and ceiling: the config's `max_position_embeddings`. Raises HFCheckpointError on
    any problem, before the model is allocated.
    """
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"serving dtype must be one of {SERVING_DTYPES}, got {dtype}")
    spec = read_hf_config(directory, max_length)
    plan = weight_plan(spec.config)
    weights_file, files = weight_files(spec.directory)
    with ExitStack() as stack:
        handles = {
            path: stack.enter_context(open_weights(path)) for path in sorted(set(files.values()))
        }
        stored = check_weights(weights_file, files, handles, plan, spec.config)
        model = Transformer.empty(spec.config, device=device, dtype=dtype)
        copy_weights(model, files, handles, plan)
    model.eval()
    info = HFModelInfo(
        directory=spec.directory,
        architecture=spec.architecture,
        dtype=dtype,
        checkpoint_dtypes=stored,
        num_parameters=model.num_parameters(),
        vocab_size=spec.config.vocab_size,
        bos_token_id=spec.bos_token_id,
        eos_token_ids=spec.eos_token_ids,
        max_position_embeddings=spec.max_position_embeddings,
        max_length=spec.config.max_length,
        kv_bytes_per_token=spec.config.kv_values_per_token * dtype.itemsize,
        config=spec.config,
    )
    return model, info
