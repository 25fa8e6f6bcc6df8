"""The shipped pair (models/draft, models/target) as its model card describes it.

- `transformers.AutoModelForCausalLM` loads each directory as it is and gives the served
  runtime's logits (max abs difference <= MAX_DIFF over a code and a prose prompt); the same
  comparison fails for the runtime with the rotary convention swapped.
- The tokenizer round-trips every held-out file and arbitrary Unicode text exactly.
- The acceptance table of the model card is reproduced by its command (the report's call,
  same seed, 200 prompts per kind) within ACCEPTANCE_TOLERANCE per position; the same check
  fails for an untrained draft.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.model_dir import load_model
from avspec.runtime.transformer import Transformer, init_weights
from avspec.tools.train.tiny.corpus import corpus_files, heldout_prompts, split_files
from avspec.tools.train.tiny.evaluate import acceptance_by_position

MODELS = Path(__file__).resolve().parents[5] / "models" / "tiny"
MAX_DIFF = 1e-4
# Same seed and prompts as the card: only float rounding (thread count, library version)
# separates the two runs, which can flip a sampled draft token now and then; 0.02 is about one
# standard error of a 200-prompt mean of sum_v min(p, q).
ACCEPTANCE_TOLERANCE = 0.02
PROMPTS = ("import os\nimport sys\n\ndef main(argv):\n", "The with statement is used to wrap")


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizer:
    return HFTokenizer.from_directory(MODELS / "target")


@pytest.fixture(scope="module")
def held_out() -> list[tuple[str, str]]:
    return split_files(corpus_files())[1]


def _max_logit_diff(runtime: Transformer, reference, ids: list[int]) -> float:
    with torch.no_grad():
        ours = runtime(torch.tensor([ids]))
        theirs = reference(torch.tensor([ids])).logits
    return float((ours - theirs).abs().max())


@pytest.mark.parametrize("name", ["target", "draft"])
def test_transformers_gives_the_served_logits(name, tokenizer):
    reference = AutoModelForCausalLM.from_pretrained(MODELS / name, torch_dtype=torch.float32)
    assert type(reference).__name__ == "LlamaForCausalLM"
    runtime = load_model(MODELS / name)
    for prompt in PROMPTS:
        assert _max_logit_diff(runtime, reference.eval(), tokenizer.encode(prompt)) <= MAX_DIFF


def test_logit_comparison_catches_a_swapped_rotary_convention(tokenizer):
    reference = AutoModelForCausalLM.from_pretrained(MODELS / "target", torch_dtype=torch.float32)
    served = load_model(MODELS / "target")
    wrong = Transformer(dataclasses.replace(served.config, rope_style="interleaved"))
    wrong.load_state_dict(served.state_dict())
    assert _max_logit_diff(wrong.eval(), reference.eval(), tokenizer.encode(PROMPTS[0])) > 1e-2


def test_both_models_share_the_tokenizer():
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (MODELS / "draft" / file).read_bytes() == (MODELS / "target" / file).read_bytes()


def test_tokenizer_round_trips_the_held_out_split(tokenizer, held_out):
    for name, text in held_out:
        assert tokenizer.decode(tokenizer.encode(text)) == text, name


def test_tokenizer_round_trips_arbitrary_text(tokenizer):
    """Byte-level BPE: any Unicode string (every byte sequence that is text) round-trips."""
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000),
                                       rng.randrange(0x1F300, 0x1FAFF), rng.randrange(0, 32)]))
                       for _ in range(rng.randrange(1, 40)))  # fmt: skip
        assert tokenizer.decode(tokenizer.encode(text)) == text


def _card_acceptance() -> dict[str, list[float]]:
    log = json.loads((MODELS / "training_log.json").read_text())
    return log["report"]["acceptance_by_position"]


def _acceptance(draft: Transformer, target: Transformer, held_out, tokenizer, kind: str):
    """The report's call for one kind of prompt (evaluate.report, seed 0)."""
    prompts = heldout_prompts(held_out, 200, 40, kind == "prose", tokenizer)
    return acceptance_by_position(
        draft, target, prompts, generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize("kind", ["code", "prose"])
def test_model_card_acceptance_is_reproduced(kind, tokenizer, held_out):
    draft, target = load_model(MODELS / "draft"), load_model(MODELS / "target")
    measured = _acceptance(draft, target, held_out, tokenizer, kind)
    card = _card_acceptance()[kind]
    assert max(abs(a - b) for a, b in zip(measured, card, strict=True)) <= ACCEPTANCE_TOLERANCE


def test_acceptance_check_catches_an_untrained_draft(tokenizer, held_out):
    target = load_model(MODELS / "target")
    untrained = Transformer(load_model(MODELS / "draft").config)
    init_weights(untrained, torch.Generator().manual_seed(0))
    measured = _acceptance(untrained.eval(), target, held_out, tokenizer, "code")
    card = _card_acceptance()["code"]
    assert max(abs(a - b) for a, b in zip(measured, card, strict=True)) > ACCEPTANCE_TOLERANCE
