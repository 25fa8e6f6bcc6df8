"""In-process speculative generation (draft -> verifier -> target, through the Scheduler).

Greedy speculative output must equal target-only greedy decoding token for token, whatever the
draft proposes and whatever the verifier trims; sampled output must not depend on the batch.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from helpers.generation import generate
from helpers.hf_dirs import save_transformer_dir
from helpers.stages import K, make_inputs, perturbed, tiny_model

from avspec.av.step_cost import StepCost
from avspec.engine.scheduler import Scheduler
from avspec.engine.scheduler_limits import SchedulerLimits
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep, StepCapacity
from avspec.runtime.transformer import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")

EOS = 256
PROMPTS = [[72, 101, 108], [1] * 9, [200, 3, 17, 99, 5, 6], [42]]


def build(target: Transformer, draft: Transformer, max_sequences: int = 8) -> SpeculativeStep:
    """A step whose steep verify cost makes the verifier trim drafts."""
    return SpeculativeStep.from_models(
        target, draft, StepCapacity(K, max_sequences, 96),
        cost=StepCost.linear(0.1, 0.01, 1.0, 1.0, max_rows=64, max_tokens=512),
    )  # fmt: skip


def greedy_reference(model: Transformer, prompt: list[int], max_tokens: int) -> list[int]:
    """Target-only greedy decoding with a plain loop over Transformer.forward; EOS stops."""
    tokens: list[int] = []
    for _ in range(max_tokens):
        token = int(model(torch.tensor([prompt + tokens]))[0, -1].float().argmax())
        if token == EOS:
            break
        tokens.append(token)
    return tokens


def fresh_pair() -> tuple[Transformer, Transformer]:
    """Target and a perturbed copy of it as draft (agrees on about 2/3 of greedy tokens)."""
    target = tiny_model(20, layers=2, width=32)
    return target, perturbed(target, 0.3, seed=5)


@pytest.fixture
def pair() -> tuple[Transformer, Transformer]:
    """A pair of its own for each test (a few ms): no test sees what another did to its models."""
    return fresh_pair()


@pytest.fixture(scope="module")
def reference_tokens() -> tuple[tuple[int, ...], ...]:
    """Target-only greedy tokens of each prompt, from a pair no test touches (read-only)."""
    target, _ = fresh_pair()
    return tuple(tuple(greedy_reference(target, p, 12)) for p in PROMPTS)


@pytest.fixture
def references(reference_tokens) -> list[list[int]]:
    return [list(tokens) for tokens in reference_tokens]


@pytest.mark.parametrize(
    ("adaptive", "num_draft", "drafter"),
    [
        (True, K, "perturbed"),
        (False, K, "perturbed"),
        (True, 0, "perturbed"),
        (True, K, "unrelated"),
        (True, K, "target"),
        (False, 3, "target"),
    ],
    ids=["av-on", "av-off", "no-drafts", "av-on-unrelated-draft", "av-on-draft-is-target",
         "av-off-draft-is-target"],
)  # fmt: skip
def test_greedy_equals_target_only(pair, references, adaptive, num_draft, drafter) -> None:
    target, draft = pair
    same_model = drafter == "target"
    if drafter == "unrelated":
        draft = tiny_model(21, layers=1, width=16)
    step = build(target, target if same_model else draft)
    scheduler = Scheduler(step, EOS, 8, 96, K)
    requests = [
        GenerationRequest(p, 12, temperature=0.0, num_draft_tokens=num_draft, adaptive=adaptive)
        for p in PROMPTS
    ]
    assert generate(scheduler, requests) == references
    c = scheduler.counters
    if same_model:
        assert c.accepted == c.verified > 0, "a draft identical to the target is always right"
    elif num_draft:
        assert c.accepted < c.verified, "random drafts get rejected: correction paths ran"
    if adaptive and num_draft:
        assert c.verified < c.drafted, "the steep verify cost makes AV trim"
    if not adaptive:
        assert c.verified == c.drafted
    assert step.draft.cache.num_live == 0 and step.target.cache.num_live == 0


def test_chunked_prefill_keeps_greedy_output_and_bounds_each_step(pair) -> None:
    """Prompts of 40 and 23 tokens sent 6 a step (prefill_chunk) beside a short one that is
    decoding meanwhile: greedy output still equals target-only decoding, no step sends a row
    more than 6 prompt tokens, the short request emits while the long ones prefill, and a
    prefill piece asks for no drafts and reports nothing to its client."""
    target, draft = pair
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (40, 23)]
    prompts.append(PROMPTS[0])
    references = [greedy_reference(target, p, 12) for p in prompts]
    step = build(target, draft)
    seen: list[tuple[list[int], list[int]]] = []  # per step: input lengths, drafts asked

    def recording(inputs):
        seen.append((inputs.input_lengths.tolist(), inputs.num_draft_tokens.tolist()))
        return step(inputs)

    chunk = K + 2
    scheduler = Scheduler(recording, EOS, 8, 96, K, limits=SchedulerLimits(prefill_chunk=chunk))
    reports: list[list] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        request = GenerationRequest(prompt, 12, temperature=0.0, num_draft_tokens=K)

        def on_step(report, i=i) -> None:
            reports[i].append(report)
            tokens[i].extend(report.new_tokens)

        scheduler.submit(request, on_step, lambda err: pytest.fail(str(err)))
    scheduler.run_until_idle()
    assert tokens == references
    first_steps = [lengths for lengths, _ in seen[: -(-40 // chunk)]]
    assert all(max(lengths) <= chunk for lengths in first_steps), seen[:8]
    assert all(drafts[0] == 0 for _, drafts in seen[: 40 // chunk]), "a piece asked for drafts"
    assert len(reports[2]) > 1 and len(reports[0]) <= len(seen) - 40 // chunk
    assert all(r.new_tokens for rs in reports for r in rs[:-1])  # no empty report delivered
    assert step.draft.cache.num_live == 0 and step.target.cache.num_live == 0


def test_a_chunked_prompt_drafts_from_its_first_decoding_step(pair) -> None:
    """Steps of prefill pieces alone ask for no drafts; the adaptive-drafting plan they would
    hand on says depth 0, and the request's first decoding step would draft nothing. The plan
    before them is carried instead (no plan: draft to the cap)."""
    target, _ = pair
    step = build(target, target)  # a draft that is always right: drafting pays
    drafted: list[tuple[int, int]] = []  # per step: drafts asked, drafted

    def recording(inputs):
        outputs = step(inputs)
        drafted.append((int(inputs.num_draft_tokens.sum()), int(outputs.num_drafted.sum())))
        return outputs

    scheduler = Scheduler(recording, EOS, 8, 96, K, limits=SchedulerLimits(prefill_chunk=K + 2))
    request = GenerationRequest(list(range(1, 41)), 8, temperature=0.0, num_draft_tokens=K)
    assert request.adaptive and request.adaptive_drafting
    generate(scheduler, [request])
    first = next(i for i, (asked, _) in enumerate(drafted) if asked)
    assert first == 40 // (K + 2) and drafted[first][1] > 0, drafted


def test_a_prefill_chunk_smaller_than_a_step_is_refused(pair) -> None:
    with pytest.raises(ValueError, match="prefill_chunk must be 0 or >= 6"):
        Scheduler(build(*pair), EOS, 8, 96, K, limits=SchedulerLimits(prefill_chunk=K + 1))


def test_sampled_output_does_not_depend_on_the_batch(pair) -> None:
    target, draft = pair
    sampled = {"temperature": 1.0, "top_p": 0.9, "num_draft_tokens": K, "adaptive": False}
    request = GenerationRequest([5, 6, 7], 16, random_seed=1234, **sampled)
    others = [
        GenerationRequest(p, 10, temperature=0.8, random_seed=i, num_draft_tokens=K, adaptive=False)
        for i, p in enumerate(PROMPTS)
    ]
    alone = generate(build(target, draft), [request])[0]
    batched = generate(build(target, draft), [others[0], request, *others[1:]])[1]
    assert alone == batched and len(alone) > 0
    reseeded = GenerationRequest([5, 6, 7], 16, random_seed=99, **sampled)
    assert generate(build(target, draft), [reseeded])[0] != alone


def test_failing_sequence_is_isolated_with_real_stages(pair, references) -> None:
    """Caches hold 2 sequences but the batch is 3: the third fails alone, replays are safe."""
    target, draft = pair
    scheduler = Scheduler(build(target, draft, max_sequences=2), EOS, 3, 96, K)
    tokens: dict[int, list[int]] = {}
    errors: dict[int, Exception] = {}
    for i, prompt in enumerate(PROMPTS[:3]):
        scheduler.submit(
            GenerationRequest(prompt, 12, temperature=0.0, num_draft_tokens=K),
            lambda r, i=i: tokens.setdefault(i, []).extend(r.new_tokens),
            lambda e, i=i: errors.setdefault(i, e),
        )
    scheduler.run_until_idle()
    assert list(errors) == [2]
    assert tokens[0] == references[0] and tokens[1] == references[1]
    assert scheduler.counters.step_failures >= 1


def test_from_model_dirs(tmp_path) -> None:
    """A Llama-form pair saved as Hugging Face checkpoints (save_hf_model) loads into a step."""
    target = tiny_model(20, layers=2, width=32, mlp="swiglu", norm_eps=1e-5)
    draft = perturbed(target, 0.3, seed=5)
    save_transformer_dir(tmp_path / "target", target)
    save_transformer_dir(tmp_path / "draft", draft)
    step = SpeculativeStep.from_model_dirs(
        tmp_path / "target", tmp_path / "draft", StepCapacity(K, 4, 64)
    )
    out = generate(
        step,
        [GenerationRequest(PROMPTS[0], 6, temperature=0.0, num_draft_tokens=K)],
        max_context=64,
    )
    # the directory holds float32 weights: compare with a float32 copy of the float64 target
    assert out == [greedy_reference(copy.deepcopy(target).float(), PROMPTS[0], 6)]


def test_mismatched_stages_rejected(pair) -> None:
    target, draft = pair
    a, b = build(target, draft), build(target, draft)
    b.target.max_draft_tokens = K - 1
    with pytest.raises(ValueError, match="drafts"):
        SpeculativeStep(a.draft, a.verifier, b.target)


def test_on_step_sees_every_step_with_its_decision(pair) -> None:
    """The observer hook (measurement tools record rows with it) gets each step's inputs, the
    draft's output, the verifier's decision and the outputs it returns, once per step."""
    target, draft = pair
    step = build(target, draft)
    seen = []
    step.on_step = lambda inputs, drafted, decision, outputs: seen.append(
        (inputs.batch_size, drafted.num_drafted.tolist(), decision.num_verify.tolist(), outputs)
    )
    scheduler = Scheduler(step, EOS, 4, 96, K)
    request = GenerationRequest(PROMPTS[0], 6, temperature=0.0, num_draft_tokens=K)
    scheduler.submit(request, lambda report: None, print)
    scheduler.run_until_idle()
    assert len(seen) == scheduler.counters.steps
    decode = [row for row in seen if row[0] == 1]  # the rest: the release-only last call
    assert decode and len(seen) - len(decode) <= 1
    for _, drafted, verified, _ in decode:
        assert all(v <= d for v, d in zip(verified, drafted, strict=True))


class _RecordingDraft:
    """Wraps a draft stage and keeps every drafted token that counts (within num_drafted)."""

    def __init__(self, stage) -> None:
        self.stage = stage
        self.tokens: list[int] = []

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def __call__(self, inputs):
        out = self.stage(inputs)
        for row, n in zip(out.draft_tokens.tolist(), out.num_drafted.tolist(), strict=True):
            self.tokens.extend(row[:n])
        return out


def test_padded_vocab_rows_are_never_drafted_or_sampled() -> None:
    """Embedding rows past the tokenizer's size (vocab_limit) get -inf logits in both stages."""
    limit = 200
    target, draft = fresh_pair()
    with torch.no_grad():
        for model in (target, draft):  # padded rows dominate the tied output layer
            model.embed.weight[limit:] *= 40.0
    requests = [
        GenerationRequest(p, 12, temperature=t, random_seed=s, num_draft_tokens=K)
        for p in PROMPTS
        for t, s in ((0.0, 0), (1.0, 3), (1.5, 9))
    ]
    unmasked = generate(build(target, draft, 16), requests, max_context=96)
    assert any(t >= limit for out in unmasked for t in out), "control: padded rows win unmasked"

    step = SpeculativeStep.from_models(
        target, draft, StepCapacity(K, 16, 96),
        cost=StepCost.linear(0.1, 0.01, 1.0, 1.0, max_rows=64, max_tokens=512),
        vocab_limit=limit,
    )  # fmt: skip
    step.draft = _RecordingDraft(step.draft)
    masked = generate(step, requests, max_context=96)
    assert all(t < limit for out in masked for t in out)
    assert step.draft.tokens and all(t < limit for t in step.draft.tokens)
    # greedy output is the target's greedy decoding over the real tokens only
    for request, out in zip(requests, masked, strict=True):
        if request.temperature == 0.0:
            tokens: list[int] = []
            for _ in range(12):
                logits = target(torch.tensor([request.prompt_ids + tokens]))[0, -1, :limit]
                tokens.append(int(logits.float().argmax()))
            assert out == tokens


