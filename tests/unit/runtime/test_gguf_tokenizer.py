"""`avspec.runtime.gguf.tokenizer`: the GGUF's tokenizer and chat template in Hugging Face form.

The converted directory's tokenizer (read by the runtime's `HFTokenizer` and by
`transformers.AutoTokenizer`) must encode as `transformers`' own GGUF tokenizer conversion does
(without the BOS that conversion prepends, which the GGUF's `add_bos_token` false forbids), split
digits one by one as the `smollm` pre-tokenizer does, and render chats with the GGUF's template
exactly as `transformers` renders that template.
"""

from __future__ import annotations

import pytest
import torch
from helpers.gguf_files import TinyLlama, llama_weights, write_llama_gguf
from transformers import AutoTokenizer

from avspec.runtime.gguf.convert import convert_gguf
from avspec.runtime.gguf.reader import GGUFError, GGUFFile
from avspec.runtime.gguf.tokenizer import build_tokenizer
from avspec.runtime.hf_tokenizer import HFTokenizer

TEXTS = ["the cap", "Hello the 12345 cat\n\n  in", "<|im_start|>user\nthe cap<|im_end|>\n"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_and_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    shape = TinyLlama()
    path = write_llama_gguf(root / "tiny.gguf", shape, llama_weights(shape, seed=0))
    return path, convert_gguf(path, root / "hf", dtype=torch.float32, progress=False)


def test_encodes_as_transformers_gguf_conversion(gguf_and_dir):
    path, directory = gguf_and_dir
    ours = HFTokenizer.from_directory(directory)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        expected = reference.encode(text)
        if expected and expected[0] == reference.bos_token_id:
            expected = expected[1:]
        assert ours.encode(text) == expected, text
        assert ours.decode(ours.encode(text)) == text.replace("<|im_start|>", "").replace(
            "<|im_end|>", ""
        )


def test_digits_are_split_one_by_one(gguf_and_dir):
    _, directory = gguf_and_dir
    ours = HFTokenizer.from_directory(directory)
    assert [ours.token(i) for i in ours.encode("12345")] == list("12345")


def test_special_tokens_and_no_bos(gguf_and_dir):
    _, directory = gguf_and_dir
    ours = HFTokenizer.from_directory(directory)
    assert ours.eos_ids == {2} and ours.bos_id == 1 and not ours.add_bos
    assert ours.encode("<|im_end|>") == [2]


def test_chat_template_renders_as_transformers(gguf_and_dir):
    path, directory = gguf_and_dir
    ours = AutoTokenizer.from_pretrained(str(directory))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for prompt in (True, False):
        text = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
        assert text == reference.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=prompt
        )
    assert text.startswith("<|im_start|>user\nWhat is the capital")


def test_unknown_pre_tokenizer_is_refused(tmp_path, monkeypatch):
    shape = TinyLlama()
    path = write_llama_gguf(tmp_path / "t.gguf", shape, llama_weights(shape, seed=0))
    gguf = GGUFFile(path)
    real = gguf.value
    monkeypatch.setattr(
        gguf, "value", lambda key, *d: "qwen2" if key == "tokenizer.ggml.pre" else real(key, *d)
    )
    with pytest.raises(GGUFError, match="pre-tokenizer 'qwen2' is not supported"):
        build_tokenizer(gguf)
