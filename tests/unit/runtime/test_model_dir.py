"""Model directory save/load round trip and every malformed-directory error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from avspec.runtime.model_dir import ModelDirError, load_model_dir, read_config, save_model_dir
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
