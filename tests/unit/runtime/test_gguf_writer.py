"""`avspec.runtime.gguf.writer`: a tiny Llama checkpoint written as a GGUF llama.cpp loads.

The checkpoint comes from a tiny GGUF written as llama.cpp writes one (`helpers.gguf_files`:
its names, its q/k row permutation coded independently of `avspec.runtime.gguf.llama`, a Q8_0
embedding), converted by the project's converter: like the real draft, its embedding is a
dequantized Q8_0 tensor and that GGUF holds its tokenizer. Checked:

- round trip: written as F32 and converted back, every tensor equals the checkpoint's exactly,
  and every tensor of the written file equals the source GGUF's (so the q/k rows are in
  llama.cpp's order, not merely in an order the converter undoes); a writer that skips the
  permutation is caught by the same comparison, on exactly the q/k weights;
- the `llama.*` metadata describes the checkpoint, every `tokenizer.*` key is copied with its
  value type, matrices take the asked-for type (Q8_0 falls back to F16 for rows that are not
  whole blocks), norms stay F32;
- the shared embedding: the source's Q8_0 blocks are copied byte for byte (from a bf16 or a
  float32 checkpoint); a GGUF whose embedding is another is refused;
- bad inputs raise ValueError naming the problem, and leave no file behind;
- llama.cpp (when `llama_cpp` is importable; skipped locally otherwise, a failure in CI) loads
  the written file and its logits equal the torch runtime's within LLAMACPP_MAX_DIFF: float32
  weights and a float32 KV cache, so only summation order differs (measured: 3e-5 on logits
  of std 8); the unpermuted file misses by whole units (measured: 33).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from helpers.gguf_files import TinyLlama, llama_weights
from helpers.gguf_files import write_llama_gguf as write_source_gguf
from safetensors.torch import load_file

from avspec.runtime.gguf import writer
from avspec.runtime.gguf.convert import convert_gguf
from avspec.runtime.gguf.llama import llama_config
from avspec.runtime.gguf.reader import GGUFFile
from avspec.runtime.gguf.writer import write_llama_gguf
from avspec.runtime.hf_config import read_hf_config

pytestmark = pytest.mark.usefixtures("single_thread")

SHAPE = TinyLlama()
EMBEDDING = "model.embed_tokens.weight"
IDS = [3, 40, 77, 120, 200, 5, 9, 150, 33, 260, 17, 64, 1, 2, 99, 180]
LLAMACPP_MAX_DIFF = 1e-3


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(the llama.cpp-style GGUF, its float32 checkpoint, its bfloat16 checkpoint)."""
    root = tmp_path_factory.mktemp("writer")
    weights = llama_weights(SHAPE, seed=0)
    gguf = write_source_gguf(root / "source.gguf", SHAPE, weights, {EMBEDDING: Q.Q8_0})
    f32 = convert_gguf(gguf, root / "hf-f32", dtype=torch.float32, progress=False)
    bf16 = convert_gguf(gguf, root / "hf-bf16", dtype=torch.bfloat16, progress=False)
    return gguf, f32, bf16


def _round_trip(path, tmp_path) -> dict[str, torch.Tensor]:
    out = convert_gguf(path, tmp_path / "back", dtype=torch.float32, progress=False)
    return load_file(out / "model.safetensors")


def _mismatches(written: dict[str, torch.Tensor], checkpoint) -> list[str]:
    expected = load_file(checkpoint / "model.safetensors")
    assert set(written) == set(expected)
    return sorted(n for n in expected if not torch.equal(written[n], expected[n].float()))


def test_f32_round_trip_is_exact(source, tmp_path):
    gguf, f32, _ = source
    out = write_llama_gguf(f32, tmp_path / "model.gguf", gguf, "f32")
    assert _mismatches(_round_trip(out, tmp_path), f32) == []


def test_tensors_are_laid_out_as_llama_cpp_writes_them(source, tmp_path):
    gguf, f32, _ = source
    out = GGUFFile(write_llama_gguf(f32, tmp_path / "model.gguf", gguf, "f32"))
    reference = GGUFFile(gguf)
    assert sorted(out.tensor_names()) == sorted(reference.tensor_names())
    assert "output.weight" not in out.tensor_names()  # tied
    for name in reference.tensor_names():
        assert torch.equal(out.tensor(name), reference.tensor(name)), name


