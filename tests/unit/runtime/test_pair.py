"""Pair check: same vocabulary and EOS, padded embedding rows allowed, one clear message if not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.hf_dirs import byte_level_bpe
from tokenizers import AddedToken, Tokenizer

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.pair import PairError, PairInfo, check_pair

CORPUS = [
    "Speculative decoding drafts tokens with a small model and verifies them with a large one. ",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Un café à Genève, 中文文本, and an emoji 🚀. ",
] * 10
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|reserved_0|>"]


def _train() -> dict:
    """tokenizer.json of a small byte-level BPE (Qwen2 / Llama 3 style), as a JSON dict."""
    return json.loads(byte_level_bpe(CORPUS, SPECIALS, 400).to_str())


@pytest.fixture(scope="module")
def tokenizer_json() -> dict:
    return _train()


def _model_dir(path: Path, tokenizer_json: dict, eos: list[str] | None = None) -> Path:
    """A model directory with this tokenizer and EOS ids [<|endoftext|>, <|im_end|>] by default."""
    path.mkdir(parents=True)
    tok = Tokenizer.from_str(json.dumps(tokenizer_json))
    tok.save(str(path / "tokenizer.json"))
    eos_ids = [tok.token_to_id(t) for t in eos or ["<|endoftext|>", "<|im_end|>"]]
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return path


def _renamed(tokenizer_json: dict, old: str, new: str) -> dict:
    """The same tokenizer with the special token `old` spelled `new` (same id)."""
    data = json.loads(json.dumps(tokenizer_json))
    for added in data["added_tokens"]:
        if added["content"] == old:
            added["content"] = new
    vocab = data["model"]["vocab"]
    vocab[new] = vocab.pop(old)
    return data


def _check(draft: Path, target: Path, draft_rows: int, target_rows: int) -> PairInfo:
    return check_pair(
        draft,
        target,
        HFTokenizer.from_directory(draft),
        HFTokenizer.from_directory(target),
        draft_rows,
        target_rows,
    )


def test_same_tokenizer_with_padded_embedding_rows_passes(tmp_path, tokenizer_json):
    draft = _model_dir(tmp_path / "draft", tokenizer_json)
    target = _model_dir(tmp_path / "target", tokenizer_json)
    size = HFTokenizer.from_directory(draft).vocab_size
    # Like Qwen2.5: 0.5B pads to 151936 rows, 7B to 152064, for 151665 tokens.
    info = _check(draft, target, size + 7, size + 135)
    ids = {t: i for i, t in enumerate(SPECIALS)}
    assert info == PairInfo(
        num_tokens=size,
        eos_ids=frozenset({ids["<|endoftext|>"], ids["<|im_end|>"]}),
        draft_vocab_rows=size + 7,
        target_vocab_rows=size + 135,
    )
    assert info.padded
    assert not _check(draft, target, size, size).padded


def test_one_differing_token_names_both_dirs_and_the_token(tmp_path, tokenizer_json):
    draft = _model_dir(tmp_path / "draft", tokenizer_json)
    target = _model_dir(
        tmp_path / "target", _renamed(tokenizer_json, "<|reserved_0|>", "<|reserved_9|>")
    )
    size = HFTokenizer.from_directory(draft).vocab_size
    with pytest.raises(PairError) as err:
        _check(draft, target, size, size)
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        f"draft {draft} and target {target} do not share a vocabulary: token id "
        f"{SPECIALS.index('<|reserved_0|>')} is '<|reserved_0|>' in the draft and "
        f"'<|reserved_9|>' in the target (tokenizer sizes {size} and {size})"
    )
    assert isinstance(err.value, ValueError)


def test_extra_token_in_one_tokenizer_fails(tmp_path, tokenizer_json):
    draft = _model_dir(tmp_path / "draft", tokenizer_json)
    extended = Tokenizer.from_str(json.dumps(tokenizer_json))
    extended.add_tokens([AddedToken("<tool_call>", special=False)])
    target = _model_dir(tmp_path / "target", json.loads(extended.to_str()))
    size = HFTokenizer.from_directory(draft).vocab_size
    pattern = (
        f"draft {draft} and target {target} do not share a vocabulary: token id {size} is "
        f"absent in the draft and '<tool_call>' in the target"
    )
    with pytest.raises(PairError, match=re.escape(pattern)):
        _check(draft, target, size + 10, size + 10)


def test_different_eos_fails(tmp_path, tokenizer_json):
    draft = _model_dir(tmp_path / "draft", tokenizer_json)
    target = _model_dir(tmp_path / "target", tokenizer_json, eos=["<|im_end|>"])
    size = HFTokenizer.from_directory(draft).vocab_size
    eos = [SPECIALS.index("<|endoftext|>"), SPECIALS.index("<|im_end|>")]
    pattern = (
        f"draft {draft} and target {target} do not stop on the same EOS ids: {eos} in the "
        f"draft, {eos[1:]} in the target"
    )
    with pytest.raises(PairError, match=re.escape(pattern)):
        _check(draft, target, size, size)


def test_fewer_embedding_rows_than_tokens_fails(tmp_path, tokenizer_json):
    draft = _model_dir(tmp_path / "draft", tokenizer_json)
    target = _model_dir(tmp_path / "target", tokenizer_json)
    size = HFTokenizer.from_directory(draft).vocab_size
    pattern = f"the target {target} has {size - 1} embedding rows but its tokenizer has {size}"
    with pytest.raises(PairError, match=re.escape(pattern)):
        _check(draft, target, size, size - 1)
