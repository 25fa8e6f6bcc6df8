"""A reduced draft vocabulary: the draft computes logits for a kept subset of token ids only.

Why: a small draft spends most of a pass in its output layer and in the vocabulary-wide work
after it (the default draft's output matrix is its target's 49,152 x 576 embedding, 28.3M of
its 38.9M parameters, against 3.5M in each of its three blocks; at 64 rows the softmax, the
top-p nucleus, the draw and the feature over 49,152 ids cost more than a block). With a map of
kept ids the draft stage multiplies `final_norm(x)` by the kept rows only (a copy gathered once,
at load: `ReducedHead.kept_logits`) and warps, samples and computes the feature over those n
logits (avspec.engine.draft_stage): q is 0 outside the kept
ids, draft_probs keeps the full vocabulary width (q written at the kept ids), and the target
verifies over the full vocabulary. Rejection sampling is exact for any q the drafts were drawn
from, so the output law is unchanged; a target token outside the map can only come from the
residual max(0, p - q), so acceptance drops by about the target's mass outside the map.

The map is one JSON file, by default `draft_vocab.json` in the draft's model directory (the draft
stage's `draft_vocab` parameter names it; "" = off; "auto", the served default, = that file when
the draft's directory has one, else off):

    {"token_ids": [0, 1, 2, 17, ...], "source": "what it was built from", ...}

`token_ids`: the kept ids of the target's vocabulary (the draft's rows share it), sorted
ascending, unique, each in 0..width-1 (width: the stage's `vocab_width`), at least one.
`source` (a string) and any other keys (`vocab_size`, `coverage`: what
`avspec.tools.train.draft_vocab` records) are informational and not read. Every problem raises
`DraftVocabError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from avspec.runtime.quantized import Int8Linear
from avspec.runtime.transformer import Transformer
from avspec.runtime.w8a8 import W8A8Linear

DRAFT_VOCAB_FILE = "draft_vocab.json"
DRAFT_VOCAB_AUTO = "auto"  # the parameter value: DRAFT_VOCAB_FILE of the draft when it has one


class DraftVocabError(ValueError):
    """A draft vocabulary map that cannot be used: the message names the file and the problem."""


@dataclass(frozen=True)
class DraftVocab:
    """A validated map: the kept token ids (sorted, unique) and where it came from."""

    token_ids: tuple[int, ...]
    source: str = ""
    path: str = ""  # the file it was read from ("" when built in memory)

    @classmethod
    def of(cls, token_ids: Sequence[int] | Tensor, width: int, source: str = "") -> DraftVocab:
        """A map of `token_ids` checked against a vocabulary of `width` ids."""
        ids = token_ids.tolist() if isinstance(token_ids, Tensor) else list(token_ids)
        return cls(check_token_ids(ids, width, "draft vocabulary"), source)

    def __len__(self) -> int:
        return len(self.token_ids)


def check_token_ids(token_ids: Any, width: int, where: str) -> tuple[int, ...]:
    """`token_ids` as a tuple of ints, or DraftVocabError (prefixed by `where`) unless it is a
    non-empty list of ints, sorted ascending without repeats, each in 0..width-1."""
    if not isinstance(token_ids, list | tuple):
        raise DraftVocabError(f"{where}: token_ids must be a list of ints, got {_kind(token_ids)}")
    if not token_ids:
        raise DraftVocabError(f"{where}: token_ids is empty (keep at least one token)")
    for i, value in enumerate(token_ids):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DraftVocabError(f"{where}: token_ids[{i}] = {value!r} is not an int")
        if not 0 <= value < width:
            raise DraftVocabError(
                f"{where}: token_ids[{i}] = {value} is outside the vocabulary 0..{width - 1}"
            )
        if i and value <= token_ids[i - 1]:
            problem = "repeats" if value == token_ids[i - 1] else "is below"
            raise DraftVocabError(
                f"{where}: token_ids[{i}] = {value} {problem} token_ids[{i - 1}] = "
                f"{token_ids[i - 1]}: ids must be sorted ascending and unique"
            )
    return tuple(token_ids)


def draft_vocab_path(model_dir: Path | str, name: str) -> Path:
    """The map file the draft stage's `draft_vocab` parameter names: an absolute path as given,
    a relative one inside the draft's model directory."""
    path = Path(name).expanduser()
    return path if path.is_absolute() else Path(model_dir) / path


