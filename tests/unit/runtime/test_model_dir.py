"""`load_model` / `load_tokenizer`: Hugging Face checkpoints load, anything else is refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.hf_dirs import llama_form_config, save_transformer_dir

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.model_dir import ModelDirError, is_hf_dir, load_model, load_tokenizer
from avspec.runtime.transformer import Transformer, init_weights

CONFIG = llama_form_config(num_layers=1, width=16, max_length=32)


@pytest.fixture()
def model_dir(tmp_path):
    model = Transformer(CONFIG)
    init_weights(model, torch.Generator().manual_seed(0))
    return save_transformer_dir(tmp_path / "m", model.eval()), model


def test_save_hf_model_round_trip(model_dir):
    path, model = model_dir
    assert is_hf_dir(path)
    loaded = load_model(path)
    assert loaded.config.vocab_size == CONFIG.vocab_size and not loaded.training
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))
    assert load_model(path, dtype=torch.float16).embed.weight.dtype == torch.float16
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == 257
    assert tokenizer.decode(tokenizer.encode("héllo\n")) == "héllo\n"


def test_load_model_and_tokenizer_of_a_hugging_face_dir(tmp_path):
    pytest.importorskip("transformers")
    from helpers.hf_dirs import save_hf_dir, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    reference = tiny_llama(tok.get_vocab_size(), seed=3)
    path = save_hf_dir(tmp_path / "hf", reference, tok, generation_eos=[1, 7])
    assert is_hf_dir(path)
    loaded = load_model(path, max_length=64)
    assert loaded.config.vocab_size == tok.get_vocab_size() and loaded.config.max_length == 64
    ids = torch.tensor([[0, 5, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_ids == {1, 7}
    assert tokenizer.encode("fox")[0] == 0  # BOS prepended


def test_load_model_and_tokenizer_refuse_other_directories(tmp_path):
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelDirError, match="nowhere does not exist"):
            load(tmp_path / "nowhere")
    other = tmp_path / "other"
    other.mkdir()
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelDirError, match=f"{other}: missing config.json"):
            load(other)
    (other / "config.json").write_text("{not json")
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelDirError, match="not valid JSON"):
            load(other)
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelDirError, match=f"{other}: not a Hugging Face checkpoint"):
            load(other)
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelDirError, match=f"{other}: Hugging Face checkpoint without"):
        load_tokenizer(other)
    with pytest.raises(ValueError, match=str(other)):
        load_model(other)


def test_the_retired_format_is_refused_by_name(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    config = {"format": "avspec-transformer", "version": 1, "model": {}, "tokenizer": "byte"}
    (old / "config.json").write_text(json.dumps(config))
    (old / "model.safetensors").write_bytes(b"")
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelDirError, match=f"{old}: .*retired format.*docs/own_models.md"):
            load(old)
