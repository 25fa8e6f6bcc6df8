"""The checkpoint's separate projections, fused at load, compute what they compute apart.

A Llama checkpoint stores q_proj, k_proj, v_proj and gate_proj, up_proj as separate tensors;
the loader copies them into one q/k/v matrix and one gate/up matrix per block (one product
each, the checkpoint format unchanged). Logits of the loaded model must equal, within 1e-5 in
float32, those of the same model whose blocks run one product per checkpoint tensor, read
from the file; wiring k_proj where v_proj belongs is caught.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_dirs import llama_form_config, save_transformer_dir, spread_weights
from safetensors import safe_open

from avspec.runtime.hf_checkpoint import load_hf_model
from avspec.runtime.transformer import Transformer

CONFIG = llama_form_config(num_heads=4, num_kv_heads=2, intermediate_size=96, max_length=64)


class Separate(torch.nn.Module):
    """Products with each of `weights` in turn, concatenated: the unfused projection."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, w) for w in self.weights], dim=-1)


def unfused(model: Transformer, checkpoint: Path, qkv_names=("q", "k", "v")) -> Transformer:
    out = copy.deepcopy(model)
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        for i, block in enumerate(out.blocks):
            layer = f"model.layers.{i}."
            attn = [f.get_tensor(f"{layer}self_attn.{n}_proj.weight") for n in qkv_names]
            mlp = [f.get_tensor(f"{layer}mlp.{n}_proj.weight") for n in ("gate", "up")]
            block.qkv, block.mlp_in = Separate(attn), Separate(mlp)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = spread_weights(Transformer(CONFIG), 7)
    return save_transformer_dir(tmp_path_factory.mktemp("fused") / "model", model)


def test_fused_projections_equal_the_separate_products(checkpoint):
    model, _ = load_hf_model(checkpoint)
    assert model.blocks[0].qkv.weight.shape == ((4 + 2 + 2) * 16, 64)  # one product each
    assert model.blocks[0].mlp_in.weight.shape == (2 * 96, 64)
    ids = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        fused_logits = model(ids)
        torch.testing.assert_close(fused_logits, unfused(model, checkpoint)(ids), rtol=0, atol=1e-5)
        swapped = unfused(model, checkpoint, qkv_names=("q", "v", "k"))(ids)
    assert (swapped - fused_logits).abs().max() > 1e-2
