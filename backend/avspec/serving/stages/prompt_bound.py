"""How many bytes of prompt one token can stand for, so an oversized prompt is refused untokenized.

Tokenizing costs time proportional to the text (a 1 MB prompt took 2.9 s on the shipped
tokenizer, holding the GIL), and only then did the context check refuse it. If every token of a
tokenizer consumes at most L bytes of input text, a text of B bytes needs at least ceil(B / L)
tokens, so a text of more than `room * L` bytes cannot fit `room` prompt tokens and is refused
before it is tokenized (`avspec.serving.stages.requests.parse_prompt_request`).

Some tokenizers drop bytes without a token: a byte-level BPE whose vocabulary lacks a byte's
piece (SmolLM2's lacks 21: six ASCII control characters, the bytes never found in UTF-8 and the
lead bytes 0xf1 / 0xf2) silently skips that byte ("a\\x13\\x13b" encodes as "a", "b"), and a
run of such bytes costs nothing. They cannot make a token consume more than L of the other
bytes, though (a token consumes its piece's characters, one per counted byte, whatever was
skipped between them), so the bound holds for the *counted* bytes: the text's bytes less its
dropped ones. `PromptBound` carries L (`token_bytes`) and the dropped byte values (`dropped`);
`PromptBound.counted_bytes` counts a text's bytes that count (one `bytes.translate` pass, under
a millisecond for a megabyte, and only done when the text is longer than the limit).

`prompt_bound_of` derives the bound once, at load, from the tokenizer's `tokenizer.json`, and
only for pipelines in which it is sound (`None` otherwise: such prompts are tokenized in full,
as before):

- model BPE whose every input character reaches a token or is counted as dropped: byte
  fallback; or a byte-level pre-tokenizer, each byte whose piece is missing from the vocabulary
  being dropped, unless an unfused unknown token stands for it (one byte per token), and the
  bytes a fused unknown token swallows counting as dropped too (under-counting the minimum
  token count is sound, refusing a prompt that would fit is not); or an unknown token that is
  not fused (one per character, at most 4 bytes). Other BPE pipelines silently drop characters
  they cannot spell, with no byte to count them by: no bound;
- a piece consumes at most its own length: in bytes of its UTF-8 spelling, or in characters
  when a byte-level pre-tokenizer maps each input byte to one character; added tokens consume
  their content; an added token that strips whitespace around it (`lstrip` / `rstrip`) could
  swallow any amount, so it voids the bound;
- pre-tokenizers that only split or map (ByteLevel, Metaspace, Digits, Split and Punctuation
  that keep what they match) never drop input; normalizers that only grow the text (Prepend,
  Replace by something no shorter) leave L as it is; Unicode normal forms and lowercasing can
  shrink a character's UTF-8 bytes at most 4 to 1 (U+1D400 to "A" under NFKC, the Kelvin sign
  to "k"), so they multiply L by 4. Anything else (stripping, accent removal, BERT cleaning,
  precompiled SentencePiece rules, regex replacements, other models) gives no bound;
- with dropped bytes, no step may turn counted input into dropped bytes: a Replace must put in
  at least as many counted bytes as it takes out, a Metaspace replacement must contain no
  dropped byte, and Unicode normal forms or lowercasing give no bound.

BOS or other post-processor tokens only add tokens, so they never make a refused prompt fit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from avspec.runtime.hf_tokenizer import TOKENIZER_FILE, HFTokenizer
from avspec.runtime.tokenizer import Tokenizer

SHRINKING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
NORMAL_FORM_SHRINK = 4  # most UTF-8 bytes of input per byte of normalized text
MAX_CHAR_BYTES = 4  # longest UTF-8 character
_KEEPING_BEHAVIOURS = frozenset({"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"})


def _byte_level_chars() -> dict[int, str]:
    """The character a byte-level pre-tokenizer maps each byte to (GPT-2's `bytes_to_unicode`,
    the table of `tokenizers.pre_tokenizers.ByteLevel.alphabet()`)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    for shifted, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + shifted)
    return dict(sorted(chars.items()))


BYTE_LEVEL_CHARS = _byte_level_chars()


