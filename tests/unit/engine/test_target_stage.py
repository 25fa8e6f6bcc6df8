"""Target stage: verification matches full recomputation across accept/reject cycles; errors.

The pieces with a contract of their own are checked alone too: the packing of the ragged batch
and the target probabilities it yields.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.stages import K, make_inputs, make_target_stage, tiny_model

from avspec.contract import read_step_inputs
from avspec.engine.sampling import uniform_noise
from avspec.engine.stage import TARGET_SALT
from avspec.engine.target_stage import OutputLayer, TargetStage, pack_verify_batch
from avspec.runtime.transformer import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")


def greedy(model: Transformer, context: list[int], count: int) -> list[int]:
    tokens = list(context)
    for _ in range(count):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(context) :]


def uniform_probs(batch: int) -> torch.Tensor:
    return torch.full((batch, K, 257), 1.0 / 257)


def test_greedy_verification_over_accept_reject_cycles() -> None:
    """Drafts right for the first `m` positions then wrong; 5 steps, 3 sequences, varied verify."""
    model = tiny_model(10)
    stage = make_target_stage(model)
    rng = torch.Generator().manual_seed(0)
    seqs = {1: [3, 1, 4, 1, 5], 2: [2, 7], 3: [8]}
    num_draft = {1: K, 2: 3, 3: 0}
    pending = {s: (list(c), 0) for s, c in seqs.items()}
    starts = dict.fromkeys(seqs, 0)
    for _ in range(5):
        rows, drafts, verify, expect = [], torch.zeros(3, K, dtype=torch.int32), [], []
        for r, (s, committed) in enumerate(seqs.items()):
            n = num_draft[s]
            truth = greedy(model, committed, K + 1)
            right = int(torch.randint(0, n + 1, (), generator=rng))
            row = truth[:K]
            if right < n:
                row[right] = (row[right] + 1) % 256
            drafts[r] = torch.tensor(row)
            v = int(torch.randint(0, n + 1, (), generator=rng))
            verify.append(v)
            expect.append((min(right, v), truth))
            rows.append({"seq_id": s, "tokens": pending[s][0], "start": starts[s],
                         "reusable": pending[s][1], "n": n, "temperature": 0.0})  # fmt: skip
        out = stage(make_inputs(rows), drafts, uniform_probs(3), torch.tensor(verify))
        assert out.output_ids.shape == (3, K + 1) and out.num_verify.tolist() == verify
        for r, (s, committed) in enumerate(seqs.items()):
            accepted, truth = expect[r]
            assert int(out.num_accepted[r]) == accepted
            new = out.output_ids[r, : accepted + 1].tolist()
            assert new == truth[: accepted + 1]
            assert stage.cache.length(s) == len(committed) + accepted
            starts[s] = len(committed)
            committed += new
            pending[s] = (new, accepted)


def test_exact_draft_probs_are_all_accepted_at_temperature_one() -> None:
    """q = the target's own p (full recomputation) => every verified draft is accepted."""
    model = tiny_model(11)
    stage = make_target_stage(model)
    context = [5, 6, 7, 8]
    gen = torch.Generator().manual_seed(3)
    tokens, probs = list(context), []
    for _ in range(K):
        p = torch.softmax(model(torch.tensor([tokens]))[0, -1].float(), dim=-1)
        probs.append(p)
        tokens.append(int(torch.multinomial(p, 1, generator=gen)))
    drafts = torch.tensor([tokens[4:]], dtype=torch.int32)
    inputs = make_inputs([{"seq_id": 1, "tokens": context, "seed": 9}])
    out = stage(inputs, drafts, torch.stack(probs)[None], torch.tensor([K]))
    assert int(out.num_accepted[0]) == K
    assert out.output_ids[0, :K].tolist() == tokens[4:]