def test_a_writer_without_the_permutation_is_caught(source, tmp_path, monkeypatch):
    gguf, f32, _ = source
    monkeypatch.setattr(writer, "permute_rotary_rows", lambda weight, heads: weight)
    out = write_llama_gguf(f32, tmp_path / "model.gguf", gguf, "f32")
    projections = [
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(SHAPE.layers) for p in "kq"
    ]
    assert _mismatches(_round_trip(out, tmp_path), f32) == projections


def test_bf16_checkpoint_round_trips_exactly_as_bf16(source, tmp_path):
    gguf, _, bf16 = source
    out = write_llama_gguf(bf16, tmp_path / "model.gguf", gguf, "bf16")
    types = {n: GGUFFile(out).tensor_type(n) for n in GGUFFile(out).tensor_names()}
    assert {t for n, t in types.items() if n.endswith("norm.weight")} == {"F32"}
    assert {t for n, t in types.items() if not n.endswith("norm.weight")} == {"BF16"}
    assert _mismatches(_round_trip(out, tmp_path), bf16) == []


def test_metadata_describes_the_checkpoint(source, tmp_path):
    gguf, _, bf16 = source
    out = GGUFFile(write_llama_gguf(bf16, tmp_path / "model.gguf", gguf, "q8_0", name="tiny"))
    assert llama_config(out) == read_hf_config(bf16).config
    assert out.architecture == "llama" and out.value("general.name") == "tiny"
    assert out.value("general.file_type") == 7  # MOSTLY_Q8_0
    assert out.value("llama.context_length") == SHAPE.context  # max_position_embeddings
    assert out.value("llama.rope.dimension_count") == SHAPE.head_dim
    assert out.value("llama.vocab_size") == len(GGUFFile(gguf).value("tokenizer.ggml.tokens"))
    for name in out.tensor_names():
        expected = "F32" if name.endswith("norm.weight") else "Q8_0"
        assert out.tensor_type(name) == expected, name


def test_tokenizer_keys_are_copied_with_their_types(source, tmp_path):
    gguf, _, bf16 = source
    out = GGUFReader(write_llama_gguf(bf16, tmp_path / "model.gguf", gguf, "q8_0"))
    original = GGUFReader(gguf)
    keys = [k for k in original.fields if k.startswith("tokenizer.")]
    assert "tokenizer.chat_template" in keys and "tokenizer.ggml.merges" in keys
    assert sorted(keys) == sorted(k for k in out.fields if k.startswith("tokenizer."))
    for key in keys:
        assert out.fields[key].types == original.fields[key].types, key
        assert out.fields[key].contents() == original.fields[key].contents(), key


def test_q8_0_falls_back_to_f16_for_rows_of_partial_blocks(tmp_path):
    shape = TinyLlama(width=48, heads=4, kv_heads=2, hidden=96)
    gguf = write_source_gguf(tmp_path / "narrow.gguf", shape, llama_weights(shape, seed=3))
    hf = convert_gguf(gguf, tmp_path / "hf", dtype=torch.float32, progress=False)
    out = GGUFFile(write_llama_gguf(hf, tmp_path / "model.gguf", gguf, "q8_0"))
    assert out.tensor_type("blk.0.attn_q.weight") == "F16"  # rows of 48 values
    assert out.tensor_type("blk.0.ffn_down.weight") == "Q8_0"  # rows of 96


@pytest.mark.parametrize("checkpoint", [1, 2], ids=["float32", "bfloat16"])
def test_shared_embedding_blocks_are_copied_unchanged(source, tmp_path, checkpoint):
    gguf = source[0]
    out = write_llama_gguf(
        source[checkpoint], tmp_path / "model.gguf", gguf, "q8_0", shared_embedding_from=gguf
    )

    def embedding(path) -> np.ndarray:
        tensor = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
        assert tensor.tensor_type == Q.Q8_0
        return np.asarray(tensor.data)

    assert embedding(out).tobytes() == embedding(gguf).tobytes()


