"""`avspec.serving.host.gguf_models`: a model argument naming a tiny Llama GGUF becomes a converted
directory the runtime loads, converted once (a second call uses the cache); a directory passes
through unchanged; a missing file, a `.gguf` path that is not a regular file, an unreadable file
and a non-Llama GGUF are refused naming the option, the file and the reason."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.gguf_files import TinyLlama, llama_weights, write_llama_gguf

from avspec.runtime.gguf.reader import GGUFError
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.serving.host.gguf_models import model_directory, names_gguf

SHAPE = TinyLlama()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return llama_weights(SHAPE, seed=0)


def test_a_gguf_file_becomes_its_converted_directory_once(tmp_path, weights, capsys) -> None:
    path = write_llama_gguf(tmp_path / "Mine.Q8.GGUF", SHAPE, weights)  # suffix in any case
    cache = tmp_path / "cache"
    directory = model_directory(path, cache, "--target-model")
    assert directory.is_absolute() and directory.parent.parent == cache.resolve()
    assert directory.name == "bfloat16"
    source = json.loads((directory / "gguf_source.json").read_text())
    assert source["architecture"] == "llama" and source["dtype"] == "bfloat16"
    model = load_model(directory)
    assert model.config.num_layers == SHAPE.layers
    expected = weights["model.embed_tokens.weight"].to(torch.bfloat16).float()
    assert torch.equal(model.embed.weight, expected)
    assert load_tokenizer(directory).eos_ids == {2}
    err = capsys.readouterr().err
    assert "avspec: --target-model: converting Mine.Q8.GGUF (bfloat16)" in err

    weights_file = directory / "model.safetensors"
    stamp = weights_file.stat().st_mtime_ns
    os.utime(weights_file, ns=(stamp - 10**9, stamp - 10**9))  # a rewrite would move it
    assert model_directory(path, cache, "--target-model") == directory
    assert weights_file.stat().st_mtime_ns == stamp - 10**9
    err = capsys.readouterr().err
    assert "using the cached conversion" in err and "converting" not in err


def test_a_directory_passes_through_unchanged(tmp_path) -> None:
    directory = tmp_path / "models" / "target"
    directory.mkdir(parents=True)
    assert model_directory(directory, tmp_path / "cache") == directory
    named = tmp_path / "checkout.gguf"  # a directory, whatever its name
    named.mkdir()
    assert model_directory(named, tmp_path / "cache") == named
    assert not names_gguf(named) and names_gguf(tmp_path / "absent.gguf")
    assert not (tmp_path / "cache").exists()


def test_a_missing_gguf_file_is_refused_by_name(tmp_path) -> None:
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(GGUFError, match=r"--draft-model .*nowhere\.gguf: no such GGUF file"):
        model_directory(missing, tmp_path / "cache", "--draft-model")
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match=r"pipe\.gguf: not a regular file"):
        model_directory(fifo, tmp_path / "cache", "--draft-model")
    assert not (tmp_path / "cache").exists()


def test_a_non_llama_gguf_is_refused_naming_its_architecture(tmp_path, weights) -> None:
    path = write_llama_gguf(tmp_path / "qwen.gguf", SHAPE, weights, architecture="qwen2")
    with pytest.raises(GGUFError) as caught:
        model_directory(path, tmp_path / "cache", "--target-model")
    message = str(caught.value)
    assert message.startswith(f"--target-model {path}: ")
    assert "architecture 'qwen2' is not supported" in message
    assert not any((tmp_path / "cache").rglob("config.json"))


def test_an_unreadable_gguf_is_refused_with_the_reason(tmp_path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match=r"broken\.gguf: not a readable GGUF file"):
        model_directory(path, tmp_path / "cache", "--target-model")
