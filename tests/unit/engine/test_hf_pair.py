"""End to end, in process: a Hugging Face Llama pair served by SpeculativeStep + Scheduler.

A tiny random `LlamaForCausalLM` target, a draft that is the target plus small noise (another
HF directory), a trained tokenizer.json in both. Greedy output with adaptive verification on,
off, and with no drafts at all must be the same tokens as transformers' own greedy `generate`
of the target for the same prompt ids, stopping at an EOS named by generation_config.json.
"""

from __future__ import annotations

import pytest

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
from avspec.engine.step import SpeculativeStep  # noqa: E402
from avspec.runtime.hf_tokenizer import HFTokenizer  # noqa: E402
from avspec.runtime.model_dir import load_tokenizer  # noqa: E402
from avspec.runtime.pair import check_pair  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

K, MAX_NEW, CONTEXT = 4, 24, 64
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target_dir, draft_dir, prompt ids, the reference tokens, the EOS ids)."""
    root = tmp_path_factory.mktemp("hf_pair")
    tok = tiny_tokenizer()
    target = tiny_llama(tok.get_vocab_size(), seed=11)
    draft = perturbed(target, 0.08, seed=12)
    prompt = tok.encode(PROMPT).ids
    eos = tok.token_to_id("</s>")
    free_run = hf_greedy(target, prompt, [eos], MAX_NEW)
    # an EOS the target actually reaches: the first token, 8 or more in, not seen before it
    stop = next(
        (t for i, t in enumerate(free_run) if i >= 8 and t not in free_run[:i] and t != eos),
        None,
    )
    assert stop is not None, "the tiny target repeats itself too early for this test"
    eos_ids = [eos, stop]
    reference = hf_greedy(target, prompt, eos_ids, MAX_NEW)
    assert reference == free_run[: free_run.index(stop)]
    target_dir = save_hf_dir(root / "target", target, tok, generation_eos=eos_ids)
    draft_dir = save_hf_dir(root / "draft", draft, tok, generation_eos=eos_ids)
    return target_dir, draft_dir, prompt, reference, frozenset(eos_ids)


def test_greedy_matches_transformers_with_av_on_off_and_no_drafts(pair) -> None:
    target_dir, draft_dir, prompt, reference, eos_ids = pair
    tokenizer = load_tokenizer(target_dir)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_ids == eos_ids
    assert tokenizer.encode(PROMPT) == prompt
    rows = tokenizer.vocab_size
    info = check_pair(draft_dir, target_dir, load_tokenizer(draft_dir), tokenizer, rows, rows)
    step = SpeculativeStep.from_model_dirs(
        target_dir, draft_dir, K, 4, CONTEXT, vocab_limit=info.num_tokens
    )
    runs = {
        "av_on": GenerationRequest(prompt, MAX_NEW, temperature=0.0, num_draft_tokens=K),
        "av_off": GenerationRequest(
            prompt, MAX_NEW, temperature=0.0, num_draft_tokens=K, adaptive=False
        ),
        "no_drafts": GenerationRequest(prompt, MAX_NEW, temperature=0.0, num_draft_tokens=0),
    }
    outputs, reasons, accepted = {}, {}, {}
    for name, request in runs.items():
        scheduler = Scheduler(step, tokenizer.eos_ids, 4, CONTEXT, K)
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
    assert outputs["av_on"] == outputs["av_off"] == outputs["no_drafts"] == reference
    assert all(r == ["stop"] for r in reasons.values()), reasons  # stopped at the config's EOS
    assert accepted["av_off"] > 0, "the draft is close to the target: some drafts are accepted"
    assert accepted["no_drafts"] == 0
    assert tokenizer.decode(outputs["av_on"]) == tokenizer.decode(reference)
