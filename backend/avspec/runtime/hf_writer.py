"""Write a Llama-form `Transformer` as a Hugging Face `LlamaForCausalLM` directory.

For a model in Llama form (SwiGLU MLP, RMSNorm with an explicit epsilon, half-split RoPE, one
bias flag for q/k/v/o): `config.json`, `model.safetensors` under the Hugging Face tensor names,
`generation_config.json`, and the tokenizer files when given; both `load_hf_model` and
`transformers` load it to the same logits.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from avspec.runtime.hf_config import check_llama_form
from avspec.runtime.hf_files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
)
from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.hf_weights import SERVING_DTYPES, weight_plan
from avspec.runtime.json_file import write_json
from avspec.runtime.transformer import Transformer, TransformerConfig


def llama_config_json(
    config: TransformerConfig,
    bos_token_id: int | None,
    eos_token_ids: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The `config.json` of a Llama-form `config` (checked by `check_llama_form`)."""
    check_llama_form(config)
    scaling = config.rope_scaling
    rope_scaling = None
    if scaling is not None:
        rope_scaling = {"rope_type": scaling.kind, "factor": scaling.factor}
        if scaling.kind == "llama3":
            for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                rope_scaling[key] = getattr(scaling, key)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.width,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": config.qkv_bias,
        "attention_dropout": 0.0,
        "mlp_bias": config.mlp_bias,
        "tie_word_embeddings": config.tie_embeddings,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_length,
        "bos_token_id": bos_token_id,
        "eos_token_id": _one_or_list(eos_token_ids),
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def save_hf_model(
    model: Transformer,
    directory: Path | str,
    tokenizer_dir: Path | str | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    bos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `model` as a `LlamaForCausalLM` directory; returns the directory.

    EOS and BOS default to what the tokenizer files of `tokenizer_dir` name (those files are
    copied alongside); EOS must come from one of the two. `max_position_embeddings` is the
    model's `max_length`; weights are stored in `dtype`. ValueError, before anything is
    written, for a config Llama cannot express (`check_llama_form`), a tokenizer larger than
    the embedding, or a directory already holding a sharded checkpoint.
    """
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype must be one of {SERVING_DTYPES}, got {dtype}")
    directory = Path(directory)
    tokenizer = HFTokenizer.from_directory(tokenizer_dir) if tokenizer_dir is not None else None
    eos, bos = _save_special_ids(model.config, tokenizer, eos_token_id, bos_token_id)
    config_json = llama_config_json(model.config, bos, eos, dtype)
    if (directory / INDEX_FILE).exists():
        raise ValueError(f"{directory} holds a sharded checkpoint ({INDEX_FILE}); use a new one")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(model, dtype)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    write_json(directory / CONFIG_FILE, config_json)
    generation = {"bos_token_id": bos, "eos_token_id": _one_or_list(eos)}
    write_json(directory / GENERATION_CONFIG_FILE, generation)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    return directory


def _save_special_ids(
    config: TransformerConfig,
    tokenizer: HFTokenizer | None,
    eos_token_id: int | Sequence[int] | None,
    bos_token_id: int | None,
) -> tuple[tuple[int, ...], int | None]:
    """(EOS ids, BOS id) for `save_hf_model`: the arguments, else the tokenizer's; checked
    against the embedding's rows."""
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
            f"{config.vocab_size} embedding rows"
        )
    if eos_token_id is None:
        if tokenizer is None:
            raise ValueError("save_hf_model needs eos_token_id or a tokenizer_dir naming EOS")
        eos_token_id = sorted(tokenizer.eos_ids)
    if bos_token_id is None and tokenizer is not None:
        bos_token_id = tokenizer.bos_id
    eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    for token in (*eos, *([] if bos_token_id is None else [bos_token_id])):
        if (
            not isinstance(token, int)
            or isinstance(token, bool)
            or not 0 <= token < config.vocab_size
        ):
            raise ValueError(f"special token id {token!r} is not in [0, {config.vocab_size})")
    if not eos:
        raise ValueError("save_hf_model needs at least one EOS id")
    return eos, bos_token_id


def _hf_tensors(model: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face tensor name -> a copy of its rows of the model (the loader's plan
    inverted)."""
    params = dict(model.named_parameters())
    out = {}
    for name, target in weight_plan(model.config).items():
        rows = params[target.param].detach()[target.start : target.start + target.shape[0]]
        out[name] = rows.to(device="cpu", dtype=dtype, copy=True).contiguous()
    return out


def _one_or_list(ids: Sequence[int]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else list(ids)
