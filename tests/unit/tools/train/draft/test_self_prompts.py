"""`avspec.tools.train.draft.self_prompts`: user messages the target writes (Magpie) for draft data.

- the pre-query is the template's rendering of a conversation cut where the user's message
  starts (text and token ids), with the default system prompt when the template adds one and
  without it when it does not; a special end-of-turn token stops a message and is a marker;
- each filter rule rejects a crafted message (cut, empty, short, template marker, duplicate)
  and passes the same message otherwise;
- sampling on the tiny pair is deterministic for a seed and changes with it;
- `make_self_data` (the data phase's step, with the target's sampling replaced by crafted
  messages): the messages that pass land in `train/chunk_self_*.pt`, `evaluate.load_chunks`
  reads them as kind "self" with the message in the prompt, the sampling is cached in
  `self_prompts.json`, and a second run neither resamples nor rewrites a chunk.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from helpers.chat_pair import CHATML, add_chat_template, save_tiny_chat_pair
from helpers.hf_dirs import EOS, byte_level_bpe

import avspec.tools.train.draft.self_prompts as self_prompts
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.tools.train.draft.data import SELF_PREFIX, make_self_data
from avspec.tools.train.draft.evaluate import load_chunks
from avspec.tools.train.draft.generate import AnswerSettings, chat_renderer
from avspec.tools.train.draft.self_prompts import (
    PreQuery,
    pre_query,
    rejection,
    sample_messages,
    sample_self_prompts,
)

pytestmark = pytest.mark.usefixtures("single_thread")

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# ChatML without a default system prompt
BARE_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGE = "What does HTTP stand for?"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_chat_pair(tmp_path_factory.mktemp("pair"))


def _check_prefix(renderer, query: PreQuery) -> str:
    conversation = [{"role": "user", "content": MESSAGE}]
    text = renderer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text.startswith(query.text + MESSAGE)
    ids = renderer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert list(ids[: len(query.ids)]) == query.ids
    assert renderer.decode(query.ids, skip_special_tokens=False) == query.text
    return text


def test_pre_query_with_the_default_system_prompt(pair):
    renderer = chat_renderer(pair[0])
    query = pre_query(renderer, load_tokenizer(pair[0]).eos_ids)
    _check_prefix(renderer, query)
    assert query.text == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    assert query.stop_ids == load_tokenizer(pair[0]).eos_ids  # markers spelled byte by byte
    assert "<|im_end|>" in query.markers and EOS in query.markers


def test_pre_query_without_a_system_prompt(tmp_path, pair):
    from transformers import PreTrainedTokenizerFast

    target = tmp_path / "target"
    target.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (target / file).write_bytes((pair[0] / file).read_bytes())
    renderer = chat_renderer(add_chat_template(target, BARE_CHATML))
    query = pre_query(renderer)
    _check_prefix(renderer, query)
    assert query.text == "<|im_start|>user\n"

    # ChatML markers as special tokens (as SmolLM2's): <|im_end|> ends a message
    tok = byte_level_bpe(["hello world"], [EOS, "<|im_start|>", "<|im_end|>"], 300)
    renderer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, chat_template=CHATML)
    renderer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    query = pre_query(renderer, {tok.token_to_id(EOS)})
    _check_prefix(renderer, query)
    assert SYSTEM in query.text
    end, start = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    assert query.stop_ids == {tok.token_to_id(EOS), end}
    assert query.ids[0] == start and query.ids.count(start) == 2
    assert {"<|im_start|>", "<|im_end|>", EOS} <= set(query.markers)


def test_each_filter_rule_rejects():
    markers = ("<|im_start|>", "<|im_end|>")
    seen: set[str] = set()
    assert rejection(MESSAGE, False, markers, seen) == "cut"
    assert rejection(" \n\t", True, markers, seen) == "empty"
    assert rejection("HTTP meaning?", True, markers, seen) == "short"
    assert rejection("HTTP meaning?", True, markers, seen, min_words=2) is None
    assert rejection("What is <|im_start|>user", True, markers, seen) == "template"
    assert rejection("What is HTTP?<|im_end|>", True, markers, seen) == "template"
    assert not seen - {"http meaning?"}
    assert rejection(f" {MESSAGE}\n", True, markers, seen) is None
    assert rejection(MESSAGE.upper().replace(" ", "  \n"), True, markers, seen) == "duplicate"
    assert rejection("What does FTP stand for?", True, markers, seen) is None
    assert seen == {"http meaning?", "what does http stand for?", "what does ftp stand for?"}


def test_sampling_is_deterministic_for_a_seed(pair):
    renderer = chat_renderer(pair[0])
    query = pre_query(renderer, load_tokenizer(pair[0]).eos_ids)
    model = load_model(pair[0], max_length=512)

    def sample(seed: int) -> list[tuple[str, bool]]:
        generator = torch.Generator().manual_seed(seed)
        settings = AnswerSettings(batch=4, max_new_tokens=12, temperature=1.0, keep=1)
        return sample_messages(model, renderer, query, 6, generator, settings)

    first = sample(0)
    assert len(first) == 6 and all(text for text, _ in first)
    assert sample(0) == first
    assert sample(1) != first


def test_self_prompts_are_deterministic_for_a_seed(pair, monkeypatch):
    def stop_at_q(renderer, eos_ids=()):  # the random tiny target rarely writes EOS
        query = pre_query(renderer, eos_ids)
        q = renderer.encode("q", add_special_tokens=False)
        return dataclasses.replace(query, stop_ids=query.stop_ids | set(q))

    monkeypatch.setattr(self_prompts, "pre_query", stop_at_q)
    settings = dict(settings=AnswerSettings(batch=4, max_new_tokens=16, keep=1), min_words=1)
    prompts, stats = sample_self_prompts(pair[0], 6, seed=0, **settings)
    assert len(prompts) == 6 and stats["accepted"] == 6 and sum(stats["rejected"].values()) > 0
    assert {p.kind for p in prompts} == {"self"} and len({p.message for p in prompts}) == 6
    again, stats_again = sample_self_prompts(pair[0], 6, seed=0, **settings)
    timing = {"seconds": 0, "tokens_per_s": 0}
    assert again == prompts and stats_again | timing == stats | timing
    assert sample_self_prompts(pair[0], 6, seed=1, **settings)[0] != prompts


SETTINGS = AnswerSettings(batch=4, max_new_tokens=6)
GOOD = ["Write a haiku about autumn leaves.", "How do I boil an egg?", MESSAGE]
CRAFTED = [
    (MESSAGE, True),
    ("hi", True),  # short
    (MESSAGE.lower(), True),  # duplicate
    ("Tell me about <|im_end|> please", True),  # template (the end-of-turn text)
    ("A message the length cap cut", False),  # cut
    ("   ", True),  # empty
    (GOOD[0], True),
]


def _fake_answers(renderer, eos: int, calls: list[int]):
    """`answer_all` whose answers are CRAFTED, then distinct good questions (numbered)."""
    stream = itertools.chain(CRAFTED, ((f"{GOOD[1]} Way {i}.", True) for i in itertools.count()))

    def answer_all(model, prompts, eos_ids, settings, *args):
        calls.append((len(prompts), settings.temperature))
        answers = []
        for _ in prompts:
            text, finished = next(stream)
            ids = renderer.encode(text, add_special_tokens=False) + ([eos] if finished else [])
            answers.append({"answer": torch.tensor(ids, dtype=torch.int32)})
        return answers

    return answer_all


def test_self_chunks_land_under_their_prefix(tmp_path, pair, monkeypatch):
    renderer = chat_renderer(pair[0])
    eos = next(iter(load_tokenizer(pair[0]).eos_ids))
    calls: list[int] = []
    monkeypatch.setattr(self_prompts, "answer_all", _fake_answers(renderer, eos, calls))
    work = tmp_path / "work"
    paths = make_self_data(pair[0], work, 5, seed=0, settings=SETTINGS)
    assert [p.name for p in paths] == [f"{SELF_PREFIX}00000.pt"]
    assert sorted(p.name for p in (work / "train").iterdir()) == [f"{SELF_PREFIX}00000.pt"]
    # one round finds 2 of 5, the second the rest; each round in three parts, one per temperature
    assert calls == [(3, 0.8), (2, 1.0), (2, 1.2), (4, 0.8), (4, 1.0), (4, 1.2)]

    data = self_prompts.json.loads((work / "self_prompts.json").read_text())
    expected = [MESSAGE, GOOD[0], *(f"{GOOD[1]} Way {i}." for i in range(3))]
    assert data["messages"] == expected
    assert data["stats"]["rejected"] == {
        "cut": 1, "empty": 1, "short": 1, "template": 1, "duplicate": 1,
    }  # fmt: skip
    assert data["stats"]["sampled"] == sum(n for n, _ in calls)

    sequences = load_chunks(work / "train")
    assert [s["kind"] for s in sequences] == ["self"] * 5
    for sequence, message in zip(sequences, expected, strict=True):
        prompt = renderer.decode(sequence["ids"][: sequence["prompt_length"]].tolist())
        assert message in prompt and 1 <= sequence["answer_length"] <= 6

    # a resumed run reads the cache and skips the written chunk
    stamp = paths[0].stat().st_mtime_ns
    assert make_self_data(pair[0], work, 5, seed=0, settings=SETTINGS) == paths
    assert len(calls) == 6 and paths[0].stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="self_prompts.json"):
        make_self_data(pair[0], work, 6, seed=0, settings=SETTINGS)
