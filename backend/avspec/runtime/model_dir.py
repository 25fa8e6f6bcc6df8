"""Load a model directory: a Hugging Face checkpoint, the only model format served.

A model directory is a Hugging Face checkpoint directory: `config.json` with an
`"architectures"` list (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM; read by
`avspec.runtime.hf_checkpoint`), its safetensors weights, and `tokenizer.json` (read by
`avspec.runtime.hf_tokenizer`). `avspec.runtime.hf_checkpoint.save_hf_model` writes one for a
Llama-form `Transformer`; docs/own_models.md says how to bring your own pair.

`load_model` and `load_tokenizer` are the entry points serving uses. Anything else, the retired
"avspec-transformer" directories included, raises `ModelDirError` naming the directory and what
is missing (`check_model_dir`, also run before a pair check or an engine build).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from avspec.runtime.hf_checkpoint import load_hf_model
from avspec.runtime.hf_files import CONFIG_FILE, SHARED_EMBEDDING_FILE, WEIGHTS_FILE
from avspec.runtime.hf_tokenizer import TOKENIZER_FILE, HFTokenizer
from avspec.runtime.transformer import Transformer

RETIRED_FORMAT = "avspec-transformer"  # the project's former format, refused by name


class ModelDirError(ValueError):
    """A model directory is missing, or is not a Hugging Face checkpoint."""


def is_hf_dir(path: Path | str) -> bool:
    """Whether `path/config.json` is a Hugging Face config (a JSON object with "architectures")."""
    config_path = Path(path) / CONFIG_FILE
    try:
        data = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "architectures" in data


def load_model(
    path: Path | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_length: int | None = None,
) -> Transformer:
    """Load the Hugging Face checkpoint `path` onto `device` in eval mode, in `dtype`, its
    rotary table sized for `max_length` (default: the config's `max_position_embeddings`).

    Raises ModelDirError naming the directory when it is not a Hugging Face checkpoint, and
    `HFCheckpointError` (a ValueError) naming the file and field for a malformed one.
    """
    path = Path(path)
    check_model_dir(path)
    model, _ = load_hf_model(path, dtype, device, max_length)
    return model


def load_tokenizer(path: Path | str) -> HFTokenizer:
    """The `HFTokenizer` of the Hugging Face checkpoint `path` (its `tokenizer.json`).

    Raises ModelDirError naming the directory and the missing file otherwise."""
    path = Path(path)
    check_model_dir(path)
    if not (path / TOKENIZER_FILE).is_file():
        raise ModelDirError(f"{path}: Hugging Face checkpoint without {TOKENIZER_FILE}")
    return HFTokenizer.from_directory(path)


def check_model_dir(path: Path | str) -> None:
    """Raise ModelDirError, naming `path` and the problem, unless it is a Hugging Face
    checkpoint directory (`is_hf_dir`); the checkpoint's fields are checked when it loads."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ModelDirError(
            f"{path}: missing {CONFIG_FILE}; a model directory must be a Hugging Face checkpoint"
        )
    if is_hf_dir(path):
        if (path / SHARED_EMBEDDING_FILE).is_file() and not (path / WEIGHTS_FILE).is_file():
            raise ModelDirError(
                f"{path}: a draft stored without the embedding it shares with its target "
                f"({SHARED_EMBEDDING_FILE}); assemble it first: make models, or python -m "
                f"avspec.tools.train.draft_embedding --draft {path} --target <its target>"
            )
        return
    try:
        data = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{config_path}: not valid JSON: {err}") from None
    if isinstance(data, dict) and data.get("format") == RETIRED_FORMAT:
        raise ModelDirError(
            f"{path}: an {RETIRED_FORMAT!r} directory, the retired format; models must be "
            'Hugging Face checkpoints (config.json with "architectures", tokenizer.json), '
            "see docs/own_models.md"
        )
    raise ModelDirError(
        f'{path}: not a Hugging Face checkpoint ({CONFIG_FILE} has no "architectures"); '
        "see docs/own_models.md"
    )
