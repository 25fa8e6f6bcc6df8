"""`avspec.runtime.gguf.convert`: a tiny Llama GGUF converted and served by the runtime.

The files are written as llama.cpp writes them (`helpers.gguf_files`: its tensor names, its
q/k row permutation). The reference is `transformers` reading the same file with its own GGUF
loader (`avspec.tools.setup.gguf_reference`): the runtime's logits on the converted float32
directory must equal its logits within MAX_DIFF, for float weights and for a mix of quantized
types. The deliberately broken converter, which leaves the q/k permutation in place, must be
caught by the same comparison. Also: the weights come back exactly in Hugging Face order, a
non-Llama architecture is refused by name, and conversions are cached by the file's hash.
"""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers.gguf_files import TinyLlama, llama_weights, write_llama_gguf
from safetensors.torch import load_file

from avspec.runtime.gguf import convert
from avspec.runtime.gguf.convert import cached_conversion, convert_gguf
from avspec.runtime.gguf.reader import GGUFError
from avspec.runtime.hf_checkpoint import load_hf_model
from avspec.tools.setup.gguf_reference import transformers_gguf_model

MAX_DIFF = 1e-4
SHAPE = TinyLlama()
IDS = torch.tensor([[3, 40, 77, 120, 200, 5, 9, 150, 33, 260, 17, 64, 1, 2, 99, 180]])


def _runtime_logits(directory) -> torch.Tensor:
    model, _ = load_hf_model(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(IDS)


def _reference_logits(path) -> torch.Tensor:
    with torch.no_grad():
        return transformers_gguf_model(path)(IDS).logits


@pytest.fixture(scope="module")
def float_gguf(tmp_path_factory):
    weights = llama_weights(SHAPE, seed=0)
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", SHAPE, weights)
    return path, weights


def test_weights_come_back_in_hugging_face_order(float_gguf, tmp_path):
    path, weights = float_gguf
    out = convert_gguf(path, tmp_path / "hf", dtype=torch.float32, progress=False)
    converted = load_file(out / "model.safetensors")
    assert set(converted) == set(weights)
    for name, value in weights.items():
        assert torch.equal(converted[name], value), name


def test_logits_match_transformers(float_gguf, tmp_path):
    path, _ = float_gguf
    out = convert_gguf(path, tmp_path / "hf", dtype=torch.float32, progress=False)
    ours, reference = _runtime_logits(out), _reference_logits(path)
    assert (ours - reference).abs().max() <= MAX_DIFF
    assert reference.std() > 1.0  # peaked logits: a wrong model could not hide in noise


def test_broken_converter_without_unpermute_is_caught(float_gguf, tmp_path, monkeypatch):
    path, _ = float_gguf
    monkeypatch.setattr(convert, "unpermute_rotary_rows", lambda weight, heads: weight)
    out = convert_gguf(path, tmp_path / "broken", dtype=torch.float32, progress=False)
    diff = (_runtime_logits(out) - _reference_logits(path)).abs().max()
    assert diff > 100 * MAX_DIFF


def test_quantized_types_match_transformers(tmp_path):
    weights = llama_weights(SHAPE, seed=1)
    types = {
        "model.embed_tokens.weight": Q.Q8_0,
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_0,
        "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
        "model.layers.0.self_attn.v_proj.weight": Q.F16,
        "model.layers.0.self_attn.o_proj.weight": Q.BF16,
        "model.layers.0.mlp.down_proj.weight": Q.Q4_K,
        "model.layers.1.mlp.down_proj.weight": Q.Q6_K,
        "model.layers.1.self_attn.q_proj.weight": Q.Q8_0,
        "model.layers.1.self_attn.k_proj.weight": Q.Q4_1,
    }
    path = write_llama_gguf(tmp_path / "q.gguf", SHAPE, weights, types)
    out = convert_gguf(path, tmp_path / "hf", dtype=torch.float32, progress=False)
    source = json.loads((out / "gguf_source.json").read_text())
    assert {"Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "Q4_K", "Q6_K", "F32"} <= set(
        source["tensor_types"]
    )
    diff = (_runtime_logits(out) - _reference_logits(path)).abs().max()
    assert diff <= MAX_DIFF


def test_bf16_directory_is_close(float_gguf, tmp_path):
    path, _ = float_gguf
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    ours, reference = _runtime_logits(out), _reference_logits(path)
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree >= 0.9


def test_untied_output_is_kept(tmp_path):
    shape = TinyLlama(tied=False)
    weights = llama_weights(shape, seed=2)
    path = write_llama_gguf(tmp_path / "untied.gguf", shape, weights)
    out = convert_gguf(path, tmp_path / "hf", dtype=torch.float32, progress=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert (_runtime_logits(out) - _reference_logits(path)).abs().max() <= MAX_DIFF


def test_non_llama_architecture_is_refused_by_name(tmp_path):
    weights = llama_weights(SHAPE, seed=0)
    path = write_llama_gguf(tmp_path / "q.gguf", SHAPE, weights, architecture="qwen2")
    with pytest.raises(GGUFError, match="architecture 'qwen2' is not supported"):
        convert_gguf(path, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


def test_conversion_is_cached_by_hash(float_gguf, tmp_path):
    path, weights = float_gguf
    first = cached_conversion(path, tmp_path / "cache", log=lambda _: None)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    again = cached_conversion(copy, tmp_path / "cache", log=lambda _: None)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    other = write_llama_gguf(tmp_path / "other.gguf", SHAPE, llama_weights(SHAPE, seed=5))
    assert cached_conversion(other, tmp_path / "cache", log=lambda _: None) != first


def test_existing_output_is_not_overwritten(float_gguf, tmp_path):
    path, _ = float_gguf
    (tmp_path / "hf").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(path, tmp_path / "hf", progress=False)