def test_pack_verify_batch_rows_and_verified_positions() -> None:
    """Row 0 runs 2 pending inputs and 2 drafts, row 1 its 2 inputs and no draft."""
    input_ids = torch.tensor([[10, 11, 12], [20, 21, 0]], dtype=torch.int32)
    drafts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    packed = pack_verify_batch(input_ids, [1, 0], [3, 2], drafts, [2, 0])
    assert packed.tokens.dtype == torch.int64
    assert packed.tokens.tolist() == [11, 12, 1, 2, 20, 21]
    assert packed.lengths == [4, 2]
    # position j (0..num_verify) reads the token before draft j; no position past num_verify
    assert packed.positions.tolist() == [1, 2, 3, 5]
    assert packed.first.tolist() == [0, 3] and packed.rows.tolist() == [0, 0, 0, 1]


def test_target_probs_match_full_recomputation_at_the_verified_positions() -> None:
    """p at position j is the target's distribution after context + drafts[:j] (j <= verify);
    no other position is warped."""
    model = tiny_model(16)
    stage = make_target_stage(model)
    context, drafts = [5, 6, 7, 8], [9, 10, 11, 12]
    inputs = make_inputs([{"seq_id": 1, "tokens": context}])
    step = read_step_inputs(inputs, K)
    with torch.inference_mode():
        offsets = stage.slots.prepare(step)
        packed = pack_verify_batch(
            inputs.input_ids, offsets, step.input_lengths, torch.tensor([drafts]), [2]
        )
        hidden = model.forward_cached(stage.cache, step.seq_ids, packed.tokens, packed.lengths,
                                      hidden=True, at=packed.positions)  # fmt: skip
        warp = inputs.temperature.float()[packed.rows], inputs.top_p.float()[packed.rows]
        logits = OutputLayer(model, hidden, packed, torch.tensor([2]), stage.mask_vocab)
        probs = stage._probs_at(logits, *warp, torch.arange(3))
    assert probs.shape == (3, 257)
    for j in range(3):
        logits = model(torch.tensor([context + drafts[:j]]))[0, -1]
        expected = torch.softmax(logits.float(), dim=-1)
        torch.testing.assert_close(probs[j].float(), expected, atol=1e-6, rtol=1e-5)


def test_release_and_empty_batch() -> None:
    stage = make_target_stage(tiny_model(12, layers=1))
    stage(make_inputs([{"seq_id": 4, "tokens": [1, 2]}]), torch.zeros(1, K, dtype=torch.int32),
          uniform_probs(1), torch.tensor([2]))  # fmt: skip
    assert stage.cache.has(4)
    empty = torch.zeros(0, K, dtype=torch.int32)
    out = stage(
        make_inputs([], release=[4]), empty, uniform_probs(0), torch.zeros(0, dtype=torch.int32)
    )
    assert out.output_ids.shape == (0, K + 1) and not stage.cache.has(4)


def test_idle_timeout_frees() -> None:
    now = [0.0]
    stage = make_target_stage(tiny_model(13, layers=1), idle_timeout_s=1.0, clock=lambda: now[0])
    one = (torch.zeros(1, K, dtype=torch.int32), uniform_probs(1), torch.tensor([0]))
    stage(make_inputs([{"seq_id": 1, "tokens": [1]}]), *one)
    now[0] = 2.0
    stage(make_inputs([{"seq_id": 2, "tokens": [1]}]), *one)
    assert not stage.cache.has(1) and stage.cache.has(2)


