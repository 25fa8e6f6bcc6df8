"""Convert a Llama GGUF file into a Hugging Face `LlamaForCausalLM` directory, cached by hash.

`convert_gguf` writes `config.json`, `generation_config.json`, `model.safetensors` (every
tensor dequantized, q/k rows put back in Hugging Face order, stored in `dtype`: bf16 by
default, float32 for exact comparisons), `tokenizer.json`, `tokenizer_config.json` (with the
chat template), `special_tokens_map.json` and `gguf_source.json` (the source file's name,
sha256, tensor types and the converter version). The directory is built under a temporary name
beside `out` and renamed into place, so a directory that exists is complete.

`cached_conversion` keys that work by the GGUF's sha256 (`<cache>/<sha256>/<dtype>/`): the same
file converts once, whatever its name or path, and a changed file converts again. A cache
entry written by another converter version is rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from avspec.runtime.gguf.llama import (
    check_architecture,
    hf_tensor_name,
    llama_config,
    rotary_heads,
    unpermute_rotary_rows,
)
from avspec.runtime.gguf.reader import GGUFError, GGUFFile
from avspec.runtime.gguf.tokenizer import build_tokenizer, special_token_fields, tokenizer_config
from avspec.runtime.gguf.wheel import file_sha256
from avspec.runtime.hf_checkpoint import llama_config_json

CONVERTER_VERSION = 1
SOURCE_FILE = "gguf_source.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def convert_gguf(
    gguf_path: Path | str,
    out: Path | str,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    sha256: str | None = None,
) -> Path:
    """Write the Hugging Face directory `out` for the Llama GGUF `gguf_path`; returns `out`.

    Raises GGUFError (naming the file) for another architecture, a tensor type the `gguf`
    package cannot dequantize, an unknown tensor or an unsupported tokenizer, before `out` is
    touched. `out` must not exist yet.
    """
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; convert into a new directory")
    gguf = GGUFFile(gguf_path)
    check_architecture(gguf)
    config = llama_config(gguf)
    tokenizer = build_tokenizer(gguf)
    tensors = hf_tensors(gguf, config, dtype, progress)
    bos = gguf.value("tokenizer.ggml.bos_token_id", None)
    eos = gguf.value("tokenizer.ggml.eos_token_id", None)
    if eos is None:
        raise GGUFError(f"{gguf.path}: metadata 'tokenizer.ggml.eos_token_id' is missing")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        dtype_name = str(dtype).removeprefix("torch.")
        _write_json(scratch / "config.json", llama_config_json(config, bos, [eos], dtype))
        _write_json(scratch / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
        tokenizer.save(str(scratch / "tokenizer.json"))
        tok_config = tokenizer_config(gguf, config.max_length)
        _write_json(scratch / "tokenizer_config.json", tok_config)
        specials = {f: tok_config[f] for f in special_token_fields().values() if f in tok_config}
        _write_json(scratch / "special_tokens_map.json", specials)
        source = {
            "file": gguf.path.name,
            "sha256": sha256 if sha256 is not None else file_sha256(gguf.path),
            "architecture": gguf.architecture,
            "name": gguf.value("general.name", None),
            "tensor_types": dict(Counter(gguf.tensor_type(n) for n in gguf.tensor_names())),
            "dtype": dtype_name,
            "converter_version": CONVERTER_VERSION,
        }
        _write_json(scratch / SOURCE_FILE, source)
        scratch.chmod(0o755)  # mkdtemp made it private
        os.replace(scratch, out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return out


def hf_tensors(
    gguf: GGUFFile, config: Any, dtype: torch.dtype, progress: bool = True
) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its Hugging Face name, dequantized, q/k rows unpermuted,
    in `dtype`."""
    names = gguf.tensor_names()
    tensors = {}
    for name in tqdm(names, desc="dequantizing", disable=not progress, mininterval=2.0):
        hf_name = hf_tensor_name(name)
        value = gguf.tensor(name)
        heads = rotary_heads(name, config)
        if heads is not None:
            value = unpermute_rotary_rows(value, heads)
        tensors[hf_name] = value.to(dtype).contiguous()
    return tensors


def cached_conversion(
    gguf_path: Path | str,
    cache_dir: Path | str,
    dtype: torch.dtype = torch.bfloat16,
    log: Callable[[str], None] = print,
) -> Path:
    """The converted directory of `gguf_path` under `cache_dir`, converting it if needed."""
    gguf_path = Path(gguf_path)
    log(f"hashing {gguf_path}")
    digest = file_sha256(gguf_path)
    dtype_name = str(dtype).removeprefix("torch.")
    entry = Path(cache_dir) / digest / dtype_name
    if _complete(entry):
        log(f"using the cached conversion {entry}")
        entry.chmod(0o755)  # the server's user reads it (older entries were 0700)
        return entry
    if entry.exists():
        shutil.rmtree(entry)
    log(f"converting {gguf_path.name} ({dtype_name}) into {entry}")
    return convert_gguf(gguf_path, entry, dtype, sha256=digest)


def _complete(entry: Path) -> bool:
    try:
        source = json.loads((entry / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("converter_version") == CONVERTER_VERSION


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def place_gguf(source: Path, out: Path, log: Callable[[str], None] = lambda _: None) -> None:
    """Put the GGUF file itself beside the checkpoint (llama.cpp's engine serves it): a hard
    link when the two share a file system, else a copy; kept when it already has the same size."""
    if out.is_file() and out.stat().st_size == source.stat().st_size:
        return
    out.unlink(missing_ok=True)
    try:
        os.link(source, out)
    except OSError:
        shutil.copyfile(source, out)
    log(f"placed {source.name} as {out}")
