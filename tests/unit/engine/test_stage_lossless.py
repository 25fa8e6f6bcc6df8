"""Sampled losslessness through the real stages: Scheduler -> draft -> verifier -> target.

tests/unit/av/test_lossless.py proves the algorithm on synthetic tables; this test proves the
wiring: the draft stage's warped q, the verifier's trimming with a binding budget, the target
stage's warped p and rejection sampling, and the scheduler's bookkeeping across two steps.

Test: 2,048 requests (one prompt, distinct seeds, batches of 64, temperature 0.7, top-p 0.8,
K = 4, AV on with a verify cost steep enough that the budget trims drafts), K + 1 tokens each,
of which the first two are compared. The draft is a lightly perturbed copy of the target, so
drafts are accepted often (about 0.77) and the trimming, acceptance and residual paths all
run. The exact law of the first two tokens under the target alone is p(y1) p(y2 | y1), both
warped the same way. A chi-square test over the cells expected to hold >= 5 samples (the rest
pooled) must give p > 1e-4. The same harness must reject (p < 1e-6) a pipeline whose target
rejection-samples against a q other than the one the drafts were drawn from (q mixed
half-and-half with uniform): a plausible wiring bug that greedy tests cannot see.

A reduced draft vocabulary (avspec.engine.draft_vocab): the draft stage keeps the 206 of 257 ids
not congruent to 4 mod 5 (q = 0 at the others); the target's first token falls outside the map
with probability 0.49 and its second with 0.20, so those tokens come only from the residual. The
same 2,048 requests and thresholds: the law must pass (p > 1e-4), and two broken maps, each
verifying against a q other than the drafts' (q of the whole vocabulary reported for drafts drawn
from the map; each drawn index mapped one id too high, q reported for the intended ids), must
be rejected (p < 1e-6).

A draft head (avspec.runtime.head) over the same target, started from its one block: drafts
from the target's features, the same 2,048 requests and thresholds; the wrong-q pipeline with
the head must be caught too.

On llama.cpp's engine (`avspec.runtime.llamacpp`): a tiny Llama written as an f32 GGUF, its draft
a perturbed copy, both stages on the engine; the law is the engine's own (its logits after the
prompt and after each first token, warped the same way), the same 2,048 requests and thresholds,
and the wrong-q pipeline must be caught there too.

`AVSPEC_TEST_DEVICE=cuda` runs the stages on a GPU (the target stage's one-pass verification,
the CUDA path; the CPU walks depth by depth); the exact law is computed on the CPU either way.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from helpers.stages import perturbed, tiny_model

from avspec.av.step_cost import StepCost
from avspec.contract import StepInputs, StepOutputs, VerifierInputs
from avspec.engine.draft_stage import DraftOutput, DraftStage, _Draw
from avspec.engine.draft_vocab import DraftVocab
from avspec.engine.sampling import draft_warp, warp_probs
from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep, StepCapacity
from avspec.runtime.head import new_head

pytestmark = pytest.mark.usefixtures("single_thread")

K, BATCH, REQUESTS = 4, 64, 2048
TEMPERATURE, TOP_P = 0.7, 0.8
PROMPT = [5, 17, 200, 3]
NO_EOS = 10_000  # the tiny models' vocabulary has no EOS: requests always get two tokens
PASS, FAIL = 1e-4, 1e-6
VOCAB = 257  # the tiny models'
KEPT = [t for t in range(VOCAB) if t % 5 != 4]  # the reduced draft vocabulary: 206 ids
DEVICE = torch.device(os.environ.get("AVSPEC_TEST_DEVICE", "cpu"))


def _pair():
    """Target and a lightly perturbed copy: q overlaps p (about 0.77 of drafts accepted)."""
    target = tiny_model(31, layers=1, width=32)
    return target, perturbed(target, 0.05, seed=5)


def _build(target, draft, draft_top_k: int = 0) -> SpeculativeStep:
    cost = StepCost.linear(0.1, 0.01, 1.0, 0.05, max_rows=128, max_tokens=2048)
    return SpeculativeStep.from_models(
        _on_device(target), _on_device(draft), StepCapacity(K, BATCH + 4, 32), DEVICE, cost,
        draft_top_k=draft_top_k,
    )  # fmt: skip


def _on_device(model):
    """A copy of `model` on DEVICE (the CPU model stays for the exact law)."""
    copy = type(model)(model.config).double().eval()
    copy.load_state_dict(model.state_dict())
    return copy.to(DEVICE)


def _sample(
    step_fn, seed_base: int, drafting: bool = True, prompt: list[int] = PROMPT, skip: int = 0
) -> torch.Tensor:
    """Counts [vocab, vocab] of the two generated tokens after the first `skip` over REQUESTS
    requests for `prompt`."""
    scheduler = Scheduler(step_fn, NO_EOS, BATCH, 32, K)
    tokens: list[list[int]] = [[] for _ in range(REQUESTS)]
    errors: list[Exception] = []
    for i in range(REQUESTS):
        request = GenerationRequest(
            list(prompt), K + 1 + skip, TEMPERATURE, TOP_P, random_seed=seed_base + i,
            num_draft_tokens=K, adaptive_drafting=drafting,
        )  # fmt: skip
        scheduler.submit(request, lambda r, i=i: tokens[i].extend(r.new_tokens), errors.append)
    scheduler.run_until_idle()
    assert not errors, "".join(traceback.format_exception(errors[0]))
    pairs = torch.tensor([t[skip : skip + 2] for t in tokens])  # [requests, 2]
    vocab = step_fn_vocab(step_fn)
    return torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).view(
        vocab, vocab
    )


def step_fn_vocab(step_fn) -> int:
    return step_fn.step.target.model.vocab_size


def _exact_law(target, prompt: list[int] = PROMPT) -> torch.Tensor:
    """p(y1) p(y2 | y1) [vocab, vocab] after `prompt` under the target alone, warped like the
    stages warp."""
    vocab = target.config.vocab_size

    def warped(contexts: torch.Tensor) -> torch.Tensor:  # contexts [batch, seq] -> [batch, vocab]
        logits = target(contexts)[:, -1:].float()  # (batch, 1, vocab)
        n = contexts.shape[0]
        temperature, top_p = torch.full((n,), TEMPERATURE), torch.full((n,), TOP_P)
        return warp_probs(logits, temperature, top_p)[:, 0].double()

    first = warped(torch.tensor([prompt]))[0]  # [vocab]
    contexts = torch.tensor([prompt + [y] for y in range(vocab)])
    return first[:, None] * warped(contexts)  # [vocab, vocab]


def _p_value(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square goodness of fit; cells expected below 5 pooled into one."""
    expected = law.flatten() * counts.sum()
    observed = counts.flatten().double()
    big = expected >= 5
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))