@pytest.mark.parametrize(
    ("verify", "drafts_shape", "probs_shape", "match"),
    [
        ([K], (1, K), (1, K, 257), "num_verify"),
        ([-1], (1, K), (1, K, 257), "num_verify"),
        ([0, 0], (1, K), (1, K, 257), "num_verify"),
        ([0], (1, K + 1), (1, K, 257), "draft_tokens"),
        ([0], (1, K), (1, K, 10), "draft_probs"),
    ],
)
def test_bad_verify_inputs(verify, drafts_shape, probs_shape, match) -> None:
    stage = make_target_stage(tiny_model(14, layers=1), check_values=True)
    inputs = make_inputs([{"seq_id": 1, "tokens": [1], "n": 2}])
    with pytest.raises(ValueError, match=match):
        stage(inputs, torch.zeros(drafts_shape, dtype=torch.int32), torch.zeros(probs_shape),
              torch.tensor(verify))  # fmt: skip
    assert not stage.cache.has(1), "validation fails before any cache change"


def test_constructor_validation() -> None:
    model = tiny_model(15, layers=1)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        TargetStage(model, model.new_cache(1, 8, "cpu", torch.float64), 0)


# The target stage before it warped only the verified positions, kept as the reference: every
# row's K + 1 positions (past num_verify the bonus position repeated) through the old warp, then
# the old rejection core. A copy of that code, so the comparison cannot share a bug with it.


def _old_nucleus_by_topk(probs, top_p, skip):
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    row_top_p = top_p.expand(*probs.shape[:-1], 1).reshape(-1)
    n_keep = torch.ones(rows.shape[0], dtype=torch.int64)
    last = rows.amax(dim=-1)
    pending = (~skip.expand(*probs.shape[:-1], 1).reshape(-1)).nonzero()[:, 0]
    for k in (min(vocab, 64), vocab):
        if not len(pending):
            break
        if k < vocab:
            values = torch.topk(rows[pending], k, dim=-1).values
        else:
            values = torch.from_numpy(np.sort(rows[pending].numpy(), axis=-1)[:, ::-1].copy())
        mass_before = torch.cumsum(values, dim=-1) - values
        count = (mass_before < row_top_p[pending, None]).sum(-1)
        n_keep[pending] = count
        last[pending] = values.gather(-1, (count - 1)[:, None])[:, 0]
        pending = pending[count == k]
    above = rows > last[:, None]
    ties = rows == last[:, None]
    needed = n_keep - above.sum(-1)
    keep = above | (ties & (torch.cumsum(ties, dim=-1) <= needed[:, None]))
    return keep.reshape(probs.shape)


def _old_warp_probs(logits, temperature, top_p):
    logits = logits.float()
    greedy = (temperature == 0)[:, None, None]
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / scale[:, None, None], dim=-1)
    top_p = top_p[:, None, None]
    whole = top_p >= 1.0
    keep = _old_nucleus_by_topk(probs, top_p, whole) | whole
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    probs = kept / kept.sum(dim=-1, keepdim=True)
    ids = torch.arange(logits.shape[-1])
    is_max = logits == logits.max(dim=-1, keepdim=True).values
    first = torch.where(is_max, ids, logits.shape[-1]).min(dim=-1, keepdim=True).values
    return torch.where(greedy, (ids == first).float(), probs)


def _old_inverse_cdf(probs, uniforms):
    cumulative = torch.cumsum(probs.double(), dim=-1)
    point = (uniforms * cumulative[..., -1])[..., None]
    token = torch.searchsorted(cumulative, point, right=True)[..., 0]
    ids = torch.arange(probs.shape[-1])
    return torch.minimum(token, torch.where(probs > 0, ids, -1).amax(dim=-1))


