"""A draft that shares its target's embedding: stored without it, assembled from the target.

The default draft (`avspec.tools.train.draft.model`, shape `target_layers`) trains with the target's
embedding tied and frozen, so its `model.embed_tokens.weight` is the target's tensor, bit for
bit: 28.3M of its 38.9M parameters. The committed draft directory holds everything else:

- `draft_layers.safetensors`: every tensor of the draft's `model.safetensors` but the embedding;
- `shared_embedding.json`: the tensor's name, dtype and shape, and the sha256 of its bytes as
  stored (plus, informational, the GGUF the target was converted from);

and `assemble` (`make models`, or `python -m avspec.tools.train.draft_embedding
--target models/target --draft models/draft`) writes the full `model.safetensors` from those and the
target's tensor, after checking that tensor's hash: a target converted from another file, or to a
precision the embedding's bytes do not survive, is refused by name instead of serving a draft that
no longer matches it. `split` is the inverse, run when the trained draft is saved. The assembled
directory is a plain `LlamaForCausalLM` checkpoint (`transformers` loads it as is).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from avspec.runtime.hf_files import SHARED_EMBEDDING_FILE as MANIFEST_FILE
from avspec.runtime.hf_files import WEIGHTS_FILE

EMBEDDING = "model.embed_tokens.weight"
LAYERS_FILE = "draft_layers.safetensors"


class SharedEmbeddingError(ValueError):
    """The draft cannot be assembled: the message names the file and the problem."""


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, as stored)."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def split(draft_dir: Path | str, source: dict[str, Any] | None = None) -> Path:
    """Write `draft_layers.safetensors` and `shared_embedding.json` from the draft's full
    `model.safetensors`; returns the layers file."""
    draft_dir = Path(draft_dir)
    tensors = load_file(draft_dir / WEIGHTS_FILE)
    embedding = tensors.pop(EMBEDDING)
    manifest = {
        "tensor": EMBEDDING,
        "dtype": str(embedding.dtype).removeprefix("torch."),
        "shape": list(embedding.shape),
        "sha256": tensor_sha256(embedding),
        "from": "the target's model.embed_tokens.weight (make models assembles model.safetensors)",
        **({"target_source": source} if source else {}),
    }
    _atomic(draft_dir / LAYERS_FILE, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    (draft_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return draft_dir / LAYERS_FILE


def target_embedding(target_dir: Path | str) -> torch.Tensor:
    """The target's `model.embed_tokens.weight`, from whichever of its safetensors holds it."""
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:  # type: ignore[attr-defined]
            if EMBEDDING in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return f.get_tensor(EMBEDDING)
    raise SharedEmbeddingError(f"{target_dir}: no {EMBEDDING} in its safetensors files")


def assemble(draft_dir: Path | str, target_dir: Path | str) -> Path:
    """Write the draft's `model.safetensors` = its layers + the target's embedding, checked
    against the manifest; returns the written file."""
    draft_dir = Path(draft_dir)
    manifest_path = draft_dir / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
        dtype = getattr(torch, manifest["dtype"])
        shape, expected = list(manifest["shape"]), manifest["sha256"]
    except FileNotFoundError:
        raise SharedEmbeddingError(
            f"{manifest_path}: no such file (not a shared-embedding draft)"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise SharedEmbeddingError(f"{manifest_path}: malformed ({err!r})") from None
    embedding = target_embedding(target_dir)
    if list(embedding.shape) != shape:
        raise SharedEmbeddingError(
            f"{target_dir}: embedding {list(embedding.shape)}, the draft in {draft_dir} was "
            f"trained on {shape}: not its target"
        )
    embedding = embedding.to(dtype)
    if tensor_sha256(embedding) != expected:
        source = manifest.get("target_source", {})
        raise SharedEmbeddingError(
            f"{target_dir}: its embedding (as {manifest['dtype']}) is not the one the draft in "
            f"{draft_dir} was trained with (sha256 {expected[:16]}...; that target was converted "
            f"from GGUF sha256 {str(source.get('sha256', '?'))[:16]}...): convert that target, "
            "or train a draft for this one (make draft)"
        )
    tensors = load_file(draft_dir / LAYERS_FILE)
    tensors[EMBEDDING] = embedding
    out = draft_dir / WEIGHTS_FILE
    _atomic(out, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    return out


def _atomic(path: Path, write: Any) -> None:
    partial = path.with_name(path.name + ".partial")
    write(str(partial))
    os.replace(partial, path)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.train.draft_embedding", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--target", type=Path, default=Path("models/target"))
    parser.add_argument("--draft", type=Path, default=Path("models/draft"))
    args = parser.parse_args(argv)
    try:
        out = assemble(args.draft, args.target)
    except SharedEmbeddingError as err:
        parser.exit(2, f"draft_embedding: {err}\n")
    print(f"[draft_embedding] wrote {out} (layers + the embedding of {args.target})")


if __name__ == "__main__":
    main()
