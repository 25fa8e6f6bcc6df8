"""The launcher's model arguments that name GGUF files, turned into model directories.

`--draft-model` / `--target-model` take a Hugging Face checkpoint directory (the only format the
runtime serves, `avspec.runtime.model_dir`) or a llama.cpp `.gguf` file. `model_directory`
returns a directory unchanged and converts a `.gguf` file once through the hash-keyed cache
(`avspec.runtime.gguf.convert.cached_conversion`: `<cache>/<sha256>/<dtype>/`, bfloat16 by
default; the runtime picks its compute dtype separately), returning the converted directory.
A `.gguf` path that is missing or not a regular file, and a GGUF the converter refuses (not
Llama-family, an unsupported tensor type or tokenizer), raise GGUFError naming the option, the
file and the reason. Progress lines go to stderr, prefixed "avspec:" like the launcher's.

The launcher converts in the process that parses its arguments, before it drops root, and
passes the converted directories on (avspec.serving.host.launcher).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from avspec.runtime.gguf.convert import cached_conversion, place_gguf
from avspec.runtime.gguf.reader import GGUFError
from avspec.runtime.hf_files import GGUF_FILE

GGUF_SUFFIX = ".gguf"


def names_gguf(argument: Path) -> bool:
    """Whether a model argument names a GGUF file (a `.gguf` path that is not a directory)."""
    return argument.suffix.lower() == GGUF_SUFFIX and not argument.is_dir()


def model_directory(
    argument: Path,
    cache_dir: Path,
    option: str = "model",
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """The model directory `argument` stands for: itself unless it names a GGUF file (see
    `names_gguf`), else that file's converted directory (absolute), converted if not cached.

    `option` (the command-line option, "--target-model") starts the progress lines and the
    error messages. Raises GGUFError for a missing or non-regular file and for a file the
    converter refuses or cannot read.
    """
    if not names_gguf(argument):
        return argument
    if not argument.exists():
        raise GGUFError(f"{option} {argument}: no such GGUF file")
    if not argument.is_file():
        raise GGUFError(f"{option} {argument}: not a regular file")

    def log(message: str) -> None:
        print(f"avspec: {option}: {message}", file=sys.stderr, flush=True)

    try:
        converted = cached_conversion(argument, cache_dir, dtype, log)
        place_gguf(argument, converted / GGUF_FILE, log)  # what llama.cpp's engine serves
    except GGUFError as err:  # its message names the file already
        raise GGUFError(f"{option} {err}") from None
    except OSError as err:
        raise GGUFError(f"{option} {argument}: cannot convert: {err}") from None
    return converted.resolve()