def _old_rejection(draft_tokens, draft_probs, target_probs, num_verify, uniforms, draw):
    batch, num_pos = draft_tokens.shape
    tokens = draft_tokens.long()
    p, q = target_probs.float(), draft_probs.float()
    p_draft = p[:, :num_pos].gather(-1, tokens[..., None]).squeeze(-1)
    q_draft = q.gather(-1, tokens[..., None]).squeeze(-1)
    verified = torch.arange(num_pos)[None, :] < num_verify[:, None].long()
    accepted = (uniforms * q_draft < p_draft) & verified
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    rows = torch.arange(batch)
    p_at = p[rows, num_accepted]
    q_at = q[rows, num_accepted.clamp(max=num_pos - 1)]
    rejected = (num_accepted < num_verify.long())[:, None]
    residual = torch.where(rejected, (p_at - q_at).clamp_min(0), p_at)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_at)
    last = _old_inverse_cdf(residual, draw)
    out_pos = torch.arange(num_pos + 1)[None, :]
    padded = torch.cat([tokens, torch.full((batch, 1), -1)], dim=-1)
    output_ids = torch.where(out_pos < num_accepted[:, None], padded, -1)
    output_ids = torch.where(out_pos == num_accepted[:, None], last[:, None], output_ids)
    return output_ids.int(), num_accepted.int()


def _old_path_case(model: Transformer, seed: int, vocab_limit: int | None, batch: int | None = None,
                   verify: list[int] | None = None, **fixed: float) -> dict[str, int]:  # fmt: skip
    """One random step through a fresh stage and through the reference: asserts the same p at
    the positions the stage warped, which are each row's accepted drafts and the position its
    token is drawn at and no other (the same nucleus, bit for bit where the stage's warp sums a
    vocabulary-wide row as the reference does, within 1e-6 relative where it renormalises a
    short nucleus by the sum of its own values: `top_p._top_p_cpu`), the same output_ids and
    num_accepted; returns what the step exercised. `fixed`: temperature, top_p or scale (of the
    logits) for every row.

    The model's logits are replaced by random bf16 ones (ties at the nucleus edge, flat rows
    past the first 64 values), drafts are often the argmax (accepted), q is p's neighbour.
    """
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=gen))]

    vocab = model.config.vocab_size
    width = vocab_limit or vocab
    batch = batch or int(torch.randint(1, 6, (), generator=gen))
    verify = verify or torch.randint(0, K + 1, (batch,), generator=gen).tolist()
    contexts = [torch.randint(0, width, (pick([1, 2, 5]),), generator=gen) for _ in range(batch)]
    lengths = [len(c) + v for c, v in zip(contexts, verify, strict=True)]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    gather = torch.tensor([[starts[r] + len(contexts[r]) - 1 + min(j, verify[r])
                            for j in range(K + 1)] for r in range(batch)])  # fmt: skip
    scale = torch.tensor([pick([0.2, 1.0, 4.0]) for _ in range(sum(lengths))])[:, None]
    scale = torch.full_like(scale, fixed["scale"]) if "scale" in fixed else scale
    logits = (torch.randn(sum(lengths), vocab, generator=gen) * scale).bfloat16()
    at_position = logits[gather[:, :K]].float()[..., :width]  # [batch, K, width]
    q = torch.softmax(at_position + torch.randn(at_position.shape, generator=gen), dim=-1)
    q = q.to(pick([torch.float32, torch.float64]))
    drafts = torch.where(torch.rand(batch, K, generator=gen) < 0.6, at_position.argmax(-1),
                         torch.randint(0, width, (batch, K), generator=gen))  # fmt: skip
    rows = [{"seq_id": r + 1, "tokens": contexts[r].tolist(), "seed": seed * 10 + r,
             "temperature": pick([0.0, 0.7, 1.0, 1.5]), "top_p": pick([1.0, 0.95, 0.5, 0.05])}
            for r in range(batch)]  # fmt: skip
    for row in rows:  # the warp's shortcuts: every row greedy, no row filtered
        if seed % 8 == 0:
            row["temperature"] = 0.0
        elif seed % 8 == 4:
            row["top_p"] = 1.0
        row.update((key, value) for key, value in fixed.items() if key != "scale")
    inputs = make_inputs(rows)

    stage = make_target_stage(model, vocab_limit=vocab_limit)
    real_forward, real_probs_at = model.forward_cached, stage._probs_at
    warped: list[tuple[torch.Tensor, torch.Tensor]] = []  # (packed positions, p) as warped

    def forward_cached(*args, at=None, hidden=False, **kwargs):
        assert real_forward(*args, **kwargs).shape[0] == logits.shape[0]  # grows the cache
        return logits.clone() if at is None else logits[at].clone()  # its "hidden": the logits

    def probs_at(*args):
        warped.append((args[-1].clone(), real_probs_at(*args)))
        return warped[-1][1]

    model.forward_cached, model.logits = forward_cached, torch.clone
    stage._probs_at = probs_at
    try:
        out = stage(inputs, drafts.int(), q, torch.tensor(verify))
    finally:
        del model.forward_cached, model.logits

    full = logits[gather].clone()
    if vocab_limit is not None:
        full[..., vocab_limit:] = float("-inf")
    p = _old_warp_probs(full, inputs.temperature, inputs.top_p)[..., :width]
    generators = [torch.Generator().manual_seed((row["seed"] ^ TARGET_SALT) & ((1 << 63) - 1))
                  for row in rows]  # fmt: skip
    noise = uniform_noise(generators, (K + 1,), torch.device("cpu"))
    output_ids, num_accepted = _old_rejection(
        drafts, q, p, torch.tensor(verify), noise[:, :K], noise[:, K]
    )
    verified = torch.arange(K + 1)[None, :] <= torch.tensor(verify)[:, None]
    at = torch.cat([positions for positions, _ in warped])
    stage_p, reference_p = torch.cat([probs for _, probs in warped]), p[verified][at]
    assert torch.equal(stage_p > 0, reference_p > 0), f"seed {seed}: the nucleus differs"
    torch.testing.assert_close(stage_p, reference_p, rtol=1e-6, atol=0.0)
    # on the CPU p is warped depth by depth: a row's accepted drafts and its drawn token only
    assert len(at) == len(set(at.tolist())) == int((num_accepted.long() + 1).sum()), seed
    assert torch.equal(out.output_ids, output_ids), f"seed {seed}: output_ids differ"
    assert torch.equal(out.num_accepted, num_accepted), f"seed {seed}: num_accepted differs"
    verify_t = torch.tensor(verify)
    return {
        "accepted": int(out.num_accepted.sum()),
        "rejected": int((out.num_accepted < verify_t).sum()),
        "bonus": int(((out.num_accepted == verify_t) & (verify_t > 0)).sum()),
        "verify 0": int((verify_t == 0).sum()),
        "verify K": int((verify_t == K).sum()),
    }


