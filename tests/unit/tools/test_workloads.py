"""Prompt sets: deterministic, in the byte range, from held-out files only."""

from __future__ import annotations

import json

import pytest

from avspec.tools.training.corpus import TOPICS_PREFIX, corpus_files, split_files
from avspec.tools.workloads import (
    MAX_BYTES,
    MIN_BYTES,
    build_workloads,
    even_pick,
    fit,
    main,
)

COUNT = 40


@pytest.fixture(scope="module")
def sets():
    return build_workloads(COUNT)


@pytest.fixture(scope="module")
def split():
    return split_files(corpus_files())


def test_sets_are_deterministic_sized_and_distinct(sets):
    assert sets == build_workloads(COUNT)
    assert set(sets) == {"code", "prose", "high_entropy"}
    for name, prompts in sets.items():
        assert len(prompts) == COUNT and len(set(prompts)) == COUNT, name
        for prompt in prompts:
            assert MIN_BYTES <= len(prompt.encode("utf-8")) <= MAX_BYTES, (name, prompt)


def test_prompts_come_from_held_out_files_only(sets, split):
    train, held_out = split
    held_code = [t for n, t in held_out if not n.startswith(TOPICS_PREFIX)]
    held_prose = [" ".join(t.split()) for n, t in held_out if n.startswith(TOPICS_PREFIX)]
    train_text = "\n".join(t for _, t in train)
    for prompt in sets["code"] + sets["high_entropy"]:
        assert any(prompt in text for text in held_code), prompt
    for prompt in sets["prose"]:
        assert any(prompt in text for text in held_prose), prompt
    # long code prompts are specific enough never to occur in the training files
    assert not any(p in train_text for p in sets["code"] if len(p) > 150)


def test_fit_never_splits_a_character():
    text = "é" * 100  # 2 bytes each
    assert fit(text, 65) == "é" * 32
    assert fit("word " * 40, 70, " ").endswith(" ")
    assert fit("x" * 100, 70, "\n") == "x" * 70  # no preferred cut: plain byte limit


def test_even_pick():
    assert even_pick([1, 2, 3], 5) == [1, 2, 3]
    assert even_pick(list(range(10)), 5) == [0, 2, 4, 6, 8]


def test_too_few_prompts_raises():
    with pytest.raises(ValueError, match="only .* prompts, need 100000"):
        build_workloads(100000)


def test_main_writes_jsonl(tmp_path):
    main(["--out", str(tmp_path), "--count", "3"])
    rows = [json.loads(line) for line in (tmp_path / "prose.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["workload"] == "prose" for r in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "code.jsonl",
        "high_entropy.jsonl",
        "prose.jsonl",
    ]
