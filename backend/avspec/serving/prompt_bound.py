"""How many bytes of prompt one token can stand for, so an oversized prompt is refused untokenized.

Tokenizing costs time proportional to the text (a 1 MB prompt took 2.9 s on the shipped
tokenizer, holding the GIL), and only then did the context check refuse it. If every token of a
tokenizer consumes at most L bytes of input text, a text of B bytes needs at least ceil(B / L)
tokens, so a text of more than `room * L` bytes cannot fit `room` prompt tokens and is refused
before it is tokenized (`avspec.serving.requests.parse_prompt_request`).

`max_token_bytes` derives L once, at load, from the tokenizer's `tokenizer.json`, and only for
pipelines in which the bound is sound (`None` otherwise: such prompts are tokenized in full, as
before):

- model BPE whose every input character reaches a token: byte fallback, or a byte-level
  pre-tokenizer with all 256 byte pieces in the vocabulary, or an unknown token that is not
  fused (one per character, at most 4 bytes); without these BPE silently drops characters it
  cannot spell, and a long run of them would cost no token at all;
- a piece consumes at most its own length: in bytes of its UTF-8 spelling, or in characters
  when a byte-level pre-tokenizer maps each input byte to one character; added tokens consume
  their content; an added token that strips whitespace around it (`lstrip` / `rstrip`) could
  swallow any amount, so it voids the bound;
- pre-tokenizers that only split or map (ByteLevel, Metaspace, Digits, Split and Punctuation
  that keep what they match) never drop input; normalizers that only grow the text (Prepend,
  Replace by something no shorter) leave L as it is; Unicode normal forms and lowercasing can
  shrink a character's UTF-8 bytes at most 4 to 1 (U+1D400 to "A" under NFKC, the Kelvin sign
  to "k"), so they multiply L by 4. Anything else (stripping, accent removal, BERT cleaning,
  precompiled SentencePiece rules, regex replacements, other models) gives no bound.

BOS or other post-processor tokens only add tokens, so they never make a refused prompt fit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenizers.pre_tokenizers import ByteLevel

from avspec.runtime.hf_tokenizer import TOKENIZER_FILE, HFTokenizer
from avspec.runtime.tokenizer import Tokenizer

SHRINKING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
NORMAL_FORM_SHRINK = 4  # most UTF-8 bytes of input per byte of normalized text
MAX_CHAR_BYTES = 4  # longest UTF-8 character
_KEEPING_BEHAVIOURS = frozenset({"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"})


def max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most input bytes one token of `tokenizer` can consume, or None when no sound bound
    follows from its `tokenizer.json` (see the module docstring); None for a tokenizer that is
    not an `HFTokenizer` loaded from a directory."""
    if not isinstance(tokenizer, HFTokenizer) or tokenizer.directory is None:
        return None
    spec = json.loads((tokenizer.directory / TOKENIZER_FILE).read_text(encoding="utf-8"))
    return token_bytes_of_spec(spec)


def token_bytes_of_spec(spec: Mapping[str, Any]) -> int | None:
    """`max_token_bytes` of a parsed `tokenizer.json`."""
    shrink = _normalizer_shrink(spec.get("normalizer"))
    byte_level = _pre_tokenizer_byte_level(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    if shrink is None or byte_level is None or model.get("type") != "BPE":
        return None
    vocab = model.get("vocab") or {}
    if not isinstance(vocab, Mapping):
        return None
    longest = max((len(p) if byte_level else len(p.encode()) for p in vocab), default=0)
    for added in spec.get("added_tokens") or ():
        if added.get("lstrip") or added.get("rstrip"):
            return None
        longest = max(longest, len(str(added.get("content", "")).encode()))
    if not (model.get("byte_fallback") or (byte_level and _has_every_byte_piece(vocab))):
        if model.get("unk_token") is None or model.get("fuse_unk"):
            return None  # characters it cannot spell are dropped or fused: no bound
        longest = max(longest, MAX_CHAR_BYTES)  # one unknown token per character
    return longest * shrink if longest > 0 else None


def prompt_byte_limit(token_bytes: int, room_tokens: int) -> int:
    """The most bytes a prompt of at most `room_tokens` tokens can have."""
    return max(0, room_tokens) * token_bytes


def _normalizer_shrink(normalizer: Mapping[str, Any] | None) -> int | None:
    """Input bytes per normalized byte, at most: 1, NORMAL_FORM_SHRINK, or None (unbounded)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or ():
            inner = _normalizer_shrink(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content", "")
        literal = pattern.get("String")
        if literal is None or len(content.encode()) < len(literal.encode()):
            return None
        return 1
    if kind in SHRINKING_NORMALIZERS:
        return NORMAL_FORM_SHRINK
    return None


def _pre_tokenizer_byte_level(pre: Mapping[str, Any] | None) -> bool | None:
    """Whether a ByteLevel step maps bytes to characters; None if a step may drop input."""
    if pre is None:
        return False
    kind = pre.get("type")
    if kind == "Sequence":
        found = False
        for part in pre.get("pretokenizers") or ():
            inner = _pre_tokenizer_byte_level(part)
            if inner is None:
                return None
            found = found or inner
        return found
    if kind == "ByteLevel":
        return True
    if kind in ("Metaspace", "Digits"):
        return False
    if kind in ("Split", "Punctuation"):
        return False if pre.get("behavior", "Isolated") in _KEEPING_BEHAVIOURS else None
    return None


def _has_every_byte_piece(vocab: Mapping[str, int]) -> bool:
    return all(piece in vocab for piece in ByteLevel.alphabet())
