"""End to end, in process: a Hugging Face Llama pair served by SpeculativeStep + Scheduler.

A tiny random `LlamaForCausalLM` target, a draft that is the target plus small noise (another
HF directory), a trained tokenizer.json in both. Greedy output with adaptive verification on,
off, and with no drafts at all must be the same tokens as transformers' own greedy `generate`
of the target for the same prompt ids, stopping at an EOS named by generation_config.json.
A second pair has padded embedding rows, a different number in each model (target: tokenizer
size + 8, draft: + 2): with `vocab_limit` = the tokenizer's size both stages mask the padded ids
and the contract's vocabulary is that size, so the pair runs and matches transformers' greedy
decoding with the padded ids suppressed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf_dirs import (  # noqa: E402
    hf_greedy,
    perturbed,
    save_hf_dir,
    tiny_llama,
    tiny_tokenizer,
)

from avspec.engine.scheduler import Scheduler  # noqa: E402
from avspec.engine.sequence import GenerationRequest  # noqa: E402
from avspec.engine.step import SpeculativeStep, StepCapacity  # noqa: E402
from avspec.runtime.hf_tokenizer import HFTokenizer  # noqa: E402
from avspec.runtime.model_dir import load_tokenizer  # noqa: E402
from avspec.runtime.pair import check_pair  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

K, MAX_NEW, CONTEXT = 4, 24, 64
PROMPT = "The quick brown fox"
TARGET_PAD, DRAFT_PAD = 8, 2  # padded embedding rows past the tokenizer's size


def build_pair(root, padded: bool):
    """(target_dir, draft_dir, prompt ids, the reference tokens, the EOS ids); `padded`: the
    target has TARGET_PAD rows past the tokenizer's size, the draft DRAFT_PAD, and the target's
    padded rows would win greedy decoding if they were not masked."""
    tok = tiny_tokenizer()
    size = tok.get_vocab_size()
    target = tiny_llama(size + (TARGET_PAD if padded else 0), seed=11)
    draft = perturbed(target, 0.08, seed=12)
    suppress: list[int] = []
    if padded:
        draft.resize_token_embeddings(size + DRAFT_PAD)  # drop rows: keeps the first ones
        assert draft.config.vocab_size == size + DRAFT_PAD
        with torch.no_grad():
            target.lm_head.weight[size:] *= 40.0  # padded rows dominate unless masked
        suppress = list(range(size, size + TARGET_PAD))
    prompt = tok.encode(PROMPT).ids
    eos = tok.token_to_id("</s>")
    if padded:  # control: without masking the target would emit a padded id
        assert any(t >= size for t in hf_greedy(target, prompt, [eos], MAX_NEW))
    free_run = hf_greedy(target, prompt, [eos], MAX_NEW, suppress=suppress)
    # an EOS the target actually reaches: the first token, 8 or more in, not seen before it
    stop = next(
        (t for i, t in enumerate(free_run) if i >= 8 and t not in free_run[:i] and t != eos),
        None,
    )
    assert stop is not None, "the tiny target repeats itself too early for this test"
    eos_ids = [eos, stop]
    reference = hf_greedy(target, prompt, eos_ids, MAX_NEW, suppress=suppress)
    assert reference == free_run[: free_run.index(stop)]
    target_dir = save_hf_dir(root / "target", target, tok, generation_eos=eos_ids)
    draft_dir = save_hf_dir(root / "draft", draft, tok, generation_eos=eos_ids)
    return target_dir, draft_dir, prompt, reference, frozenset(eos_ids)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Target and draft with exactly the tokenizer's rows; see `build_pair`."""
    return build_pair(tmp_path_factory.mktemp("hf_pair"), padded=False)


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    """Target and draft with TARGET_PAD and DRAFT_PAD padded rows; see `build_pair`."""
    return build_pair(tmp_path_factory.mktemp("hf_padded_pair"), padded=True)