@pytest.mark.parametrize("vocab_limit", [None, 200])
def test_stage_equals_the_old_full_warp_then_rejection(vocab_limit) -> None:
    """Warping only the verified positions changes nothing: 120 random steps (greedy rows,
    top-p < 1 and = 1, num_verify 0..K, float32 and float64 q) give the p, output_ids and
    num_accepted of the old path, and the steps exercise accepts, rejections and bonuses."""
    model = tiny_model(17)
    seen = dict.fromkeys(["accepted", "rejected", "bonus", "verify 0", "verify K"], 0)
    for seed in range(120):
        counts = _old_path_case(model, seed, vocab_limit)
        seen = {key: seen[key] + counts[key] for key in seen}
    assert all(n >= 20 for n in seen.values()), seen


def test_stage_equals_the_old_path_on_two_threads_with_one_position() -> None:
    """On two threads torch sums a lone row of over 32k values in two halves (its own rounding):
    a batch of one row verifying nothing warps one position, and must still sum it as the old
    path did (its K + 1 positions always made several rows). Flat rows, wide nuclei: each case
    has about even odds of telling the two sums apart."""
    model = tiny_model(18, layers=1, vocab_size=40_000)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(8):
            top_p = (1.0, 0.95)[seed % 2]
            _old_path_case(
                model, 1001 + seed, None, 1, [0], temperature=1.0, top_p=top_p, scale=0.2
            )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("width", [1, 2, K - 1])