def test_another_embedding_source_is_refused(source, tmp_path):
    gguf, _, bf16 = source
    other = write_source_gguf(
        tmp_path / "other.gguf", SHAPE, llama_weights(SHAPE, seed=1), {EMBEDDING: Q.Q8_0}
    )
    with pytest.raises(ValueError, match="not the tensor the checkpoint's embedding was"):
        write_llama_gguf(bf16, tmp_path / "model.gguf", gguf, shared_embedding_from=other)
    assert list(tmp_path.iterdir()) == [other]


def _copy_checkpoint(directory, tmp_path, **config_changes):
    copy = shutil.copytree(directory, tmp_path / "ckpt")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | config_changes))
    return copy


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["Qwen2ForCausalLM"]}, "not a Llama-family checkpoint"),
        ({"architectures": ["GPT2LMHeadModel"]}, "not a Llama-family checkpoint"),
        ({"vocab_size": 300}, r"its vocabulary has 267 tokens, the checkpoint's vocab_size is 300"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_checkpoints_are_refused_by_name(source, tmp_path, change, message):
    gguf, _, bf16 = source
    ckpt = _copy_checkpoint(bf16, tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        write_llama_gguf(ckpt, tmp_path / "out" / "model.gguf", gguf)
    assert not (tmp_path / "out").exists()


def test_missing_files_are_named(source, tmp_path):
    gguf, _, bf16 = source
    out = tmp_path / "model.gguf"
    with pytest.raises(ValueError, match="model directory .*nowhere does not exist"):
        write_llama_gguf(tmp_path / "nowhere", out, gguf)
    with pytest.raises(ValueError, match="tokenizer GGUF .*absent.gguf does not exist"):
        write_llama_gguf(bf16, out, tmp_path / "absent.gguf")
    with pytest.raises(ValueError, match="shared-embedding GGUF .*absent.gguf does not exist"):
        write_llama_gguf(bf16, out, gguf, shared_embedding_from=tmp_path / "absent.gguf")
    ckpt = _copy_checkpoint(bf16, tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="missing model.safetensors"):
        write_llama_gguf(ckpt, out, gguf)
    with pytest.raises(ValueError, match="tensor_type must be one of"):
        write_llama_gguf(bf16, out, gguf, "q4_0")
    assert not out.exists()


def test_a_failed_write_leaves_the_existing_file(source, tmp_path, monkeypatch):
    gguf, _, bf16 = source
    out = write_llama_gguf(bf16, tmp_path / "model.gguf", gguf, "f32")
    before = out.read_bytes()

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(writer, "_add_tensors", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_llama_gguf(bf16, out, gguf, "q8_0")
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def _llamacpp_logits(binding, path) -> torch.Tensor:
    llm = binding.Llama(
        model_path=str(path),
        n_ctx=64,
        n_threads=1,
        logits_all=True,
        verbose=False,
        flash_attn=False,
        type_k=binding.GGML_TYPE_F32,  # the default F16 cache would round keys and values
        type_v=binding.GGML_TYPE_F32,
    )
    llm.eval(IDS)
    return torch.from_numpy(np.array(llm.scores[: len(IDS)], dtype=np.float32))


def _runtime_logits(checkpoint) -> torch.Tensor:
    from avspec.runtime.model_dir import load_model

    model = load_model(checkpoint, "cpu", dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([IDS]))[0]


def test_llama_cpp_logits_match_the_runtime(source, tmp_path, binding):
    gguf, f32, _ = source
    out = write_llama_gguf(f32, tmp_path / "model.gguf", gguf, "f32")
    ours, reference = _llamacpp_logits(binding, out), _runtime_logits(f32)
    assert (ours - reference).abs().max() <= LLAMACPP_MAX_DIFF
    assert reference.std() > 1.0  # peaked logits: a wrong model could not hide in noise


def test_llama_cpp_sees_an_unpermuted_file_as_another_model(source, tmp_path, binding, monkeypatch):
    gguf, f32, _ = source
    monkeypatch.setattr(writer, "permute_rotary_rows", lambda weight, heads: weight)
    out = write_llama_gguf(f32, tmp_path / "model.gguf", gguf, "f32")
    diff = (_llamacpp_logits(binding, out) - _runtime_logits(f32)).abs().max()
    assert diff > 100 * LLAMACPP_MAX_DIFF
