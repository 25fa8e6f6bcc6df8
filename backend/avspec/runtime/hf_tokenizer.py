"""Tokenizer of a Hugging Face model directory: `tokenizer.json` through the `tokenizers` library.

`HFTokenizer.from_directory(path)` reads:

- `tokenizer.json` (required): the vocabulary, normalizer, pre-tokenizer, model and decoder.
  Truncation and padding stored in it are switched off: a prompt is encoded whole.
- `tokenizer_config.json`, `config.json`, `generation_config.json` (each optional) for the special
  tokens:
  - **EOS** (`eos_ids`): the union of `generation_config.json`'s and `config.json`'s
    `eos_token_id` (one id or a list) and `tokenizer_config.json`'s `eos_token`. Generation stops
    on any of them; a directory that names none is an error.
  - **BOS** (`bos_id`): `tokenizer_config.json`'s `bos_token`, else `config.json`'s or
    `generation_config.json`'s `bos_token_id`, else the token the post-processor prepends.
  - **Whether `encode` prepends BOS** (`add_bos`): `tokenizer_config.json`'s `add_bos_token` when
    it is given, else whatever the `tokenizer.json` post-processor does for a single sequence
    (Llama 3 prepends `<|begin_of_text|>`, Qwen2 and SmolLM2 prepend nothing). Nothing is ever
    appended: a prompt is text to continue, so `add_eos_token` is not applied.

`decode` skips special tokens (BOS, EOS, chat markers) and ids outside the vocabulary, and does not
apply `transformers`' `clean_up_tokenization_spaces`: the text is exactly what the tokens spell.

`HFIncrementalDecoder` streams the same text token by token; see its docstring for the guarantee.
Every problem with a directory raises `TokenizerError` (a `ValueError`) naming the file and field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from avspec.runtime.hf_files import CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE
from avspec.runtime.json_file import read_json_object

TOKENIZER_FILE = "tokenizer.json"

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """A model directory's tokenizer files are missing, malformed or inconsistent."""


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the BOS/EOS settings of its model directory.

    Satisfies `avspec.runtime.tokenizer.Tokenizer`. Build it with `from_directory`.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_ids: Iterable[int],
        bos_id: int | None,
        add_bos: bool,
        directory: Path | None = None,
    ) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        # the same pipeline with special-token text encoded as text (`encode`'s plain spans)
        self._plain = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self.directory = directory
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        tokens: list[str | None] = [None] * self.vocab_size
        for token, token_id in vocab.items():
            tokens[token_id] = token
        self.tokens: tuple[str | None, ...] = tuple(tokens)
        """Token string of every id in 0..vocab_size-1 (None for an id with no token)."""
        self.special_ids: frozenset[int] = frozenset(
            i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        if not self.eos_ids:
            raise TokenizerError(f"{self._where()}: no EOS token")
        for i in sorted(self.eos_ids) + ([] if bos_id is None else [bos_id]):
            if not 0 <= i < self.vocab_size or tokens[i] is None:
                raise TokenizerError(
                    f"{self._where()}: special token id {i} is not in the vocabulary "
                    f"(0..{self.vocab_size - 1})"
                )
        if add_bos and bos_id is None:
            raise TokenizerError(f"{self._where()}: BOS is to be prepended but no BOS token is set")
        self.bos_id = bos_id
        self.add_bos = add_bos
        # Byte-fallback tokens (`<0xE4>`) matter only when the decoder turns them into bytes.
        self.byte_ids: frozenset[int] = frozenset()
        if tokenizer.decoder is not None and b'"ByteFallback"' in tokenizer.decoder.__getstate__():
            self.byte_ids = frozenset(
                i for i, t in enumerate(tokens) if t is not None and _BYTE_TOKEN.fullmatch(t)
            )

    @classmethod
    def from_directory(cls, directory: Path | str) -> HFTokenizer:
        """Load `tokenizer.json` and the BOS/EOS settings of a model directory (see the module)."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{directory}: missing {TOKENIZER_FILE}")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{path}: cannot be loaded by `tokenizers`: {err}") from None
        tok_config = _optional_json(directory / TOKENIZER_CONFIG_FILE)
        config = _optional_json(directory / CONFIG_FILE)
        gen_config = _optional_json(directory / GENERATION_CONFIG_FILE)

        def token_id(file: str, data: dict[str, Any], field: str) -> int | None:
            value = data.get(field)
            if isinstance(value, dict):  # serialised AddedToken: {"content": "<s>", ...}
                value = value.get("content")
            if value is None:
                return None
            if not isinstance(value, str):
                raise TokenizerError(f"{directory / file}: {field} must be a string, got {value!r}")
            found = tokenizer.token_to_id(value)
            if found is None:
                raise TokenizerError(
                    f"{directory / file}: {field} {value!r} is not in {TOKENIZER_FILE}"
                )
            return found

        eos_ids: set[int] = set()
        for file, data in ((GENERATION_CONFIG_FILE, gen_config), (CONFIG_FILE, config)):
            eos_ids.update(_ids(directory / file, data, "eos_token_id"))
        tok_eos = token_id(TOKENIZER_CONFIG_FILE, tok_config, "eos_token")
        if tok_eos is not None:
            eos_ids.add(tok_eos)
        if not eos_ids:
            raise TokenizerError(
                f"{directory}: no EOS token: none of {GENERATION_CONFIG_FILE} and {CONFIG_FILE} "
                f"(eos_token_id) or {TOKENIZER_CONFIG_FILE} (eos_token) sets one"
            )

        bos_id = token_id(TOKENIZER_CONFIG_FILE, tok_config, "bos_token")
        for file, data in ((CONFIG_FILE, config), (GENERATION_CONFIG_FILE, gen_config)):
            if bos_id is None:
                found = _ids(directory / file, data, "bos_token_id")
                bos_id = found[0] if found else None
        prepended = _prepended_token(tokenizer)
        add_bos = tok_config.get("add_bos_token")
        if add_bos is None:
            add_bos = prepended is not None
            if bos_id is None:
                bos_id = prepended
            elif prepended is not None and prepended != bos_id:
                raise TokenizerError(
                    f"{path}: the post-processor prepends token {prepended}, but BOS is {bos_id}"
                )
        elif not isinstance(add_bos, bool):
            raise TokenizerError(
                f"{directory / TOKENIZER_CONFIG_FILE}: add_bos_token must be true or false, "
                f"got {add_bos!r}"
            )
        return cls(tokenizer, eos_ids=eos_ids, bos_id=bos_id, add_bos=add_bos, directory=directory)

    def encode(self, text: str, plain: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of `text`, with BOS first when `add_bos` (no EOS appended).

        Special-token text in `text` (`</s>`) becomes that token, as in `transformers`, except
        inside the `plain` spans: (start, end) character offsets, ascending and disjoint, whose
        text is encoded as text (`<|im_end|>` there is its characters' tokens). A chat prompt
        marks each message's content plain, so only the template places special tokens. Each
        span is encoded apart from its neighbours (a token never crosses a span's edge).
        """
        parts, edge = [], 0
        for start, end in plain:
            parts += [(text[edge:start], self._tokenizer), (text[start:end], self._plain)]
            edge = end
        parts.append((text[edge:], self._tokenizer))
        # encode_batch releases the GIL while it works (encode holds it): a long prompt
        # tokenized on the entry's worker thread must not stall the scheduler thread
        ids = [
            i
            for part, tokenizer in parts
            if part
            for i in tokenizer.encode_batch([part], add_special_tokens=False)[0].ids
        ]
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: special tokens and ids outside 0..vocab_size-1 are skipped; never raises.

        Invalid UTF-8 (an incomplete character at the end, stray byte tokens) becomes U+FFFD.
        """
        return self._decode(self._content_ids(ids))

    def incremental_decoder(self) -> HFIncrementalDecoder:
        """A fresh streaming decoder for one response."""
        return HFIncrementalDecoder(self)

    def token(self, token_id: int) -> str | None:
        """Token string of `token_id` (None outside the vocabulary)."""
        return self.tokens[token_id] if 0 <= token_id < self.vocab_size else None

    def _content_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` without special tokens and out-of-range ids: what `decode` turns into text."""
        size, special = self.vocab_size, self.special_ids
        return [i for i in map(int, ids) if 0 <= i < size and i not in special]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _where(self) -> str:
        return str(self.directory) if self.directory is not None else "tokenizer"

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self._where()}, vocab_size={self.vocab_size}, "
            f"eos_ids={sorted(self.eos_ids)}, bos_id={self.bos_id}, add_bos={self.add_bos})"
        )


