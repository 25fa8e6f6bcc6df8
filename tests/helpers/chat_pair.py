"""Tiny pairs that render chat prompts (SmolLM2's ChatML template in the tokenizer config).

- `save_tiny_chat_pair`: `save_tiny_pair` (the serving tests' pair) with the template;
- `save_smooth_chat_pair`: a pair whose next-token distributions are spread out and whose draft
  is close to the target, so acceptance is high and changes with temperature and top-p.

The byte-level tokenizer spells the template's markers byte by byte, so rendered prompts reach
a few hundred tokens: the saved configs allow `MAX_POSITIONS` (the weights do not depend on it).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from helpers.server import save_tiny_pair

# SmolLM2-135M-Instruct's template (its GGUF's tokenizer.chat_template), verbatim.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_POSITIONS = 1024


def add_chat_template(directory: Path, template: str = CHATML) -> Path:
    """Put `template` into `directory/tokenizer_config.json` (created if missing)."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config["chat_template"] = template
    path.write_text(json.dumps(config))
    return directory


def save_tiny_chat_pair(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """`save_tiny_pair` with the ChatML template in both tokenizer configs and
    `max_position_embeddings` raised to MAX_POSITIONS; returns (target dir, draft dir)."""
    dirs = save_tiny_pair(directory, seed)
    for model_dir in dirs:
        add_chat_template(model_dir)
        config_path = model_dir / "config.json"
        config = json.loads(config_path.read_text())
        config["max_position_embeddings"] = MAX_POSITIONS
        config_path.write_text(json.dumps(config, indent=2))
    return dirs


def save_smooth_chat_pair(
    directory: Path, seed: int = 0, logit_std: float = 2.0, draft_noise: float = 0.05
) -> tuple[Path, Path]:
    """A seeded pair with spread-out next-token distributions (untied output matrix drawn so
    the logits have sd about `logit_std`) and a draft that is the target plus `draft_noise`
    times each weight's sd of noise, so acceptance is high and temperature and top-p matter;
    byte tokenizer, ChatML template, MAX_POSITIONS positions. Returns (target dir, draft dir)."""
    from avspec.runtime.transformer import Transformer, init_weights
    from helpers.hf_dirs import llama_form_config, save_transformer_dir

    generator = torch.Generator().manual_seed(seed)
    config = llama_form_config(max_length=MAX_POSITIONS, tie_embeddings=False)
    target = Transformer(config)
    init_weights(target, generator)
    with torch.no_grad():
        target.embed.weight.mul_(50.0)  # unit-scale inputs, so the blocks see the context
        for name, t in target.named_parameters():
            if name.startswith("blocks.") and t.dim() == 2:
                t.mul_(10.0)
        std = logit_std / math.sqrt(config.width)  # norm(x) has unit RMS
        target.lm_head.weight.normal_(0.0, std, generator=generator)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for t in draft.parameters():
            t.add_(draft_noise * t.std() * torch.randn(t.shape, generator=generator))
    dirs = (directory / "target", directory / "draft")
    for model, model_dir in zip((target, draft), dirs, strict=True):
        save_transformer_dir(model_dir, model)
        add_chat_template(model_dir)
    return dirs
