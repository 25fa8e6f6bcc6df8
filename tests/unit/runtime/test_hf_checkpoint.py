"""Hugging Face checkpoints through the project's runtime, exact against `transformers`.

Each variant is a tiny random model built offline with `transformers` (2 layers, width 64,
vocabulary 300) and saved with `save_pretrained`. The runtime's logits must match the reference
model's within MAX_DIFF over prefill, cached decode, a ragged batch verifying drafts in one
`forward_cached` call, and rollback with a re-run; a deliberately wrong runtime variant (RoPE
layout swapped, q/k bias dropped) must miss by far more. Every bad directory raises ValueError
naming the file and the field.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.hf_dirs import TINY_LLAMA, spread_weights
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from avspec.runtime.hf_checkpoint import HFCheckpointError, load_hf_model, read_hf_config
from avspec.runtime.rope import RopeScaling, inverse_frequencies
from avspec.runtime.transformer import Transformer

MAX_DIFF = 1e-4
WRONG_DIFF = 1e-2  # a wrong variant must miss by at least this much
VOCAB, CONTEXT = 300, 64
TINY = dict(TINY_LLAMA, vocab_size=VOCAB)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small: every band of the 16-dim head is used
}
VARIANTS = {
    "llama_gqa_untied": (LlamaConfig, LlamaForCausalLM, {}),
    "llama_head_dim_tied": (
        LlamaConfig,
        LlamaForCausalLM,
        {"head_dim": 24, "num_key_value_heads": 4, "tie_word_embeddings": True},
    ),
    "llama_bias_llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        {"attention_bias": True, "mlp_bias": True, "rope_theta": 500000.0, "rope_scaling": LLAMA3},
    ),
    "llama_linear": (
        LlamaConfig,
        LlamaForCausalLM,
        {"num_key_value_heads": 1, "rope_scaling": {"type": "linear", "factor": 4.0}},
    ),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": 8}),
}


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """A reference model of `kind` with weights large enough that attention is not uniform,
    and random biases and norm weights (the library initialises those to 0 and 1)."""
    config_cls, model_cls, extra = VARIANTS[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra}, bos_token_id=1, eos_token_id=2))
    return spread_weights(model, seed)


def save(model: torch.nn.Module, path: Path, dtype: torch.dtype = torch.float32, **kwargs) -> Path:
    """save_pretrained with the weights in `dtype`; the model keeps the stored (rounded) values
    in fp32 (its rotary buffers untouched)."""
    copy.deepcopy(model).to(dtype).save_pretrained(path, safe_serialization=True, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Every variant on disk, with its reference model."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for seed, kind in enumerate(VARIANTS):
        model = build(kind, seed)
        out[kind] = (save(model, root / kind), model)
    for name, kind, options in [
        ("sharded", "llama_gqa_untied", {"max_shard_size": "60KB"}),
        ("fp16", "llama_head_dim_tied", {"dtype": torch.float16}),
        ("bf16", "qwen2_tied", {"dtype": torch.bfloat16}),
    ]:
        model = build(kind, seed=len(out))
        out[name] = (save(model, root / name, **options), model)
    # the newer form: RoPE settings in `rope_parameters`, no top-level rope_theta/rope_scaling
    path = root / "rope_parameters"
    shutil.copytree(out["llama_bias_llama3"][0], path)
    data = json.loads((path / "config.json").read_text())
    data["rope_parameters"] = {**data.pop("rope_scaling"), "rope_theta": data.pop("rope_theta")}
    (path / "config.json").write_text(json.dumps(data))
    out["rope_parameters"] = (path, out["llama_bias_llama3"][1])
    return out


class Replay:
    """Drives `forward_cached` over a ragged batch and checks every call against the reference,
    which recomputes each sequence whole: prefill, decode, draft verification, rollback."""

    def __init__(self, model: Transformer, reference: torch.nn.Module) -> None:
        self.model, self.reference = model, reference
        self.cache = model.new_cache(4, CONTEXT)
        self.tokens: dict[int, list[int]] = {}
        self.gen = torch.Generator().manual_seed(11)
        self.worst = 0.0

    def step(self, new: dict[int, int]) -> None:
        for seq_id in new:
            if not self.cache.has(seq_id):
                self.cache.allocate(seq_id)
                self.tokens[seq_id] = []
        chunks = {s: torch.randint(0, VOCAB, (n,), generator=self.gen) for s, n in new.items()}
        with torch.no_grad():
            logits = self.model.forward_cached(
                self.cache, list(new), torch.cat(list(chunks.values())), list(new.values())
            )
        for seq_id, got in zip(chunks, logits.split(list(new.values())), strict=True):
            self.tokens[seq_id] += chunks[seq_id].tolist()
            with torch.no_grad():
                full = self.reference(torch.tensor([self.tokens[seq_id]])).logits[0]
            self.worst = max(self.worst, (got - full[-len(got) :]).abs().max().item())

    def rollback(self, seq_id: int, length: int) -> None:
        self.cache.rollback(seq_id, length)
        self.tokens[seq_id] = self.tokens[seq_id][:length]

    def run(self) -> float:
        """The whole scenario; returns the largest abs logit difference seen."""
        self.step({0: 6, 1: 3, 2: 11})  # ragged prefill
        self.step({0: 1, 1: 1, 2: 1})  # decode, token by token
        self.step({2: 1, 0: 1, 1: 1})
        self.step({1: 5, 0: 3, 2: 2, 3: 9})  # verify drafts of several sequences + a prefill
        self.rollback(1, 6)  # drafts rejected: keep the accepted prefix
        self.rollback(0, 9)
        self.rollback(2, 13)
        self.step({0: 1, 1: 4, 2: 3, 3: 1})  # re-run over the rolled-back positions
        self.rollback(3, 0)
        self.step({3: 7})
        return self.worst


def dense_diff(model: Transformer, reference: torch.nn.Module) -> float:
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return (model(ids) - reference(ids).logits).abs().max().item()


@pytest.mark.parametrize("kind", [*VARIANTS, "sharded", "fp16", "bf16", "rope_parameters"])
def test_logits_match_transformers(saved, kind):
    path, reference = saved[kind]
    model, info = load_hf_model(path, max_length=CONTEXT)
    assert dense_diff(model, reference) <= MAX_DIFF
    assert Replay(model, reference).run() <= MAX_DIFF
    assert info.num_parameters == reference.num_parameters()
    assert info.vocab_size == VOCAB and info.max_length == CONTEXT


def test_wrong_variants_fail_the_same_comparison(saved):
    path, reference = saved["llama_gqa_untied"]
    model, _ = load_hf_model(path, max_length=CONTEXT)
    swapped = Transformer(dataclasses.replace(model.config, rope_style="interleaved"))
    swapped.load_state_dict(model.state_dict())
    assert Replay(swapped.eval(), reference).run() > WRONG_DIFF

    for kind in ("llama_bias_llama3", "llama_linear"):  # the RoPE scaling is what matches
        path, reference = saved[kind]
        model, _ = load_hf_model(path, max_length=CONTEXT)
        unscaled = Transformer(dataclasses.replace(model.config, rope_scaling=None))
        unscaled.load_state_dict(model.state_dict())
        assert Replay(unscaled.eval(), reference).run() > WRONG_DIFF

    path, reference = saved["qwen2_tied"]
    model, _ = load_hf_model(path, max_length=CONTEXT)
    assert Replay(model, reference).run() <= MAX_DIFF
    q_and_k = (model.config.num_heads + model.config.num_kv_heads) * model.config.head_dim
    with torch.no_grad():
        for block in model.blocks:
            block.qkv.bias[:q_and_k] = 0.0  # v keeps its bias
    assert Replay(model, reference).run() > WRONG_DIFF
    assert dense_diff(model, reference) > WRONG_DIFF


def test_layout_of_checkpoints(saved):
    sharded = saved["sharded"][0]
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert not (sharded / "model.safetensors").exists()
    assert "rope_scaling" not in json.loads(
        (saved["rope_parameters"][0] / "config.json").read_text()
    )
    config = read_hf_config(saved["rope_parameters"][0]).config
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    assert config.rope_theta == 500000.0


def test_model_info_and_dtypes(saved):
    model, info = load_hf_model(saved["llama_gqa_untied"][0])
    assert info.architecture == "LlamaForCausalLM" and info.dtype == torch.float32
    assert info.max_position_embeddings == 128 and info.max_length == 128
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # k+v, layers, kv heads, head_dim, fp32
    assert info.bos_token_id == 1 and info.eos_token_ids == (2,)
    assert info.checkpoint_dtypes == ("float32",)
    assert model.new_cache(1, 8).attention_shape == (2, 2, 16)  # sized by the KV heads
    assert read_hf_config(saved["fp16"][0]).config.tie_embeddings
    assert load_hf_model(saved["fp16"][0])[1].checkpoint_dtypes == ("float16",)

    path, reference = saved["bf16"]
    model, info = load_hf_model(path, dtype=torch.bfloat16, max_length=CONTEXT)
    assert info.checkpoint_dtypes == ("bfloat16",) and info.kv_bytes_per_token == 256
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(1, 16)
    cache.allocate(0)
    with torch.no_grad():
        expected = reference(ids).logits[0]
        dense = model(ids)[0]
        cached = model.forward_cached(cache, [0], ids[0], [12])
    assert dense.dtype == cached.dtype == cache.k.dtype == torch.bfloat16
    for got in (dense, cached):  # bf16 activations: close, not exact
        assert (got.float() - expected).abs().max().item() < 0.1 * expected.abs().max().item()
    assert info.bos_token_id == 1 and info.eos_token_ids == (2,)


def test_eos_list_from_generation_config(saved, tmp_path):
    path = shutil.copytree(saved["mistral"][0], tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 7]}))
    assert read_hf_config(path).eos_token_ids == (5, 2, 7)  # then config.json's 2, deduplicated


def test_rope_frequencies_match_transformers():
    for rope_scaling in (None, {"rope_type": "linear", "factor": 4.0}, LLAMA3):
        config = LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=rope_scaling)
        kind = "default" if rope_scaling is None else rope_scaling["rope_type"]
        expected, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        scaling = None if rope_scaling is None else RopeScaling.from_dict(
            {("kind" if k == "rope_type" else k): v for k, v in rope_scaling.items()}
        )  # fmt: skip
        got = inverse_frequencies(16, 500000.0, scaling)
        torch.testing.assert_close(got.float(), expected, rtol=1e-5, atol=0)
        assert factor == 1.0


# -- errors: each names the file and the field ------------------------------------------------


def edit_json(name: str, change):
    def apply(path: Path) -> None:
        data = json.loads((path / name).read_text()) if (path / name).exists() else {}
        change(data)
        (path / name).write_text(json.dumps(data))

    return apply


def edit_weights(change):
    def apply(path: Path) -> None:
        weights = load_file(str(path / "model.safetensors"))
        change(weights)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})

    return apply


def set_fields(**fields):
    return edit_json("config.json", lambda d: d.update(fields))


def drop_fields(*names):
    return edit_json("config.json", lambda d: [d.pop(n) for n in names])


def rope_parameters(**params):
    return edit_json(
        "config.json",
        lambda d: d.update(rope_parameters={"rope_theta": 1e4, **params}, rope_theta=None),
    )


K_PROJ = "model.layers.1.self_attn.k_proj.weight"
CONFIG_ERRORS = {
    "architecture": (
        set_fields(architectures=["GPT2LMHeadModel"]),
        r"config.json: field 'architectures'",
    ),
    "hidden_act": (set_fields(hidden_act="gelu"), r"config.json: field 'hidden_act'"),
    "missing size": (
        drop_fields("intermediate_size"),
        r"config.json: field 'intermediate_size' is missing",
    ),
    "rope_scaling type": (
        set_fields(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
        r"config.json: field 'rope_scaling.rope_type' is 'yarn'",
    ),
    "rope_scaling old key": (
        set_fields(rope_scaling={"type": "dynamic", "factor": 2.0}),
        r"config.json: field 'rope_scaling.type' is 'dynamic'",
    ),
    "llama3 field": (
        set_fields(rope_scaling={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}),
        r"config.json: field 'rope_scaling.low_freq_factor' is missing",
    ),
    "rope_parameters type": (
        rope_parameters(rope_type="longrope"),
        r"field 'rope_parameters.rope_type'",
    ),
    "rope_parameters theta": (
        edit_json(
            "config.json",
            lambda d: d.update(rope_parameters={"rope_type": "default"}, rope_theta=None),
        ),
        r"config.json: field 'rope_parameters.rope_theta' is missing",
    ),
    "partial rotary": (set_fields(partial_rotary_factor=0.5), r"field 'partial_rotary_factor'"),
    "quantized": (
        set_fields(quantization_config={"quant_method": "awq"}),
        r"field 'quantization_config'",
    ),
    "kv heads": (
        set_fields(num_key_value_heads=3),
        r"config.json: field 'num_key_value_heads' is 3",
    ),
    "head_dim": (set_fields(head_dim=15), r"config.json: field 'head_dim' is 15"),
    "eos out of range": (
        edit_json("generation_config.json", lambda d: d.update(eos_token_id=[2, VOCAB])),
        r"generation_config.json: field 'eos_token_id'",
    ),
    "config json": (lambda p: (p / "config.json").write_text("{"), r"config.json: not valid JSON"),
    "missing config": (lambda p: (p / "config.json").unlink(), r"missing config.json"),
}
WEIGHT_ERRORS = {
    "missing weights": (
        lambda p: (p / "model.safetensors").unlink(),
        r"missing model.safetensors or model.safetensors.index.json",
    ),
    "missing tensor": (
        edit_weights(lambda w: w.pop(K_PROJ)),
        rf"model.safetensors: missing tensor '{K_PROJ}'",
    ),
    "misshaped tensor": (
        edit_weights(lambda w: w.update({K_PROJ: w[K_PROJ][:16].contiguous()})),
        rf"model.safetensors: tensor '{K_PROJ}' has shape \(16, 64\), "
        r"config.json implies \(32, 64\)",
    ),
    "stored dtype": (
        edit_weights(lambda w: w.update({K_PROJ: w[K_PROJ].to(torch.int8)})),
        rf"model.safetensors: tensor '{K_PROJ}' is stored as I8",
    ),
    "unexpected tensor": (
        edit_weights(lambda w: w.update({"score.weight": torch.zeros(2, 64)})),
        r"model.safetensors: unexpected tensor 'score.weight'",
    ),
    "untied without lm_head": (
        edit_weights(lambda w: w.pop("lm_head.weight")),
        r"model.safetensors: missing tensor 'lm_head.weight'",
    ),
    "corrupt weights": (
        lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 16),
        r"model.safetensors: unreadable safetensors file",
    ),
}


@pytest.mark.parametrize("case", [*CONFIG_ERRORS, *WEIGHT_ERRORS])
def test_bad_directories_name_the_file_and_field(saved, tmp_path, monkeypatch, case):
    path = shutil.copytree(saved["llama_gqa_untied"][0], tmp_path / "bad")
    change, message = {**CONFIG_ERRORS, **WEIGHT_ERRORS}[case]
    change(path)

    def no_allocation(*args, **kwargs):
        raise AssertionError("the model was allocated before the checks passed")

    monkeypatch.setattr(Transformer, "empty", no_allocation)  # nothing half-loaded
    with pytest.raises(HFCheckpointError, match=message) as caught:
        load_hf_model(path, max_length=CONTEXT)
    assert isinstance(caught.value, ValueError)
    assert str(path) in str(caught.value)


def test_sharded_index_errors(saved, tmp_path):
    path = shutil.copytree(saved["sharded"][0], tmp_path / "s")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][K_PROJ]
    (path / shard).unlink()
    with pytest.raises(
        HFCheckpointError,
        match=r"index.json: field 'weight_map\.[^']+' names model-\d+-of-\d+\.safetensors, "
        "which is missing",
    ):
        load_hf_model(path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(HFCheckpointError, match=r"index.json: field 'weight_map'"):
        load_hf_model(path)


def test_sliding_window_and_context(saved, tmp_path):
    path = shutil.copytree(saved["mistral"][0], tmp_path / "m")
    set_fields(sliding_window=16)(path)
    with pytest.raises(HFCheckpointError, match=r"config.json: field 'sliding_window' is 16"):
        load_hf_model(path, max_length=CONTEXT)
    model, info = load_hf_model(path, max_length=16)  # the context fits in the window
    assert info.max_length == 16 and model.config.max_length == 16
    set_fields(sliding_window=None)(path)
    assert load_hf_model(path, max_length=CONTEXT)[1].architecture == "MistralForCausalLM"
    with pytest.raises(HFCheckpointError, match=r"field 'max_position_embeddings' is 128"):
        read_hf_config(path, max_length=129)

    path = shutil.copytree(saved["qwen2_tied"][0], tmp_path / "q")
    set_fields(use_sliding_window=True, sliding_window=16, max_window_layers=1,
               layer_types=None)(path)  # fmt: skip
    with pytest.raises(HFCheckpointError, match=r"field 'sliding_window' is 16"):
        read_hf_config(path, max_length=CONTEXT)
    set_fields(max_window_layers=2)(path)  # every layer attends fully
    assert read_hf_config(path, max_length=CONTEXT).config.qkv_bias
    with pytest.raises(HFCheckpointError, match=r"does not exist"):
        read_hf_config(tmp_path / "nowhere")


def test_serving_dtype_is_checked(saved):
    with pytest.raises(ValueError, match="serving dtype"):
        load_hf_model(saved["mistral"][0], dtype=torch.float64)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written by hand, tensors in the given order with no alignment
    padding (the library's writer sorts them so that every tensor is aligned)."""
    codes = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        blob = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": codes[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}  # fmt: skip
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_misaligned_mixed_dtype_file_and_ignored_tensors(saved, tmp_path):
    source, _ = saved["llama_gqa_untied"]
    expected, _ = load_hf_model(source, max_length=CONTEXT)
    weights = load_file(str(source / "model.safetensors"))
    path = shutil.copytree(source, tmp_path / "m")
    # an odd-sized fp16 buffer first: every later fp32 tensor sits 2 bytes off alignment
    tensors = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(3, dtype=torch.float16)}
    tensors["model.norm.weight"] = weights.pop("model.norm.weight").half()
    tensors.update(weights)
    write_safetensors(path / "model.safetensors", tensors)
    model, info = load_hf_model(path, max_length=CONTEXT)
    assert info.checkpoint_dtypes == ("float16", "float32")
    got, want = model.state_dict(), expected.state_dict()
    assert torch.equal(got["final_norm.weight"], want["final_norm.weight"].half().float())
    for name in want:
        if name != "final_norm.weight":
            assert torch.equal(got[name], want[name]), name


def test_tied_checkpoint_may_carry_lm_head(saved, tmp_path):
    source, reference = saved["qwen2_tied"]
    path = shutil.copytree(source, tmp_path / "q")
    embedding = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]
    edit_weights(lambda w: w.update({"lm_head.weight": embedding}))(path)
    model, _ = load_hf_model(path, max_length=CONTEXT)
    assert model.lm_head is None and dense_diff(model, reference) <= MAX_DIFF