def load_draft_vocab(path: Path | str, width: int) -> DraftVocab:
    """Read and validate the map at `path` for a vocabulary of `width` ids (the draft stage's
    `vocab_width`); DraftVocabError names the file and the problem."""
    path = Path(path)
    where = f"draft vocabulary {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DraftVocabError(
            f"{where}: no such file (the draft's `draft_vocab` parameter names it, relative to "
            "the draft's model directory; build one with `python -m "
            "avspec.tools.train.draft_vocab`)"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise DraftVocabError(f"{where}: cannot be read: {err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DraftVocabError(f"{where}: not JSON: {err}") from None
    if not isinstance(data, dict):
        raise DraftVocabError(f"{where}: must be a JSON object, got {_kind(data)}")
    if "token_ids" not in data:
        raise DraftVocabError(f"{where}: no `token_ids` key")
    source = data.get("source", "")
    if not isinstance(source, str):
        raise DraftVocabError(f"{where}: source must be a string, got {_kind(source)}")
    return DraftVocab(check_token_ids(data["token_ids"], width, where), source, str(path))


def resolve_draft_vocab(model_dir: Path | str, name: str, width: int) -> DraftVocab | None:
    """The map a draft stage's `draft_vocab` parameter `name` selects for the draft in
    `model_dir` (vocabulary of `width` ids): None for "" or for "auto" when the directory has no
    DRAFT_VOCAB_FILE; else the file it names, loaded (DraftVocabError when it cannot be)."""
    if not name:
        return None
    path = draft_vocab_path(model_dir, DRAFT_VOCAB_FILE if name == DRAFT_VOCAB_AUTO else name)
    if name == DRAFT_VOCAB_AUTO and not path.exists():
        return None
    return load_draft_vocab(path, width)


def save_draft_vocab(path: Path | str, token_ids: Sequence[int], source: str, **extra: Any) -> None:
    """Write a map (`token_ids` sorted and deduplicated here), with `source` and `extra` keys
    (informational: e.g. the vocabulary size and the coverage)."""
    ids = sorted({int(t) for t in token_ids})
    document = {"token_ids": ids, "source": source, **extra}
    text = json.dumps(document, separators=(",", ":"), allow_nan=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


class ReducedHead:
    """The draft's output layer restricted to a map's token ids.

    `kept_logits(x)` [..., kept] multiplies `final_norm(x)` by the kept rows of the output matrix,
    gathered once here (a float model: a copy of those rows, tied or untied; a quantized model's
    int8 or w8a8 head: those rows of it, same kernels); `index` [kept] int64 holds their token ids.
    `__call__(x)` scatters them into [..., vocab] (the model's rows) with -inf at every other id:
    the full-width logits the map stands for (tests and benchmarks compare with them; the draft
    stage works on `kept_logits` alone). Device-agnostic: the copy and the index live with the
    weights. The copy is taken at construction: weights changed afterwards are not seen.
    """

    def __init__(self, model: Transformer, vocab: DraftVocab) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        check_token_ids(list(vocab.token_ids), self.vocab_size, "draft vocabulary")
        weight = model.embed.weight
        self.index = torch.tensor(vocab.token_ids, dtype=torch.int64, device=weight.device)
        self.rows: Tensor | None = None
        self.layer: nn.Module | None = None
        head = model.lm_head
        with torch.no_grad():
            if head is None:  # tied: the embedding's rows
                self.rows = weight.detach()[self.index].contiguous()
            elif isinstance(head, Int8Linear | W8A8Linear):
                self.layer = head.rows(self.index)
            elif isinstance(head, nn.Linear) and head.bias is None:
                self.rows = head.weight.detach()[self.index].contiguous()
            else:
                raise DraftVocabError(
                    f"a reduced draft vocabulary needs a tied, linear, int8 or w8a8 output layer, "
                    f"the model has {type(head).__name__}"
                )

    def __len__(self) -> int:
        return len(self.index)

    def kept_logits(self, x: Tensor) -> Tensor:
        """x: [..., width] (the last block's output) -> the kept ids' logits [..., kept]."""
        if self.layer is not None:
            return self.layer(self.model.final_norm(x))
        assert self.rows is not None
        return self.model.subset_logits(x, self.rows)

    def __call__(self, x: Tensor) -> Tensor:
        """x: [..., width] -> logits [..., vocab]: the kept ids' logits, -inf elsewhere."""
        return self.scatter(self.kept_logits(x))

    def scatter(self, kept: Tensor) -> Tensor:
        """kept: [..., kept] -> [..., vocab]: kept[..., j] at id token_ids[j], -inf elsewhere."""
        return scatter_kept(kept, self.index, self.vocab_size)


class KeptColumns:
    """The reduced output layer of a model whose forward returns every id's logits (llama.cpp's
    engine: ggml computes the whole output layer, it cannot take a subset of its rows): the
    kept ids' columns of those logits. The same face as `ReducedHead` (`index`,
    `kept_logits`), so the draft stage samples in the map's index space either way."""

    def __init__(self, vocab_size: int, vocab: DraftVocab) -> None:
        check_token_ids(list(vocab.token_ids), vocab_size, "draft vocabulary")
        self.vocab_size = vocab_size
        self.index = torch.tensor(vocab.token_ids, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.index)

    def kept_logits(self, x: Tensor) -> Tensor:
        """x: [..., vocab] logits -> the kept ids' logits [..., kept]."""
        return x.index_select(x.dim() - 1, self.index)


def scatter_kept(kept: Tensor, index: Tensor, vocab_size: int) -> Tensor:
    """kept: [..., n] values of the ids `index` [n] int64 -> [..., vocab_size]: kept[..., j] at
    id index[j], -inf at every other id (so softmax gives those ids 0)."""
    full = kept.new_full((*kept.shape[:-1], vocab_size), -math.inf)
    return full.index_copy_(kept.dim() - 1, index, kept)


def _kind(value: object) -> str:
    return type(value).__name__ if value is not None else "null"
