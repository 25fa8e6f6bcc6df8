"""The training corpus: standard-library code and pydoc prose, split by a hash of the file name.

Files are (name, text) pairs; a pydoc topic is named `TOPICS_PREFIX + key`. The split is
deterministic (sha256 of the name, one bucket of HELD_OUT_BUCKETS held out) and both parts must
hold code and prose. Files are joined with EOS into one token stream.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from pydoc_data.topics import topics as pydoc_topics

import torch

from avspec.runtime.tokenizer import ByteTokenizer, Tokenizer

TOPICS_PREFIX = "pydoc_data/topics.py:"
HELD_OUT_BUCKETS = 10  # one bucket of ten is held out


def corpus_files() -> list[tuple[str, str]]:
    """(name, text) of every corpus file, sorted by name: stdlib modules then pydoc topics."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [(p.name, p.read_text(encoding="utf-8", errors="replace")) for p in stdlib.glob("*.py")]
    files += [(TOPICS_PREFIX + key, text) for key, text in pydoc_topics.items()]
    return sorted(files)


def is_held_out(name: str) -> bool:
    """Deterministic split by file name: sha256 bucket 0 of HELD_OUT_BUCKETS is held out."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HELD_OUT_BUCKETS == 0


def split_files(files: Sequence[tuple[str, str]]) -> tuple[list, list]:
    """Split (name, text) files into (train, held_out); both must contain code and prose."""
    train = [f for f in files if not is_held_out(f[0])]
    held_out = [f for f in files if is_held_out(f[0])]
    for part, label in ((train, "train"), (held_out, "held-out")):
        kinds = {name.startswith(TOPICS_PREFIX) for name, _ in part}
        if kinds != {True, False}:
            raise ValueError(f"the {label} split lacks code or prose: {len(part)} files")
    return train, held_out


def encode_files(files: Sequence[tuple[str, str]], tokenizer: Tokenizer) -> torch.Tensor:
    """Join files with EOS (the tokenizer's lowest EOS id) into one token stream [tokens]
    int64."""
    eos = min(tokenizer.eos_ids)
    ids: list[int] = []
    for _, text in files:
        ids += tokenizer.encode(text)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def heldout_prompts(
    files: Sequence[tuple[str, str]],
    count: int,
    length: int,
    prose: bool,
    tokenizer: Tokenizer | None = None,
) -> torch.Tensor:
    """`count` prompts [count, length] tokens of held-out code (prose=False) or prose, evenly
    spaced; the tokenizer defaults to the byte tokenizer."""
    chosen = [f for f in files if f[0].startswith(TOPICS_PREFIX) == prose]
    ids = encode_files(chosen, ByteTokenizer() if tokenizer is None else tokenizer)
    stride = (len(ids) - length) // count
    return torch.stack([ids[i * stride : i * stride + length] for i in range(count)])
