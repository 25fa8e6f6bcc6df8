"""Tiny Hugging Face model directories (a random LlamaForCausalLM + a trained tokenizer.json).

Needs the test-only dependency `transformers` (and `tokenizers`, a runtime one).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<s>", "</s>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens with a "
    "small model and verifies them with a large one. ",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
] * 8


def byte_level_bpe(corpus: list[str], specials: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (Llama 3 / Qwen2 style) trained on `corpus`; no post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def tiny_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE tokenizer trained on CORPUS, with BOS prepended and an EOS token."""
    tok = byte_level_bpe(CORPUS, [BOS, EOS], vocab_size)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


# The tiny Llama shape the Hugging Face tests build (GQA: 4 query heads over 2 KV heads).
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_llama(
    vocab_rows: int, seed: int = 0, bos_id: int = 0, eos_id: int = 1, max_positions: int = 128
):
    """A random float32 LlamaForCausalLM with weights large enough for peaked logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = {**TINY_LLAMA, "max_position_embeddings": max_positions}
    config = LlamaConfig(vocab_size=vocab_rows, bos_token_id=bos_id, eos_token_id=eos_id, **shape)
    return spread_weights(LlamaForCausalLM(config), seed)


def spread_weights(model, seed: int):
    """Weights large enough that attention is not uniform and logits are peaked; random norm
    weights and biases (the library initialises those to 1 and 0). Returns the model, in eval."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise * 1.5 / math.sqrt(p.shape[1]))
    return model.eval()


def perturbed(model, scale: float, seed: int):
    """A copy of `model` with every weight w replaced by w + scale * |w|.std() * noise."""
    import copy

    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return out.eval()


def save_hf_dir(path: Path, model, tok: Tokenizer, generation_eos: list[int] | None = None) -> Path:
    """save_pretrained (safetensors) plus tokenizer.json, tokenizer_config.json and, when
    `generation_eos` is given, generation_config.json naming those EOS ids."""
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    gen_path = path / "generation_config.json"
    if generation_eos is not None:
        gen_path.write_text(
            json.dumps({"bos_token_id": tok.token_to_id(BOS), "eos_token_id": generation_eos})
        )
    elif gen_path.exists():
        gen_path.unlink()
    return path


def save_hf_pair(root: Path) -> tuple[Path, Path]:
    """A tiny HF Llama target and a perturbed draft sharing one tokenizer: (draft, target)."""
    tok = tiny_tokenizer()
    target = tiny_llama(tok.get_vocab_size() + 8, seed=3)  # padded embedding rows
    draft = perturbed(target, 0.05, seed=4)
    return save_hf_dir(root / "draft", draft, tok), save_hf_dir(root / "target", target, tok)


def hf_greedy(
    model, prompt: list[int], eos_ids: list[int], max_new: int, suppress: list[int] = ()
) -> list[int]:
    """transformers' greedy `generate` of `model`: the new tokens, without a final EOS.

    suppress: token ids never generated (padded embedding rows, masked like the stages'
    vocab_limit)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
        suppress_tokens=list(suppress) or None,
    )[0, len(prompt) :].tolist()
    return out[:-1] if out and out[-1] in eos_ids else out


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with one piece per byte (no merges) plus EOS: 257 tokens, EOS 0.

    Token ids are not byte values: `token_to_id` / `id_to_token` map between them (the pieces
    are the ByteLevel alphabet, e.g. "Ġ" for a space)."""
    tok = byte_level_bpe([""], [EOS], 257)
    assert tok.get_vocab_size() == 257, tok.get_vocab_size()
    return tok


def byte_piece_text(tok: Tokenizer, token_id: int) -> str | None:
    """The text of one byte piece of `tok` (a ByteLevel alphabet character), or None for a
    special token or a piece that is not one whole character."""
    piece = tok.id_to_token(token_id)
    if piece is None or piece == EOS:
        return None
    text = tok.decode([token_id], skip_special_tokens=True)
    return text if len(text) == 1 and text != "\ufffd" else None


# A Llama-form runtime config (SwiGLU, RMSNorm epsilon, half-split RoPE) over the byte tokenizer.
def llama_form_config(**overrides):
    from avspec.runtime.transformer import TransformerConfig

    values = dict(
        num_layers=2, width=64, num_heads=2, vocab_size=257, max_length=256, mlp="swiglu",
        norm_eps=1e-5,
    )  # fmt: skip
    return TransformerConfig(**(values | overrides))


def save_transformer_dir(path: Path, model, tok: Tokenizer | None = None) -> Path:
    """Save a Llama-form runtime `Transformer` as a LlamaForCausalLM directory with `tok`
    (default: `byte_tokenizer()`) as its tokenizer, EOS its "</s>": `save_hf_model` plus the
    tokenizer files. Returns `path`."""
    from avspec.runtime.hf_checkpoint import save_hf_model

    tok = tok or byte_tokenizer()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return save_hf_model(model, path, eos_token_id=tok.token_to_id(EOS))
