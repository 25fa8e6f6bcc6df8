"""Training corpus: deterministic split with code and prose on both sides, EOS joins, prompts."""

from __future__ import annotations

import pytest

from avspec.runtime.tokenizer import ByteTokenizer
from avspec.tools.train.tiny.corpus import (
    TOPICS_PREFIX,
    corpus_files,
    encode_files,
    heldout_prompts,
    is_held_out,
    split_files,
)


def test_split_is_deterministic_disjoint_and_covers_both_kinds():
    files = corpus_files()
    train, held_out = split_files(files)
    assert (train, held_out) == split_files(corpus_files())
    train_names, held_names = {n for n, _ in train}, {n for n, _ in held_out}
    assert not train_names & held_names
    assert train_names | held_names == {n for n, _ in files}
    assert 0.05 < len(held_out) / len(files) < 0.2
    for part in (train_names, held_names):
        assert any(n.startswith(TOPICS_PREFIX) for n in part)
        assert any(n.endswith(".py") and "/" not in n for n in part)
    assert all(is_held_out(n) for n in held_names)


def test_split_requires_code_and_prose():
    code_only = [(f"m{i}.py", "x = 1\n") for i in range(50)]
    with pytest.raises(ValueError, match="lacks code or prose"):
        split_files(code_only)


def test_encode_files_joins_with_eos():
    ids = encode_files([("a", "hi"), ("b", "é")], ByteTokenizer())
    assert ids.tolist() == [104, 105, 256, 0xC3, 0xA9, 256]


def test_heldout_prompts():
    files = [("m.py", "x = 1\n" * 50), (TOPICS_PREFIX + "t", "Some prose here. " * 20)]
    prompts = heldout_prompts(files, count=4, length=12, prose=True)
    assert prompts.shape == (4, 12)
    assert ByteTokenizer().decode(prompts[0].tolist()) == "Some prose h"