class HFIncrementalDecoder:
    """Streaming detokenization: `push` token ids as they are generated, `flush` at the end.

    Same interface as `avspec.runtime.tokenizer.IncrementalDecoder`. Guarantee: the text returned
    so far always equals `decode` of the ids pushed so far whenever that text is settled (no
    continuation can change it: it does not end with U+FFFD, i.e. an incomplete character, and the
    last content token is not a byte-fallback token, whose run of bytes a later byte could still
    turn into U+FFFD); otherwise it is a prefix of it, the rest held back. After `flush` the
    concatenation of all pieces equals `decode` of all the ids, so a piece never ends in a broken
    character nor drops or doubles the space between words. This holds for the decoders
    Llama-family tokenizers use (ByteLevel; Metaspace; Replace/ByteFallback/Fuse/Strip), whose
    text for earlier tokens never depends on later ones except as described.

    Each step decodes a short window of recent tokens (the previously emitted step's tokens as
    context, then the new ones) and emits the window's text past the context's text: the context
    keeps the space of the first new word, which decoding that word alone (Metaspace, `Strip`)
    would drop.

    Not `tokenizers.decoders.DecodeStream` (0.22.2): on a Metaspace tokenizer with byte fallback
    it raises "Invalid prefix encountered while decoding stream" for some id sequences, and
    emits a character a later token changes (both caught by tests/unit/runtime/test_hf_tokenizer.py
    when this class is swapped for it).
    """

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._read = 0  # ids[:read] are emitted; ids[:read] is the context of the next step

    def push(self, ids: Iterable[int]) -> str:
        """Feed token ids; return the newly settled text ("" while it is held back)."""
        new = self._tokenizer._content_ids(ids)
        if not new:
            return ""
        self._ids.extend(new)
        if self._ids[-1] in self._tokenizer.byte_ids:
            return ""
        return self._advance(final=False)

    def flush(self, incomplete: bool = True) -> str:
        """Return whatever is held back and reset: an incomplete character as U+FFFD, or with
        `incomplete` False left out (a text cut by a token limit ends with whole characters)."""
        text = self._advance(final=True) if self._read < len(self._ids) else ""
        self._ids, self._read = [], 0
        return text if incomplete else text.rstrip(_REPLACEMENT)

    def _advance(self, final: bool) -> str:
        context = self._tokenizer._decode(self._ids[: self._read])
        text = self._tokenizer._decode(self._ids)
        if not final and (text.endswith(_REPLACEMENT) or not text.startswith(context)):
            return ""
        # Keep only the just-emitted tokens as the next step's context.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return text[len(context) :]


def _ids(path: Path, data: dict[str, Any], field: str) -> list[int]:
    """`data[field]` as a list of ids: absent or null gives [], one id or a list of ids."""
    value = data.get(field)
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{path}: {field} must be a token id or a list of them, got {value!r}")
    return values


def _prepended_token(tokenizer: tokenizers.Tokenizer) -> int | None:
    """The special token the post-processor puts before a single sequence, if any."""
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain:
        return full[0]
    return None


def _optional_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when the file does not exist (every tokenizer file but
    tokenizer.json is optional)."""
    return read_json_object(path, TokenizerError) or {}