def test_vocab_limit_must_fit_the_model(pair) -> None:
    target, draft = pair
    for bad in (0, target.config.vocab_size + 1):
        with pytest.raises(ValueError, match="vocab_limit"):
            SpeculativeStep.from_models(target, draft, StepCapacity(K, 4, 64), vocab_limit=bad)
    step = SpeculativeStep.from_models(target, draft, StepCapacity(K, 4, 64), vocab_limit=257)
    assert step.draft.vocab_limit is None and step.target.vocab_limit is None  # nothing padded


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"input_lengths": torch.tensor([9], dtype=torch.int32)}, r"input_lengths\[0\] = 9"),
        ({"temperature": torch.tensor([1.0, 1.0])}, "temperature must have shape"),
        ({"num_draft_tokens": torch.tensor([K + 1], dtype=torch.int32)}, "num_draft_tokens"),
        ({"top_p": torch.tensor([1.5])}, "top_p must lie in"),
    ],
)
def test_bad_step_inputs_are_refused_once_at_the_draft_stage(pair, change, match) -> None:
    """Validation once: the step's inputs are checked where they enter the draft stage, the
    first stage of a step, before any stage's state changes; the verifier and the target trust
    them (their `check_values` is off)."""
    step = build(*pair)
    assert not step.verifier.check_values and not step.target.check_values
    good = make_inputs([{"seq_id": 1, "tokens": [5, 6, 7]}])
    with pytest.raises(ValueError, match=match):
        step(replace(good, **change))
    assert not step.draft.slots._generators and not step.target.slots._generators
    assert step.verifier.num_steps == 0
    step(good)  # the pair still serves
    assert step.verifier.num_steps == 1
