"""Serving precisions: names resolved per device, and a checkpoint loaded in each.

Loaded in int8/int4 a model has its block projections and output matrix quantized, its
activations and KV cache in the `auto` dtype; in float32 it is the checkpoint's model, exactly
(the float32 exactness tests of test_hf_checkpoint hold for it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hf_dirs import llama_form_config, save_transformer_dir, spread_weights

from avspec.runtime import precision
from avspec.runtime.hf_checkpoint import load_hf_model
from avspec.runtime.precision import PRECISIONS, Precision, load_served_model, resolve_precision
from avspec.runtime.quantized import Int4Linear, Int8Linear
from avspec.runtime.transformer import Transformer
from avspec.runtime.w8a8 import OUTLIER_CHANNELS, W8A8Linear

CONFIG = llama_form_config(width=64, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = spread_weights(Transformer(CONFIG), 1)
    return save_transformer_dir(tmp_path_factory.mktemp("precision") / "model", model)


@pytest.fixture
def auto_is_bfloat16(monkeypatch):
    monkeypatch.setattr(precision, "read_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    precision._cpu_auto_dtype.cache_clear()
    yield
    precision._cpu_auto_dtype.cache_clear()


def test_names_resolve_per_device():
    assert resolve_precision("float32") == Precision("float32", torch.float32)
    assert resolve_precision("bfloat16", "cuda").dtype == torch.bfloat16
    assert str(resolve_precision("float32")) == "float32"
    with pytest.raises(ValueError, match="CPU kernels"):
        resolve_precision("int8", "cuda")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, auto"):
        resolve_precision("int2")
    assert set(PRECISIONS) == {"float32", "bfloat16", "float16", "auto", "int8", "int4", "w8a8"}
    with pytest.raises(ValueError, match="CPU kernels"):
        resolve_precision("w8a8", "cuda")


def test_float32_is_the_checkpoint_model(checkpoint):
    ids = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(0))
    served = load_served_model(checkpoint, "cpu", "float32")
    plain, _ = load_hf_model(checkpoint)
    with torch.no_grad():
        assert torch.equal(served(ids), plain(ids))


@pytest.mark.parametrize(("name", "layer"), [("int8", Int8Linear), ("int4", Int4Linear)])
def test_quantized_load(checkpoint, auto_is_bfloat16, name, layer):
    model = load_served_model(checkpoint, "cpu", name, max_length=32)
    assert all(isinstance(block.mlp_out, layer) for block in model.blocks)
    assert isinstance(model.lm_head, Int8Linear)
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.new_cache(2, 32).k.dtype == torch.bfloat16
    assert str(resolve_precision(name)) == f"{name} weights, bfloat16 activations"
    cache = model.new_cache(1, 32)
    cache.allocate(0)
    with torch.no_grad():
        logits = model.forward_cached(cache, [0], torch.arange(5), [5])
    assert logits.shape == (5, 257) and torch.isfinite(logits).all()


def test_w8a8_load_is_calibrated(checkpoint, auto_is_bfloat16):
    model = load_served_model(checkpoint, "cpu", "w8a8", max_length=32)
    layers = [block.mlp_out for block in model.blocks] + [model.lm_head]
    assert all(isinstance(layer, W8A8Linear) for layer in layers)
    assert all(len(layer.outliers) == OUTLIER_CHANNELS for layer in layers)  # calibrated
    assert str(resolve_precision("w8a8")).startswith("int8 weights, int8 dynamic activations")
    cache = model.new_cache(1, 32)
    cache.allocate(0)
    with torch.no_grad():
        logits = model.forward_cached(cache, [0], torch.arange(5), [5])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_auto_is_bfloat16_where_fast(checkpoint, auto_is_bfloat16):
    model = load_served_model(checkpoint, "cpu", "auto")
    assert model.embed.weight.dtype == torch.bfloat16
    assert isinstance(model.blocks[0].qkv, torch.nn.Linear)