def pair_step(target_dir, draft_dir, prompt, eos_ids, rows: dict[str, int] | None = None):
    """(SpeculativeStep with vocab_limit from check_pair, the tokenizer, the PairInfo);
    rows: each model's embedding rows (default: the tokenizer's size)."""
    tokenizer = load_tokenizer(target_dir)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_ids == eos_ids
    assert tokenizer.encode(PROMPT) == prompt
    rows = rows or {"draft": tokenizer.vocab_size, "target": tokenizer.vocab_size}
    info = check_pair(
        draft_dir, target_dir, load_tokenizer(draft_dir), tokenizer, rows["draft"], rows["target"]
    )
    step = SpeculativeStep.from_model_dirs(
        target_dir, draft_dir, StepCapacity(K, 4, CONTEXT), vocab_limit=info.num_tokens
    )
    return step, tokenizer, info


def run_requests(step, eos_ids, runs: dict[str, GenerationRequest]):
    """Each request alone through a fresh Scheduler: (tokens, finish reasons, accepted) by name."""
    outputs, reasons, accepted = {}, {}, {}
    for name, request in runs.items():
        scheduler = Scheduler(step, eos_ids, 4, CONTEXT, K)
        tokens: list[int] = []
        finish: list[str | None] = []
        counts: list[int] = []

        def on_step(report, tokens=tokens, finish=finish, counts=counts) -> None:
            tokens.extend(report.new_tokens)
            counts.append(report.accepted)
            if report.finished:
                finish.append(report.finish_reason)

        errors: list[Exception] = []
        scheduler.submit(request, on_step, errors.append)
        scheduler.run_until_idle()
        assert not errors, errors
        outputs[name], reasons[name], accepted[name] = tokens, finish, sum(counts)
    return outputs, reasons, accepted


def greedy_runs(prompt) -> dict[str, GenerationRequest]:
    return {
        "av_on": GenerationRequest(prompt, MAX_NEW, temperature=0.0, num_draft_tokens=K),
        "av_off": GenerationRequest(
            prompt, MAX_NEW, temperature=0.0, num_draft_tokens=K, adaptive=False
        ),
        "no_drafts": GenerationRequest(prompt, MAX_NEW, temperature=0.0, num_draft_tokens=0),
    }


def test_greedy_matches_transformers_with_av_on_off_and_no_drafts(pair) -> None:
    target_dir, draft_dir, prompt, reference, eos_ids = pair
    step, tokenizer, _ = pair_step(target_dir, draft_dir, prompt, eos_ids)
    outputs, reasons, accepted = run_requests(step, tokenizer.eos_ids, greedy_runs(prompt))
    assert outputs["av_on"] == outputs["av_off"] == outputs["no_drafts"] == reference
    assert all(r == ["stop"] for r in reasons.values()), reasons  # stopped at the config's EOS
    assert accepted["av_off"] > 0, "the draft is close to the target: some drafts are accepted"
    assert accepted["no_drafts"] == 0
    assert tokenizer.decode(outputs["av_on"]) == tokenizer.decode(reference)


def test_padded_rows_differing_between_draft_and_target(padded_pair) -> None:
    """Target rows = tokens + 8, draft rows = tokens + 2: the contract's vocabulary is the
    tokenizer's size (vocab_limit), so the pair runs; greedy equals transformers' greedy of the
    target with the padded ids suppressed, and a sampled run finishes without error."""
    target_dir, draft_dir, prompt, reference, eos_ids = padded_pair
    size = load_tokenizer(target_dir).vocab_size
    rows = {"draft": size + DRAFT_PAD, "target": size + TARGET_PAD}
    step, tokenizer, info = pair_step(target_dir, draft_dir, prompt, eos_ids, rows)
    assert info.num_tokens == size and info.padded
    assert step.draft.vocab_width == step.target.vocab_width == size
    outputs, reasons, accepted = run_requests(step, tokenizer.eos_ids, greedy_runs(prompt))
    assert outputs["av_on"] == outputs["av_off"] == outputs["no_drafts"] == reference
    assert all(r == ["stop"] for r in reasons.values()), reasons
    assert accepted["av_off"] > 0, "the draft is close to the target: some drafts are accepted"
    assert accepted["no_drafts"] == 0

    sampled = {
        f"sampled_{seed}": GenerationRequest(
            prompt, 12, temperature=1.0, random_seed=seed, num_draft_tokens=K
        )
        for seed in (1, 2, 3)
    }
    outputs, reasons, _ = run_requests(step, tokenizer.eos_ids, sampled)
    for name, tokens in outputs.items():
        assert tokens and all(t < size for t in tokens), (name, tokens)
        assert reasons[name] in (["stop"], ["length"]), reasons