class _Counted:
    """The served step, counting drafts asked for, drafts not drafted (stopped) and verified."""

    def __init__(self, step: SpeculativeStep) -> None:
        self.step = step
        self.drafted = self.verified = self.stopped = 0
        draft = step.draft

        def counting_draft(inputs: StepInputs) -> DraftOutput:
            out = draft(inputs)
            self.stopped += int((inputs.num_draft_tokens - out.num_drafted.cpu()).sum())
            return out

        step.draft = counting_draft

    def __call__(self, inputs: StepInputs) -> StepOutputs:
        outputs = self.step(inputs)
        self.drafted += int(inputs.num_draft_tokens.sum())
        self.verified += int(outputs.num_verify.sum())
        return outputs


class _WrongQ(_Counted):
    """The broken pipeline: the target is told a q other than the drafts' (q/2 + uniform/2)."""

    def __call__(self, inputs: StepInputs) -> StepOutputs:
        step = self.step
        drafted = step.draft(inputs)
        device = drafted.draft_features.device
        decision = step.verifier.step(
            VerifierInputs(
                inputs.seq_ids,
                drafted.draft_features,
                inputs.num_draft_tokens.to(device),
                inputs.adaptive.to(device),
                inputs.prev_num_accepted.to(device),
                inputs.release_seq_ids,
                int((inputs.input_lengths - inputs.reusable).sum()),
            )  # fmt: skip
        )
        q = drafted.draft_probs
        wrong = 0.5 * q + 0.5 / q.shape[-1]
        return step.target(inputs, drafted.draft_tokens, wrong, decision.num_verify)


class _ReportsFullVocabulary(DraftStage):
    """BROKEN: drafts drawn from the kept ids, q reported from the full model's logits."""

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        self.full_logits = self.model.logits(hidden)  # [rows, vocab]
        return super()._head(hidden)

    def _draft_position(
        self, position: int, draw: _Draw, logits: torch.Tensor, out: DraftOutput, drafting
    ) -> torch.Tensor:
        features = super()._draft_position(position, draw, logits, out, drafting)
        full = self.full_logits  # [rows of draw, vocab] at every position
        q = draft_warp(self.mask_vocab(full[:, None].clone()), draw.temperature, draw.top_p,
                       self.top_k)[:, 0]  # fmt: skip
        out.draft_probs[draw.index, position] = q[:, : self.vocab_width]
        return features


