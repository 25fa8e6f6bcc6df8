"""Model directory save/load round trip and every malformed-directory error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.model_dir import (
    ModelDirError,
    is_hf_dir,
    load_model,
    load_model_dir,
    load_tokenizer,
    read_config,
    save_model_dir,
)
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights

CONFIG = TransformerConfig(num_layers=1, width=16, num_heads=2, max_length=32)


@pytest.fixture()
def model_dir(tmp_path):
    model = Transformer(CONFIG)
    init_weights(model, torch.Generator().manual_seed(0))
    save_model_dir(tmp_path / "m", model, ByteTokenizer())
    return tmp_path / "m", model


def edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


def test_round_trip(model_dir):
    path, model = model_dir
    loaded, tokenizer = load_model_dir(path)
    assert isinstance(tokenizer, ByteTokenizer) and loaded.config == CONFIG
    assert not loaded.training
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))
    data = json.loads((path / "config.json").read_text())
    assert data == {"format": "avspec-transformer", "version": 1, "model": CONFIG.to_dict(),
                    "tokenizer": "byte"}  # fmt: skip


def test_missing_directory_and_files(model_dir, tmp_path):
    path, _ = model_dir
    with pytest.raises(ModelDirError, match="does not exist"):
        load_model_dir(tmp_path / "nowhere")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="missing model.safetensors"):
        load_model_dir(path)
    (path / "config.json").unlink()
    with pytest.raises(ModelDirError, match="missing config.json"):
        load_model_dir(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "gguf"}, "format must be 'avspec-transformer'"),
        ({"version": 2}, "version must be 1"),
        ({"tokenizer": "bpe"}, "tokenizer must be 'byte'"),
        ({"model": {"num_layers": 1}}, "bad model config"),
        ({"model": {**CONFIG.to_dict(), "vocab_size": 300}}, "vocab_size 300"),
    ],
)
def test_bad_config(model_dir, changes, message):
    path, _ = model_dir
    edit_config(path, **changes)
    with pytest.raises(ModelDirError, match=message):
        load_model_dir(path)


def test_unparsable_config(model_dir):
    path, _ = model_dir
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="not valid JSON"):
        read_config(path)
    (path / "config.json").write_text("[1]")
    with pytest.raises(ModelDirError, match="JSON object"):
        read_config(path)


def test_shape_mismatch(model_dir):
    path, _ = model_dir
    edit_config(path, model={**CONFIG.to_dict(), "width": 32, "num_heads": 4})
    with pytest.raises(ModelDirError, match=r"embed.weight has shape \(257, 16\).*\(257, 32\)"):
        load_model_dir(path)


def test_missing_extra_and_wrong_dtype_tensors(model_dir):
    path, _ = model_dir
    weights_path = path / "model.safetensors"
    weights = load_file(str(weights_path))
    save_file({k: v for k, v in weights.items() if k != "final_norm.weight"}, str(weights_path))
    with pytest.raises(ModelDirError, match=r"missing tensors \['final_norm.weight'\]"):
        load_model_dir(path)
    save_file({**weights, "lm_head.weight": weights["embed.weight"].clone()}, str(weights_path))
    with pytest.raises(ModelDirError, match=r"unexpected tensors \['lm_head.weight'\]"):
        load_model_dir(path)
    save_file({**weights, "embed.weight": weights["embed.weight"].half()}, str(weights_path))
    with pytest.raises(ModelDirError, match="float16, expected float32"):
        load_model_dir(path)
    weights_path.write_bytes(b"garbage")
    with pytest.raises(ModelDirError, match="unreadable safetensors"):
        load_model_dir(path)


# --- load_model / load_tokenizer: either directory format ---


def test_load_model_and_tokenizer_of_our_format(model_dir):
    path, model = model_dir
    loaded = load_model(path)
    assert loaded.config == CONFIG and not loaded.training
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))
    assert isinstance(load_tokenizer(path), ByteTokenizer)
    assert not is_hf_dir(path)


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


def test_load_model_and_tokenizer_refuse_other_directories(tmp_path, model_dir):
    for load in (load_model, load_tokenizer):
        with pytest.raises(ValueError, match="nowhere"):
            load(tmp_path / "nowhere")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelDirError, match=f"{other}: neither a Hugging Face checkpoint"):
            load(other)
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelDirError, match=f"{other}: Hugging Face checkpoint without"):
        load_tokenizer(other)
    with pytest.raises(ValueError, match=str(other)):
        load_model(other)
