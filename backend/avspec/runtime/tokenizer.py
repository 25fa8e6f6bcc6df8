"""Tokenizers: the `Tokenizer` protocol serving relies on, and a plain byte tokenizer.

Serving's tokenizer is always `avspec.runtime.hf_tokenizer.HFTokenizer`: the `tokenizer.json` of
the target's Hugging Face checkpoint (`avspec.runtime.model_dir.load_tokenizer`).

`ByteTokenizer` (token ids 0..255 are UTF-8 bytes, 256 is end-of-sequence) is no model's
tokenizer any more; the training code's small tests and unit tests use it as a simple
`Tokenizer`. `IncrementalDecoder` turns its stream of token ids into text: it holds back the
bytes of a character whose UTF-8 sequence is not complete yet.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class StreamDecoder(Protocol):
    """Streaming detokenization of one response."""

    def push(self, ids: Iterable[int]) -> str:
        """Feed token ids; return the text that is complete so far (possibly "")."""
        ...

    def flush(self) -> str:
        """Return whatever is held back and reset for a new stream."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """What serving needs of a tokenizer (`HFTokenizer`; `ByteTokenizer` also has this shape)."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (0..vocab_size-1)."""
        ...

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation: stop on any of them."""
        ...

    def encode(self, text: str, plain: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Prompt token ids of `text` (with BOS where the model wants one, never EOS); special-
        token text inside the `plain` (start, end) character spans is encoded as text."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, skipping EOS (and other special tokens); never raises."""
        ...

    def incremental_decoder(self) -> StreamDecoder:
        """A fresh streaming decoder whose pieces concatenate to `decode` of all ids."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens plus one EOS id; encoding never fails, decoding never raises."""

    vocab_size = 257
    eos_id = 256
    eos_ids = frozenset({eos_id})
    name = "byte"

    def encode(self, text: str, plain: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Return the UTF-8 bytes of `text` as token ids (no EOS appended); no text spells a
        special token here, so `plain` changes nothing."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of `ids`, skipping EOS; invalid UTF-8 becomes U+FFFD."""
        return _to_bytes(ids, self.eos_id).decode("utf-8", errors="replace")

    def incremental_decoder(self) -> IncrementalDecoder:
        """A fresh `IncrementalDecoder` for one response."""
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Decode a token stream piece by piece, emitting only complete characters."""

    def __init__(self, tokenizer: ByteTokenizer | None = None) -> None:
        self._eos_id = (tokenizer or ByteTokenizer()).eos_id
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        """Feed token ids; return the text of every character completed so far."""
        return self._decoder.decode(_to_bytes(ids, self._eos_id), final=False)

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character becomes U+FFFD) and reset."""
        return self._decoder.decode(b"", final=True)


def _to_bytes(ids: Iterable[int], eos_id: int) -> bytes:
    """Bytes of `ids` without EOS; an id outside 0..255 becomes 0xFF, which decodes to U+FFFD."""
    return bytes(i if 0 <= i <= 255 else 0xFF for i in map(int, ids) if i != eos_id)
