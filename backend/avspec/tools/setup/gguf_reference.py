"""`transformers`' own reading of a GGUF file: the reference the converter is checked against.

`transformers` dequantizes GGUF tensors and undoes llama.cpp's q/k permutation in its own code
(`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`). `from_pretrained(...,
gguf_file=...)` wraps that and also requires `accelerate`; this module calls the loader directly
(the config it parses, a `LlamaForCausalLM` built from it, the tensors it returns), so the
reference needs only `transformers` and `gguf`, both pinned for development.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def transformers_gguf_model(gguf_path: Path | str) -> Any:
    """A float32 `transformers.LlamaForCausalLM` in eval mode, loaded from `gguf_path` by
    `transformers`' GGUF loader."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    fields = {k: v for k, v in parsed["config"].items() if k != "model_type"}
    config = LlamaConfig(**fields)
    model = LlamaForCausalLM(config).float()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"transformers' GGUF tensors: missing {missing}, extra {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