@dataclass(frozen=True)
class PromptBound:
    """Each token consumes at most `token_bytes` counted bytes of input; the byte values in
    `dropped` cost no token and are not counted (see the module docstring)."""

    token_bytes: int
    dropped: bytes = b""

    def counted_bytes(self, text: bytes) -> int:
        """The bytes of `text` (UTF-8) that count: all but the occurrences of `dropped`.

        One C pass (`bytes.translate` deleting them): 0.4 ms for a megabyte, where a
        `bytes.count` per dropped value took 10 ms for SmolLM2's 21."""
        if not self.dropped:
            return len(text)
        return len(bytes.translate(text, None, self.dropped))

    def byte_limit(self, room_tokens: int) -> int:
        """The most counted bytes a prompt of at most `room_tokens` tokens can have."""
        return prompt_byte_limit(self.token_bytes, room_tokens)


def prompt_bound_of(tokenizer: Tokenizer) -> PromptBound | None:
    """The prompt bound of `tokenizer`, or None when no sound bound follows from its
    `tokenizer.json` (see the module docstring); None for a tokenizer that is not an
    `HFTokenizer` loaded from a directory."""
    if not isinstance(tokenizer, HFTokenizer) or tokenizer.directory is None:
        return None
    spec = json.loads((tokenizer.directory / TOKENIZER_FILE).read_text(encoding="utf-8"))
    return prompt_bound_of_spec(spec)


def prompt_bound_of_spec(spec: Mapping[str, Any]) -> PromptBound | None:
    """`prompt_bound_of` a parsed `tokenizer.json`."""
    byte_level = _pre_tokenizer_byte_level(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    if byte_level is None or model.get("type") != "BPE":
        return None
    vocab = model.get("vocab") or {}
    if not isinstance(vocab, Mapping):
        return None
    longest = max((len(p) if byte_level else len(p.encode()) for p in vocab), default=0)
    for added in spec.get("added_tokens") or ():
        if added.get("lstrip") or added.get("rstrip"):
            return None
        longest = max(longest, len(str(added.get("content", "")).encode()))
    dropped = b""
    unk_per_char = model.get("unk_token") is not None and not model.get("fuse_unk")
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        pass  # every character reaches a token (a missing <0xXX> piece would drop its byte)
    elif byte_level:
        missing = bytes(b for b, char in BYTE_LEVEL_CHARS.items() if char not in vocab)
        if not unk_per_char:  # dropped, or fused into unknown tokens with no counted byte
            dropped = missing
        # else: one unknown token per missing byte, consuming 1 byte <= longest
    elif unk_per_char:
        longest = max(longest, MAX_CHAR_BYTES)  # one unknown token per character
    else:
        return None  # characters it cannot spell are dropped or fused: no bound
    if dropped and not _pre_tokenizer_keeps_counted(spec.get("pre_tokenizer"), dropped):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"), dropped)
    if shrink is None or longest <= 0:
        return None
    return PromptBound(longest * shrink, dropped)


def prompt_byte_limit(token_bytes: int, room_tokens: int) -> int:
    """The most (counted) bytes a prompt of at most `room_tokens` tokens can have."""
    return max(0, room_tokens) * token_bytes


def _counted(text: str, dropped: bytes) -> int:
    return PromptBound(1, dropped).counted_bytes(text.encode())


def _normalizer_shrink(normalizer: Mapping[str, Any] | None, dropped: bytes = b"") -> int | None:
    """Counted input bytes per counted normalized byte, at most: 1, NORMAL_FORM_SHRINK, or None
    (unbounded, or a step that may turn counted bytes into `dropped` ones)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or ():
            inner = _normalizer_shrink(part, dropped)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content", "")
        literal = pattern.get("String")
        if literal is None or _counted(content, dropped) < len(literal.encode()):
            return None
        return 1
    if kind in SHRINKING_NORMALIZERS and not dropped:
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


def _pre_tokenizer_keeps_counted(pre: Mapping[str, Any] | None, dropped: bytes) -> bool:
    """Whether no step of `pre` turns counted bytes into `dropped` ones: only Metaspace maps
    (a space to its replacement), the other steps `_pre_tokenizer_byte_level` accepts split."""
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_pre_tokenizer_keeps_counted(p, dropped) for p in pre.get("pretokenizers") or ())
    if pre.get("type") == "Metaspace":
        return _counted(str(pre.get("replacement", "\u2581")), dropped) > 0
    return True
