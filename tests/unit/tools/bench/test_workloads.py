"""Prompt sets: deterministic, in the byte range, from held-out files only; the chat set in
the given directory's chat template."""

from __future__ import annotations

import json

import pytest

from avspec.tools.bench.workloads import (
    CHAT_CANDIDATES,
    CHAT_SEED,
    build_workloads,
    chat_prompts,
    main,
)
from avspec.tools.train.prefixes import MAX_BYTES, MIN_BYTES, even_pick, fit
from avspec.tools.train.tiny.corpus import TOPICS_PREFIX, corpus_files, split_files

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


CHAT_COUNT = 12


@pytest.fixture(scope="module")
def template_dir(tmp_path_factory):
    """A tokenizer directory with SmolLM2's ChatML template (no weights needed to render)."""
    from helpers.chat_pair import add_chat_template
    from helpers.hf_dirs import BOS, EOS, tiny_tokenizer

    directory = tmp_path_factory.mktemp("template")
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return add_chat_template(directory)


@pytest.fixture(scope="module")
def chat(template_dir, split):
    from avspec.tools.train.draft.generate import chat_renderer

    return chat_prompts(split[1], CHAT_COUNT, chat_renderer(template_dir))


def test_chat_prompts_are_rendered_distinct_and_deterministic(chat, template_dir, split):
    from avspec.tools.train.draft.generate import chat_renderer
    from avspec.tools.train.draft.prompts import KINDS

    assert chat == chat_prompts(split[1], CHAT_COUNT, chat_renderer(template_dir))
    assert [row["kind"] for row in chat] == [KINDS[i % len(KINDS)] for i in range(CHAT_COUNT)]
    messages = [row["messages"][0]["content"] for row in chat]
    assert len(set(messages)) == CHAT_COUNT
    for row, message in zip(chat, messages, strict=True):
        assert row["messages"] == [{"role": "user", "content": message}]
        assert row["prompt"] == (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            f"Face<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
        )


def test_chat_prompts_come_from_held_out_files_only(split):
    from avspec.tools.train.draft.prompts import build_prompts

    train, held_out = split
    held_names = {name for name, _ in held_out}
    candidates = build_prompts(held_out, CHAT_CANDIDATES * CHAT_COUNT, CHAT_SEED)
    assert {c.source for c in candidates} <= held_names
    assert not {c.source for c in candidates} & {name for name, _ in train}


def test_main_writes_the_chat_set_only_with_a_template(tmp_path, template_dir):
    main(["--out", str(tmp_path / "plain"), "--count", "3"])
    assert not (tmp_path / "plain" / "chat.jsonl").exists()
    out = tmp_path / "chat"
    main(["--out", str(out), "--count", "3", "--chat-template-from", str(template_dir),
          "--chat-count", "7"])  # fmt: skip
    rows = [json.loads(line) for line in (out / "chat.jsonl").read_text().splitlines()]
    assert len(rows) == 7
    for row in rows:
        assert list(row) == ["prompt", "workload", "kind", "messages"]
        assert row["workload"] == "chat" and row["prompt"].endswith("<|im_start|>assistant\n")
        assert row["messages"][0]["content"] in row["prompt"]
    code = [json.loads(line) for line in (out / "code.jsonl").read_text().splitlines()]
    assert list(code[0]) == ["prompt", "workload"]