class _MisplacedScatter(DraftStage):
    """BROKEN: a drawn index lands one id too high; q is reported for the intended ids."""

    def _token_ids(self, drawn: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return (self.head.index[drawn] + 1) % VOCAB


def _with_map(step: SpeculativeStep, stage: type[DraftStage] = DraftStage) -> SpeculativeStep:
    """`step` with its draft stage replaced by one on the reduced vocabulary KEPT."""
    draft = step.draft.model
    step.draft = stage(draft, draft.new_cache(BATCH + 4, 32, DEVICE), K,
                       draft_vocab=DraftVocab.of(KEPT, VOCAB))  # fmt: skip
    return step


@pytest.mark.parametrize("drafting", [False, True], ids=["fixed-drafting", "adaptive-drafting"])
def test_stages_sample_the_target_law_with_trimming(drafting: bool):
    target, draft = _pair()
    step = _Counted(_build(target, draft))
    counts = _sample(step, seed_base=0, drafting=drafting)
    assert 0 < step.verified < 0.9 * step.drafted  # the budget binds: drafts were trimmed
    if drafting:  # the plan's stop binds: rows drafted less than their cap
        assert 0.05 * step.drafted < step.stopped
    else:
        assert step.stopped == 0
    assert _p_value(counts, _exact_law(target)) > PASS


def test_a_draft_sampling_its_top_k_keeps_the_target_law():
    """The draft's own warp (top 2 of 257 tokens within top-p, `draft_warp`): q differs from
    the target's warp, the output law must not; 2,048 requests, threshold as above."""
    target, draft = _pair()
    step = _Counted(_build(target, draft, draft_top_k=2))
    counts = _sample(step, seed_base=0, drafting=True)
    assert step.verified > 0
    assert _p_value(counts, _exact_law(target)) > PASS


def test_wrong_q_in_the_target_is_caught():
    target, draft = _pair()
    counts = _sample(_WrongQ(_build(target, draft)), seed_base=0)
    assert _p_value(counts, _exact_law(target)) < FAIL


# A head drafts from a request's second step (the target has not run the prompt before), so its
# law is tested on the second and third tokens, after a prompt whose first token is certain.
# The nucleus after HEAD_PROMPT is {187}; the law of the next two tokens has 19 cells expected to
# hold >= 5 of 2,048 samples (6 second tokens). The prompt before it had a law of 4 cells, the
# third token certain given the second: a wrong q hardly moved it (p from 0.004 to 0.7 across
# seeds, q replaced by uniform or rolled by one id alike); here it is caught at p < 1e-15 at
# each of 4 seeds.
HEAD_PROMPT, HEAD_FIRST = [221, 140, 104, 143], 187


def _head_pair():
    """The target of `_pair` and a draft head started from its one block (avspec.runtime.head).
    The head's own layers are drawn from a fixed seed, so that every process tests the same
    head."""
    target, _ = _pair()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = new_head(_pair()[0].float(), init_layer=0)
    return target, head.double().eval()


def _head_law(target) -> torch.Tensor:
    first = _exact_law(target, HEAD_PROMPT).sum(1)
    assert abs(float(first[HEAD_FIRST]) - 1.0) < 1e-6
    return _exact_law(target, [*HEAD_PROMPT, HEAD_FIRST])


def test_a_draft_head_keeps_the_target_law():
    """The head drafting (features from the target stage, entries and guesses in its cache),
    AV and adaptive drafting on; 2,048 requests, thresholds as above."""
    target, head = _head_pair()
    step = _Counted(_build(target, head))
    counts = _sample(step, seed_base=0, drafting=True, prompt=HEAD_PROMPT, skip=1)
    assert 0 < step.verified < 0.9 * step.drafted
    assert _p_value(counts, _head_law(target)) > PASS


def test_wrong_q_with_a_draft_head_is_caught():
    target, head = _head_pair()
    counts = _sample(_WrongQ(_build(target, head)), 0, prompt=HEAD_PROMPT, skip=1)
    assert _p_value(counts, _head_law(target)) < FAIL


@pytest.mark.parametrize("drafting", [False, True], ids=["fixed-drafting", "adaptive-drafting"])
def test_a_reduced_draft_vocabulary_keeps_the_target_law(drafting: bool):
    """The draft on 206 of 257 ids (q = 0 elsewhere), AV on, drafting to the cap or adaptive:
    the drafts lie in the map, tokens outside it are emitted (from the residual), the law is
    the target's; 2,048 requests, threshold as above."""
    target, draft = _pair()
    step = _Counted(_with_map(_build(target, draft)))
    drafted: list[torch.Tensor] = []
    step.step.on_step = lambda inputs, out, decision, outputs: drafted.append(
        out.draft_tokens[:, : out.draft_probs.shape[1]][out.draft_probs.sum(-1) > 0]
    )
    counts = _sample(step, seed_base=0, drafting=drafting)
    assert 0 < step.verified < 0.9 * step.drafted
    outside = torch.tensor([t % 5 == 4 for t in range(VOCAB)])
    assert not outside[torch.cat(drafted).long().cpu()].any()  # never drafted outside the map
    assert counts[outside].sum() > 0.4 * REQUESTS  # but the target emits them
    assert _p_value(counts, _exact_law(target)) > PASS


@pytest.mark.parametrize("broken", [_ReportsFullVocabulary, _MisplacedScatter],
                         ids=["reports-full-vocabulary", "misplaced-scatter"])  # fmt: skip
def test_a_broken_draft_vocabulary_map_is_caught(broken: type[DraftStage]):
    """The fixed-drafting case above with a broken map: every row drafts its cap, so every
    request's drafts go through the map (adaptive drafting on this batch of 64 verifies few:
    the plan mostly stops, and a probe takes 8 rows)."""
    target, draft = _pair()
    counts = _sample(_Counted(_with_map(_build(target, draft), broken)), 0, drafting=False)
    assert _p_value(counts, _exact_law(target)) < FAIL


def _gguf_pair(root):
    """(target path, draft path): a tiny Llama as an f32 GGUF and a perturbed copy (noise of
    0.1 of each matrix's spread), sharing the tokenizer metadata."""
    from helpers.gguf_files import TinyLlama, llama_weights, write_llama_gguf  # noqa: PLC0415

    shape = TinyLlama()
    weights = llama_weights(shape, seed=3)
    gen = torch.Generator().manual_seed(4)
    noisy = {
        name: w + 0.1 * w.std() * torch.randn(w.shape, generator=gen) if w.dim() == 2 else w
        for name, w in weights.items()
    }
    return (write_llama_gguf(root / "target.gguf", shape, weights),
            write_llama_gguf(root / "draft.gguf", shape, noisy))  # fmt: skip


def _gguf_models(paths):
    from avspec.runtime.llamacpp.model import EngineSettings, GGUFModel  # noqa: PLC0415

    rows = BATCH + 4
    settings = EngineSettings(max_sequences=rows, pool_tokens=rows * 32,
                              max_outputs=rows * (K + 1), threads=1, max_length=32)  # fmt: skip
    return [GGUFModel(path, settings) for path in paths]


def _engine_law(path) -> torch.Tensor:
    """p(y1) p(y2 | y1) [vocab, vocab] from the engine's own logits (a context of its own)."""
    (model,) = _gguf_models([path])
    vocab = model.vocab_size

    def warped(contexts: list[list[int]]) -> torch.Tensor:
        pool = model.new_cache()
        ids = list(range(len(contexts)))
        for i in ids:
            pool.allocate(i)
        lengths = [len(c) for c in contexts]
        last = torch.tensor(lengths).cumsum(0) - 1
        tokens = torch.tensor([t for c in contexts for t in c])
        logits = model.forward_cached(pool, ids, tokens, lengths, at=last).clone()[:, None]
        n = len(contexts)
        temperature, top_p = torch.full((n,), TEMPERATURE), torch.full((n,), TOP_P)
        return warp_probs(logits, temperature, top_p)[:, 0].double()

    first = warped([PROMPT])[0]
    second = torch.cat([warped([PROMPT + [y] for y in range(start, min(start + 64, vocab))])
                        for start in range(0, vocab, 64)])  # fmt: skip
    return first[:, None] * second


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    from helpers.ci import missing_tool  # noqa: PLC0415

    from avspec.runtime.llamacpp.binding import EngineUnavailable, llama_cpp  # noqa: PLC0415

    try:
        llama_cpp()
    except EngineUnavailable as err:
        missing_tool(str(err), "make llamacpp")
    paths = _gguf_pair(tmp_path_factory.mktemp("gguf_pair"))
    return paths, _engine_law(paths[0])


def _gguf_step(paths) -> SpeculativeStep:
    target, draft = _gguf_models(paths)
    cost = StepCost.linear(0.1, 0.01, 1.0, 0.05, max_rows=128, max_tokens=2048)
    return SpeculativeStep.from_models(target, draft, StepCapacity(K, BATCH + 4, 32), "cpu", cost)


def test_llamacpp_stages_sample_the_engines_law(gguf_pair):
    paths, law = gguf_pair
    step = _Counted(_gguf_step(paths))
    counts = _sample(step, seed_base=0, drafting=True)
    assert step.verified > 0 and step.verified < step.drafted  # drafts verified, some trimmed
    assert _p_value(counts, law) > PASS


def test_wrong_q_on_llamacpp_is_caught(gguf_pair):
    paths, law = gguf_pair
    counts = _sample(_WrongQ(_gguf_step(paths)), seed_base=0)
    assert _p_value(counts, law) < FAIL
