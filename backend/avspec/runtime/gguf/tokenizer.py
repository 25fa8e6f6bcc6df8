"""A Hugging Face tokenizer (`tokenizer.json`, `tokenizer_config.json`) from a GGUF's metadata.

A GGUF carries its tokenizer as `tokenizer.ggml.*` keys: the model kind (`gpt2` is byte-level
BPE), the token strings in id order, the BPE merges ("a b"), each token's type (3 = control,
i.e. special), the special ids, whether BOS is prepended, and `pre`, llama.cpp's name for the
pre-tokenizer (the regex that splits text before BPE). The tokenizer is rebuilt here with the
`tokenizers` library: the same vocabulary and merges, the pre-tokenizer the `pre` name stands
for, byte-level decoding, control tokens as special added tokens. Only pre-tokenizers whose
split is known exactly are accepted; any other `pre` (and SentencePiece `llama` tokenizers) is
refused by name rather than tokenized differently from llama.cpp.

`tokenizer_config.json` names the special tokens, `add_bos_token` and the GGUF's Jinja chat
template (`tokenizer.chat_template`), so `transformers.AutoTokenizer` renders chats as the
model was trained and `avspec.runtime.hf_tokenizer.HFTokenizer` reads BOS/EOS from it.
"""

from __future__ import annotations

from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from avspec.runtime.gguf.reader import GGUFError, GGUFFile

_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
# llama.cpp's `tokenizer.ggml.pre` -> the pre-tokenizer it stands for (byte-level BPE only).
PRE_TOKENIZERS = {
    "default": lambda: _BYTE_LEVEL,
    "gpt2": lambda: _BYTE_LEVEL,
    # GPT-2's split after isolating every digit (llama.cpp: "\p{N}" first, then GPT-2's regex)
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL]
    ),
}


def _token_id(gguf: GGUFFile, key: str, size: int) -> int | None:
    value = gguf.value(f"tokenizer.ggml.{key}", None)
    if value is None:
        return None
    if not 0 <= int(value) < size:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.{key} {value} is outside the vocabulary")
    return int(value)


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The `tokenizers.Tokenizer` the GGUF's `tokenizer.ggml.*` metadata describes."""
    kind = gguf.value("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{gguf.path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    pre = gguf.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            f"{gguf.path}: pre-tokenizer {pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}"
        )
    tokens = list(gguf.value("tokenizer.ggml.tokens"))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.tokens holds a token twice")
    merges = [tuple(m.split(" ")) for m in gguf.value("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise GGUFError(f"{gguf.path}: a tokenizer.ggml.merges entry is not two tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    types = gguf.value("tokenizer.ggml.token_type", [int(TokenType.NORMAL)] * len(tokens))
    added = [
        AddedToken(tokens[i], special=t == TokenType.CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]
    tokenizer.add_special_tokens([a for a in added if a.special])
    tokenizer.add_tokens([a for a in added if not a.special])
    bos = _token_id(gguf, "bos_token_id", len(tokens))
    if gguf.value("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError(f"{gguf.path}: the rebuilt tokenizer does not have {len(tokens)} tokens")
    return tokenizer


def tokenizer_config(gguf: GGUFFile, model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens, `add_bos_token` and the chat template."""
    tokens = gguf.value("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(gguf.value("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(gguf.value("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    for key, field in special_token_fields().items():
        token = _token_id(gguf, key, len(tokens))
        if token is not None:
            config[field] = tokens[token]
    template = gguf.value("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def special_token_fields() -> dict[str, str]:
    """GGUF `tokenizer.ggml.<key>` -> the Hugging Face tokenizer config field it fills."""
    return {
        "bos_token_id": "bos_token",
        "eos_token_id": "eos_token",
        "unknown_token_id": "unk_token",
        "padding_token_id": "pad_token",
    }