def test_q_for_fewer_positions_verifies_and_draws_as_the_full_window(width: int) -> None:
    """draft_probs for the first P < K positions (what the draft sends when no row may draft
    further) gives the output_ids, num_accepted and generator streams of the same q padded
    with zeros to K, over 20 random steps; num_verify past P is refused by name."""
    model = tiny_model(21)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(width)
    short = make_target_stage(model, check_values=True)
    full = make_target_stage(model)
    rows = [{"seq_id": r + 1, "tokens": [3 + r, 5, 7], "seed": r, "temperature": 0.9,
             "top_p": 0.9} for r in range(3)]  # fmt: skip
    for step in range(20):
        inputs = make_inputs(rows)
        q = torch.softmax(torch.randn(3, width, vocab, generator=gen) * 2, -1)
        padded = torch.nn.functional.pad(q, (0, 0, 0, K - width))
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(3, width)
        drafts = torch.nn.functional.pad(drafts, (0, K - width)).int()
        verify = torch.randint(0, width + 1, (3,), generator=gen)
        a = short(inputs, drafts, q, verify)
        b = full(inputs, drafts, padded, verify)
        assert torch.equal(a.output_ids, b.output_ids), step
        assert torch.equal(a.num_accepted, b.num_accepted), step
        assert a.output_ids.shape == (3, K + 1)
        for x, y in zip(short.slots.generators([1, 2, 3]), full.slots.generators([1, 2, 3]),
                        strict=True):  # fmt: skip
            assert torch.equal(x.get_state(), y.get_state())
        for r, row in enumerate(rows):  # commit the accepted drafts and the new token
            kept = a.output_ids[r, : int(a.num_accepted[r]) + 1].tolist()
            row.update(start=row.get("start", 0) + len(row["tokens"]), tokens=kept,
                       reusable=int(a.num_accepted[r]))  # fmt: skip
    with pytest.raises(ValueError, match=rf"num_verify\[0\] = {width + 1} past the {width} "):
        short(make_inputs(rows), drafts, q, torch.tensor([width + 1, 0, 0]))


class _OnePass(TargetStage):
    """The stage as it verifies off the CPU: p at every verified position, one pass."""

    by_depth = False


def test_depth_by_depth_equals_the_one_pass_form_over_random_steps() -> None:
    """The CPU's depth-by-depth verification and the one-pass form (CUDA's) on the same model
    and inputs: equal output_ids, num_accepted and generator states over 30 random steps of 4
    rows (temperature 0.8, top-p 0.9; drafts the target's greedy continuation, each swapped
    for a random token with probability 0.3, q one-hot on them or the softmax of noise)."""
    model = tiny_model(23)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    depth, one_pass = make_target_stage(model), make_target_stage(model)
    one_pass.__class__ = _OnePass
    assert depth.by_depth and not one_pass.by_depth
    rows = [{"seq_id": r + 1, "tokens": [3 + r, 5, 7], "seed": r, "temperature": 0.8,
             "top_p": 0.9} for r in range(4)]  # fmt: skip
    history = [list(row["tokens"]) for row in rows]
    accepted = 0
    for step in range(30):
        inputs = make_inputs(rows)
        drafts = torch.tensor([greedy(model, h, K) for h in history])
        swap = torch.rand(4, K, generator=gen) < 0.3
        drafts = torch.where(swap, torch.randint(0, vocab, (4, K), generator=gen), drafts).int()
        if step % 2:
            q = torch.softmax(torch.randn(4, K, vocab, generator=gen), -1)
        else:
            q = torch.zeros(4, K, vocab).scatter_(-1, drafts[..., None].long(), 1.0)
        verify = torch.randint(0, K + 1, (4,), generator=gen)
        a, b = depth(inputs, drafts, q, verify), one_pass(inputs, drafts, q, verify)
        assert torch.equal(a.output_ids, b.output_ids), step
        assert torch.equal(a.num_accepted, b.num_accepted), step
        for x, y in zip(depth.slots.generators([1, 2, 3, 4]),
                        one_pass.slots.generators([1, 2, 3, 4]), strict=True):  # fmt: skip
            assert torch.equal(x.get_state(), y.get_state())
        accepted += int(a.num_accepted.sum())
        for r, row in enumerate(rows):
            kept = a.output_ids[r, : int(a.num_accepted[r]) + 1].tolist()
            history[r] += kept
            row.update(start=row.get("start", 0) + len(row["tokens"]), tokens=kept,
                       reusable=int(a.num_accepted[r]))  # fmt: skip
    assert accepted > 60  # rows go deep: most depths ask for p


