"""Load and save a model directory: the on-disk format of the draft and target models.

A model directory holds:

- `config.json`: `{"format": "avspec-transformer", "version": 1, "model": {...},
  "tokenizer": "byte"}` where `model` is a `TransformerConfig` dict (`num_layers`, `width`,
  `num_heads`, `vocab_size`, `max_length`) and `tokenizer` names the tokenizer (only `"byte"`:
  UTF-8 bytes 0..255 plus EOS 256).
- `model.safetensors`: fp32 weights keyed by the `Transformer` parameter names
  (`embed.weight`, `blocks.<i>.qkv.weight`, ...; the output layer is tied to `embed.weight`).
  Every tensor of the model must be present with exactly the shape the config implies, and no
  other tensor may be present.
- anything else (a model card, a training log) is ignored.

To serve your own pair, write both directories in this format (`save_model_dir` does it for a
`Transformer`) and point the draft and target models' `model_dir` parameter at them.

`load_model` and `load_tokenizer` are the entry points serving uses: they accept either this
format or a Hugging Face checkpoint directory (`config.json` with an `"architectures"` list,
read by `avspec.runtime.hf_checkpoint`; `tokenizer.json` read by
`avspec.runtime.hf_tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from avspec.runtime.hf_checkpoint import load_hf_model
from avspec.runtime.hf_tokenizer import TOKENIZER_FILE, HFTokenizer
from avspec.runtime.tokenizer import ByteTokenizer, Tokenizer
from avspec.runtime.transformer import Transformer, TransformerConfig

FORMAT = "avspec-transformer"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class ModelDirError(ValueError):
    """A model directory is missing, malformed, or does not match its config."""


def save_model_dir(path: Path | str, model: Transformer, tokenizer: ByteTokenizer) -> None:
    """Write `config.json` and `model.safetensors` for `model` into `path` (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "model": model.config.to_dict(),
        "tokenizer": tokenizer.name,
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    weights = {
        k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()
    }
    save_file(weights, str(path / WEIGHTS_FILE), metadata={"format": FORMAT})


def load_model_dir(
    path: Path | str, device: str | torch.device = "cpu"
) -> tuple[Transformer, ByteTokenizer]:
    """Load a model directory onto `device` in eval mode; raise ModelDirError on any mismatch."""
    path = Path(path)
    config = read_config(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ModelDirError(f"{path}: missing {WEIGHTS_FILE}")
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise ModelDirError(f"{weights_path}: unreadable safetensors file: {err}") from None
    model = Transformer(config)
    _check_weights(weights_path, model, weights)
    model.load_state_dict(weights, strict=True)
    return model.to(device).eval(), ByteTokenizer()


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
    """Load either kind of model directory onto `device` in eval mode.

    A Hugging Face checkpoint (`is_hf_dir`) is loaded by `load_hf_model` in `dtype`, its rotary
    table sized for `max_length` (default: the config's `max_position_embeddings`); a directory
    of this module's format by `load_model_dir` (fp32 weights, converted to `dtype`). Raises a
    ValueError naming the directory when it is neither.
    """
    path = Path(path)
    if is_hf_dir(path):
        model, _ = load_hf_model(path, dtype, device, max_length)
        return model
    _check_own_format(path)
    model, _ = load_model_dir(path, device)
    return model if dtype == torch.float32 else model.to(dtype)


def load_tokenizer(path: Path | str) -> Tokenizer:
    """The tokenizer of a model directory: `HFTokenizer` when it holds `tokenizer.json`, else
    the byte tokenizer of this module's format. Raises a ValueError naming the directory when
    it is neither."""
    path = Path(path)
    if (path / TOKENIZER_FILE).is_file():
        return HFTokenizer.from_directory(path)
    if is_hf_dir(path):
        raise ModelDirError(f"{path}: Hugging Face checkpoint without {TOKENIZER_FILE}")
    _check_own_format(path)
    read_config(path)
    return ByteTokenizer()


def _check_own_format(path: Path) -> None:
    """Raise ModelDirError unless `path` claims our format (read_config checks the rest)."""
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    config_path = path / CONFIG_FILE
    try:
        data = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return  # read_config names the problem
    if isinstance(data, dict) and "format" not in data:
        raise ModelDirError(
            f'{path}: neither a Hugging Face checkpoint (config.json has no "architectures") '
            f'nor an {FORMAT!r} model directory (no "format")'
        )


def read_config(path: Path) -> TransformerConfig:
    """Parse and validate `path/config.json`, returning the model config."""
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    if not config_path.is_file():
        raise ModelDirError(f"{path}: missing {CONFIG_FILE}")
    try:
        data = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{config_path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{config_path}: must hold a JSON object")
    if data.get("format") != FORMAT:
        raise ModelDirError(f"{config_path}: format must be {FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != VERSION:
        raise ModelDirError(
            f"{config_path}: version must be {VERSION}, got {data.get('version')!r}"
        )
    if data.get("tokenizer") != ByteTokenizer.name:
        raise ModelDirError(
            f"{config_path}: tokenizer must be {ByteTokenizer.name!r}, "
            f"got {data.get('tokenizer')!r}"
        )
    try:
        config = TransformerConfig.from_dict(data.get("model"))
    except ValueError as err:
        raise ModelDirError(f"{config_path}: bad model config: {err}") from None
    if config.vocab_size != ByteTokenizer.vocab_size:
        raise ModelDirError(
            f"{config_path}: vocab_size {config.vocab_size} does not match the byte tokenizer "
            f"({ByteTokenizer.vocab_size})"
        )
    return config


def _check_weights(path: Path, model: Transformer, weights: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ModelDirError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, tensor in expected.items():
        if weights[name].shape != tensor.shape:
            raise ModelDirError(
                f"{path}: tensor {name} has shape {tuple(weights[name].shape)}, the config "
                f"implies {tuple(tensor.shape)}"
            )
        if weights[name].dtype != torch.float32:
            raise ModelDirError(f"{path}: tensor {name} is {weights[name].dtype}, expected float32")
