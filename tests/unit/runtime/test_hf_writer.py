"""`save_hf_model`: a Llama-form `Transformer` written as a `LlamaForCausalLM` directory.

Tiny random models (2 layers, width 64, weights spread so logits are peaked) are saved, then
loaded by `transformers.AutoModelForCausalLM` and by the runtime's `load_hf_model`: both must
give the original model's logits within MAX_DIFF. A config Llama cannot express is refused,
naming the field, before anything is written.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.hf_dirs import CORPUS, spread_weights
from transformers import AutoModelForCausalLM

from avspec.runtime.hf_checkpoint import load_hf_model, read_hf_config, save_hf_model
from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.rope import RopeScaling
from avspec.runtime.transformer import Transformer, TransformerConfig
from avspec.tools.train.tiny.bpe import save_tokenizer, train_bpe

MAX_DIFF = 1e-4
VOCAB = 300
LLAMA = TransformerConfig(
    num_layers=2,
    width=64,
    num_heads=4,
    vocab_size=VOCAB,
    max_length=96,
    num_kv_heads=2,
    intermediate_size=96,
    mlp="swiglu",
    norm_eps=1e-5,
    tie_embeddings=False,
)
VARIANTS = {
    "gqa_untied": LLAMA,
    "head_dim_biases": dataclasses.replace(
        LLAMA, head_dim=24, qkv_bias=True, out_bias=True, mlp_bias=True
    ),
    "tied_llama3": dataclasses.replace(
        LLAMA,
        num_kv_heads=1,
        tie_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32),
    ),
    "linear": dataclasses.replace(LLAMA, rope_scaling=RopeScaling("linear", 4.0)),
}


def random_model(config: TransformerConfig, seed: int) -> Transformer:
    """A model with spread weights: random norm weights and biases, matrices ~ 1.5/sqrt(fan-in)."""
    torch.manual_seed(seed)
    return spread_weights(Transformer(config), seed)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_saved_model_loads_in_transformers_and_the_runtime_with_equal_logits(kind, tmp_path):
    model = random_model(VARIANTS[kind], seed=len(kind))
    directory = save_hf_model(model, tmp_path / kind, eos_token_id=[2, 3], bos_token_id=1)
    ids = torch.randint(0, VOCAB, (3, 80), generator=torch.Generator().manual_seed(5))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    loaded, info = load_hf_model(directory)
    with torch.no_grad():
        want = model(ids)
        theirs = reference(ids).logits
        ours = loaded(ids)
    assert want.std() > 1.0  # peaked logits: a wrong layout would show
    assert (theirs - want).abs().max().item() <= MAX_DIFF
    assert (ours - want).abs().max().item() <= MAX_DIFF
    assert read_hf_config(directory).config == model.config
    assert (info.bos_token_id, info.eos_token_ids) == (1, (2, 3))
    assert type(reference).__name__ == "LlamaForCausalLM"
    assert reference.generation_config.eos_token_id == [2, 3]


def test_tokenizer_files_travel_and_name_the_special_ids(tmp_path):
    tokenizer_dir = save_tokenizer(train_bpe(CORPUS, VOCAB), tmp_path / "tok", max_length=96)
    model = random_model(VARIANTS["tied_llama3"], seed=1)
    directory = save_hf_model(model, tmp_path / "model", tokenizer_dir)
    config = json.loads((directory / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 0)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    tokenizer = HFTokenizer.from_directory(directory)
    assert tokenizer.eos_ids == {0} and tokenizer.vocab_size == VOCAB
    small = dataclasses.replace(VARIANTS["tied_llama3"], vocab_size=VOCAB - 1)
    with pytest.raises(ValueError, match="embedding rows"):
        save_hf_model(Transformer(small), tmp_path / "small", tokenizer_dir)
    with pytest.raises(ValueError, match="needs eos_token_id"):
        save_hf_model(model, tmp_path / "no_eos")


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("mlp", {"mlp": "gelu"}),
        ("rope_style", {"rope_style": "interleaved"}),
        ("norm_eps", {"norm_eps": None}),
        ("out_bias", {"qkv_bias": True}),
    ],
)
def test_a_config_llama_cannot_express_is_refused_naming_the_field(field, change, tmp_path):
    model = Transformer(dataclasses.replace(LLAMA, **change))
    with pytest.raises(ValueError, match=f"TransformerConfig.{field} is"):
        save_hf_model(model, tmp_path / "out", eos_token_id=0)
    assert not (tmp_path / "out").exists()


def test_the_byte_level_gpt_default_config_is_refused_for_its_gelu_mlp(tmp_path):
    gpt = Transformer(TransformerConfig(num_layers=1, width=32, num_heads=2))
    with pytest.raises(ValueError, match="TransformerConfig.mlp is 'gelu'"):
        save_hf_model(gpt, tmp_path / "gpt", eos_token_id=256)
