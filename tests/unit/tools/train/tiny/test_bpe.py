"""BPE tokenizer of the default pair: exact round trips, vocabulary size, stable EOS, its files."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.tools.train.tiny.bpe import (
    EOS_ID,
    EOS_TOKEN,
    encode_texts,
    save_tokenizer,
    special_ids,
    train_bpe,
    train_split_tokenizer,
)
from avspec.tools.train.tiny.corpus import corpus_files, split_files

VOCAB = 4096


@pytest.fixture(scope="module")
def split() -> tuple[list, list]:
    return split_files(corpus_files())


@pytest.fixture(scope="module")
def tokenizer(split):
    return train_split_tokenizer(split[0], VOCAB)


def round_trips(tokenizer, texts: list[str]) -> list[str]:
    """The texts whose encode-then-decode differs from the text."""
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    decoded = tokenizer.decode_batch([e.ids for e in encodings], skip_special_tokens=False)
    return [text for text, back in zip(texts, decoded, strict=True) if text != back]


def test_every_held_out_file_and_line_round_trips(tokenizer, split):
    held_out = [text for _, text in split[1]]
    lines = [line for text in held_out for line in text.splitlines(keepends=True)]
    assert len(lines) > 1000
    assert round_trips(tokenizer, held_out) == []
    assert round_trips(tokenizer, lines) == []


def test_random_bytes_and_unusual_text_round_trip(tokenizer):
    rng = random.Random(0)
    texts = [
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).decode(
            "utf-8", errors="replace"
        )
        for _ in range(300)
    ]
    texts += ["", " ", "\x00\t\r\n", "naïve café — 日本語 🐍🏳️‍🌈", "  leading", "trailing  \n\n"]
    texts += [chr(c) for c in range(0x20000, 0x20100)]  # CJK extension B: 4-byte UTF-8
    assert round_trips(tokenizer, texts) == []
    encoding = tokenizer.encode("🐍 \x00", add_special_tokens=False)
    assert EOS_ID not in encoding.ids  # no piece falls back to a special or unknown token


def test_vocabulary_size_is_as_asked_and_eos_is_stable(tokenizer, split):
    assert tokenizer.get_vocab_size() == VOCAB
    assert special_ids(tokenizer) == {"bos_token_id": 0, "eos_token_id": 0, "vocab_size": VOCAB}
    small = train_bpe([text[:2000] for _, text in split[0][:40]], 1024)
    assert small.get_vocab_size() == 1024
    assert small.token_to_id(EOS_TOKEN) == EOS_ID == tokenizer.token_to_id(EOS_TOKEN)
    # the text is the only source of the pieces: the same text gives the same tokenizer
    assert train_split_tokenizer(split[0], VOCAB).to_str() == tokenizer.to_str()


def test_too_small_a_text_or_vocabulary_is_refused():
    with pytest.raises(ValueError, match="allows only"):
        train_bpe(["abc abc"], 2048)
    with pytest.raises(ValueError, match="below the 256 bytes"):
        train_bpe(["abc"], 100)


def test_encode_texts_joins_files_with_eos(tokenizer):
    ids = encode_texts(tokenizer, [("a.py", "import os\n"), ("b", "The end.")])
    eos = [i for i, token in enumerate(ids.tolist()) if token == EOS_ID]
    assert eos == [eos[0], len(ids) - 1] and 0 < eos[0] < len(ids) - 2
    assert tokenizer.decode(ids[: eos[0]].tolist()) == "import os\n"


def test_saved_files_load_in_the_runtime_and_in_transformers(tokenizer, tmp_path):
    directory = save_tokenizer(tokenizer, tmp_path / "tok", max_length=512)
    ours = HFTokenizer.from_directory(directory)
    theirs = AutoTokenizer.from_pretrained(directory)
    text = "def parse_args(argv):\n    return argv[1:]  # naïve 🐍\n"
    assert ours.eos_ids == {EOS_ID} and ours.bos_id == EOS_ID and not ours.add_bos
    assert ours.vocab_size == VOCAB
    assert ours.encode(text) == theirs.encode(text) == tokenizer.encode(text).ids
    assert ours.decode(ours.encode(text)) == text
    assert theirs.eos_token_id == EOS_ID and theirs.model_max_length == 512
