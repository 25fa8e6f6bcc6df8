"""`python -m avspec.tools.setup.fetch_target --gguf FILE --out DIR`: a user's Llama GGUF becomes a
model directory the runtime serves; a second run finds it up to date; a non-Llama file exits
with status 1 naming its architecture."""

from __future__ import annotations

import torch
from helpers.gguf_files import TinyLlama, llama_weights, write_llama_gguf

from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.tools.setup.fetch_target import main


def test_user_gguf_to_model_dir(tmp_path, capsys):
    shape = TinyLlama()
    path = write_llama_gguf(tmp_path / "mine.gguf", shape, llama_weights(shape, seed=0))
    args = ["--gguf", str(path), "--out", str(tmp_path / "model"), "--cache", str(tmp_path / "c")]
    assert main(args) == 0
    model = load_model(tmp_path / "model")
    assert model.embed.weight.dtype == torch.float32 and model.config.num_layers == 2
    assert load_tokenizer(tmp_path / "model").eos_ids == {2}
    assert main(args) == 0
    assert "is up to date" in capsys.readouterr().err


def test_non_llama_gguf_exits_1(tmp_path, capsys):
    shape = TinyLlama()
    weights = llama_weights(shape, seed=0)
    path = write_llama_gguf(tmp_path / "q.gguf", shape, weights, architecture="qwen2")
    args = ["--gguf", str(path), "--out", str(tmp_path / "model"), "--cache", str(tmp_path / "c")]
    assert main(args) == 1
    assert "architecture 'qwen2' is not supported" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()