def test_output_layer_computes_few_rows_several_depths_at_once_and_each_once() -> None:
    """A lone row's first ask computes its every depth in one product; 30 rows asked at depth 0
    compute that depth alone (ceil(24 / 30) = 1), 15 of them at depth 1 their depths 1 and 2
    (ceil(24 / 15) = 2); the logits equal the output layer's at every position, each computed
    once."""
    from avspec.engine.target_stage import OUTPUT_LAYER_ROWS

    products: list[int] = []

    class Model:
        def logits(self, x):
            products.append(len(x))
            return x * 2.0

    def packed_for(verify: list[int]):
        lengths = [v + 1 for v in verify]
        first = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()][:-1])
        rows = torch.repeat_interleave(torch.arange(len(verify)), torch.tensor(lengths))
        return type("Packed", (), {"rows": rows, "first": first})(), torch.tensor(verify)

    packed, verify = packed_for([8])
    hidden = torch.randn(9, 5)
    layer = OutputLayer(Model(), hidden, packed, verify, lambda x: x)
    for depth in range(9):
        torch.testing.assert_close(layer(torch.tensor([depth])), hidden[depth : depth + 1] * 2)
    assert products == [9]

    products.clear()
    rows = OUTPUT_LAYER_ROWS + 6
    packed, verify = packed_for([2] * rows)
    hidden = torch.randn(3 * rows, 5)
    layer = OutputLayer(Model(), hidden, packed, verify, lambda x: x)
    at_0 = packed.first
    torch.testing.assert_close(layer(at_0), hidden[at_0] * 2)
    half = packed.first[: rows // 2] + 1  # half the rows accepted their first draft
    torch.testing.assert_close(layer(half), hidden[half] * 2)
    torch.testing.assert_close(layer(half + 1), hidden[half + 1] * 2)
    assert products == [rows, 2 * (rows // 2)]  # depth 0; then 15 rows' depths 1 and 2 at once


def test_output_layer_takes_the_few_positions_left_into_the_first_product() -> None:
    """64 rows of which 6 verify one draft: the ask at depth 0 computes every position (70) in one
    product, since the 6 left would need a product of their own (the rule without this makes
    two: 64, then the rows asked at depth 1); 64 rows verifying one draft each still go depth by
    depth (64 left after depth 0)."""
    products: list[int] = []

    class Model:
        def logits(self, x):
            products.append(len(x))
            return x * 3.0

    for verify, expected in (([1] * 6 + [0] * 58, [70]), ([1] * 64, [64, 6])):
        products.clear()
        lengths = [v + 1 for v in verify]
        first = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()][:-1])
        rows = torch.repeat_interleave(torch.arange(len(verify)), torch.tensor(lengths))
        packed = type("Packed", (), {"rows": rows, "first": first})()
        hidden = torch.randn(sum(lengths), 5)
        layer = OutputLayer(Model(), hidden, packed, torch.tensor(verify), lambda x: x)
        torch.testing.assert_close(layer(first), hidden[first] * 3)
        accepted = first[:6] + 1  # the first 6 rows accepted their draft
        torch.testing.assert_close(layer(accepted), hidden[accepted] * 3)
        assert products == expected
