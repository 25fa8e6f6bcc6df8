"""Tests for avspec.engine.rejection: exact greedy cases, bonus position, seeding, statistics."""

import pytest
import torch

from avspec.engine.rejection import RequestStreams, rejection_sample


def _gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _one_hot(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_accepts_prefix_then_corrects_to_target_argmax():
    vocab = 6
    target_path = [[2, 4, 1, 5], [3, 3, 0, 2], [1, 2, 3, 4]]  # argmax at positions 0..K
    drafts = [[2, 4, 0], [3, 3, 0], [5, 2, 3]]  # mismatch at 2 / none / at 0
    target = torch.stack([_one_hot(row, vocab) for row in target_path])
    draft_probs = torch.stack([_one_hot(row, vocab) for row in drafts])
    out, acc = rejection_sample(
        torch.tensor(drafts), draft_probs, target, torch.tensor([3, 3, 3]), _gens(0, 1, 2)
    )
    assert acc.tolist() == [2, 3, 0]
    assert out.tolist() == [[2, 4, 1, -1], [3, 3, 0, 2], [1, -1, -1, -1]]
    assert out.dtype == torch.int32 and acc.dtype == torch.int32


def test_greedy_bonus_comes_from_position_num_verify_not_k():
    vocab = 5
    target = _one_hot([1, 2, 3, 4], vocab)[None]
    drafts = torch.tensor([[1, 2, 3]])
    out, acc = rejection_sample(
        drafts, _one_hot([1, 2, 3], vocab)[None], target, torch.tensor([1]), _gens(0)
    )
    assert acc.tolist() == [1]
    assert out.tolist() == [[1, 2, -1, -1]]


def test_num_verify_zero_emits_one_token_from_p():
    """4000 rows with num_verify = 0: output 0 is a draw from p (frequencies within 0.03)."""
    vocab, rows = 4, 4000
    p = torch.tensor([0.1, 0.6, 0.3, 0.0])
    target = p.expand(rows, 3, vocab)
    q = torch.tensor([0.0, 0.0, 0.0, 1.0]).expand(rows, 2, vocab)
    drafts = torch.full((rows, 2), 3)
    out, acc = rejection_sample(
        drafts, q, target, torch.zeros(rows, dtype=torch.int64), _gens(*range(rows))
    )
    assert (acc == 0).all() and (out[:, 1:] == -1).all()
    freq = torch.bincount(out[:, 0].long(), minlength=vocab).float() / rows
    torch.testing.assert_close(freq, p, atol=0.03, rtol=0)


def test_one_position_matches_target_distribution():
    """200k vectorised trials, K = 1, vocab 3: first token frequencies within 0.005 of p."""
    trials, vocab = 200_000, 3
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen)[:, None]
    out, _ = rejection_sample(
        drafts,
        q.expand(trials, 1, vocab),
        p.expand(trials, 2, vocab),
        torch.ones(trials, dtype=torch.int64),
        noise=(
            torch.rand(trials, 1, generator=gen),
            torch.rand(trials, generator=gen, dtype=torch.float64),
        ),
    )
    freq = torch.bincount(out[:, 0].long(), minlength=vocab).float() / trials
    torch.testing.assert_close(freq, p, atol=0.005, rtol=0)


def test_residual_all_zero_falls_back_to_p():
    # p == q and a forced rejection (u * q >= p cannot happen for p == q, so force via q > p
    # on the draft with zero residual elsewhere): p = [1, 0], q = [1, 0] draft 1 has q = 0.
    p = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    q = torch.tensor([[[1.0, 0.0]]])
    out, acc = rejection_sample(
        torch.tensor([[1]]),
        q,
        p,
        torch.tensor([1]),
        noise=(torch.zeros(1, 1), torch.full((1,), 0.5)),
    )
    assert acc.tolist() == [0] and out.tolist() == [[0, -1]]


def _random_case(batch, k, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), -1)
    drafts = torch.randint(vocab, (batch, k), generator=gen)
    return drafts, q, p


def test_seeded_repeatability_and_batch_independence():
    drafts, q, p = _random_case(4, 3, 7, seed=11)
    num_verify = torch.tensor([3, 1, 0, 2])
    out, acc = rejection_sample(drafts, q, p, num_verify, _gens(5, 6, 7, 8))
    again, acc_again = rejection_sample(drafts, q, p, num_verify, _gens(5, 6, 7, 8))
    assert torch.equal(out, again) and torch.equal(acc, acc_again)
    for r, seed in enumerate([5, 6, 7, 8]):
        alone, acc_alone = rejection_sample(
            drafts[r : r + 1], q[r : r + 1], p[r : r + 1], num_verify[r : r + 1], _gens(seed)
        )
        assert torch.equal(alone[0], out[r]) and acc_alone[0] == acc[r]


def test_output_independent_of_other_rows_num_verify():
    drafts, q, p = _random_case(3, 3, 5, seed=12)
    out_a, _ = rejection_sample(drafts, q, p, torch.tensor([3, 0, 1]), _gens(1, 2, 3))
    out_b, _ = rejection_sample(drafts, q, p, torch.tensor([3, 3, 2]), _gens(1, 2, 3))
    assert torch.equal(out_a[0], out_b[0])


def test_empty_batch_returns_empty():
    out, acc = rejection_sample(
        torch.zeros(0, 2, dtype=torch.int64),
        torch.zeros(0, 2, 4),
        torch.zeros(0, 3, 4),
        torch.zeros(0, dtype=torch.int64),
        [],
    )
    assert out.shape == (0, 3) and acc.shape == (0,)


def _good():
    drafts, q, p = _random_case(2, 2, 4, seed=0)
    return dict(
        draft_tokens=drafts,
        draft_probs=q,
        target_probs=p,
        num_verify=torch.tensor([2, 1]),
        generators=_gens(1, 2),
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"draft_tokens": torch.zeros(2, 0, dtype=torch.int64)}, "K = 0"),
        ({"target_probs": torch.ones(2, 2, 4) / 4}, "target_probs must have shape"),
        ({"draft_probs": torch.ones(2, 2, 5) / 5}, "draft_probs must have shape"),
        ({"num_verify": torch.tensor([1])}, "num_verify must have shape"),
        ({"num_verify": torch.tensor([3, 1])}, "num_verify must lie"),
        ({"num_verify": torch.tensor([-1, 1])}, "num_verify must lie"),
        ({"num_verify": torch.tensor([1.0, 1.0])}, "integer tensor"),
        ({"draft_tokens": torch.tensor([[0, 4], [0, 0]])}, "draft_tokens must lie"),
        ({"draft_probs": torch.full((2, 2, 4), float("nan"))}, "draft_probs contains"),
        ({"target_probs": torch.full((2, 3, 4), float("inf"))}, "target_probs contains"),
        ({"target_probs": -torch.ones(2, 3, 4)}, "non-negative"),
        ({"generators": _gens(1)}, "one generator per request"),
        ({"num_verify": torch.tensor([1, 1], device="meta")}, "share one device"),
    ],
)
def test_rejects_bad_input(change, match):
    args = _good() | change
    with pytest.raises(ValueError, match=match):
        rejection_sample(**args)


def test_packed_form_equals_the_full_form_and_draws_as_much():
    """p given only at positions 0..num_verify (rows packed in reverse order, with gaps) yields
    the full form's outputs over 50 random batches, and each generator advances alike."""
    for seed in range(50):
        batch, k, vocab = 1 + seed % 5, 1 + seed % 4, (3, 8, 50)[seed % 3]
        drafts, q, p = _random_case(batch, k, vocab, seed=100 + seed)
        gen = torch.Generator().manual_seed(seed)
        num_verify = torch.randint(0, k + 1, (batch,), generator=gen)
        if seed % 2:  # drafts at p's argmax: accepts and bonus tokens
            drafts = p[:, :k].argmax(-1)
        rows, first = [], [0] * batch
        for r in reversed(range(batch)):
            rows.append(torch.rand(1, vocab, generator=gen))  # a gap: never read
            first[r] = sum(len(x) for x in rows)
            rows.append(p[r, : int(num_verify[r]) + 1])
        packed = torch.cat(rows)
        seeds = [1000 * seed + r for r in range(batch)]
        full_gens, packed_gens = _gens(*seeds), _gens(*seeds)
        want = rejection_sample(drafts, q, p, num_verify, full_gens)
        got = rejection_sample(
            drafts, q, packed, num_verify, packed_gens, first_position=torch.tensor(first)
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
        for a, b in zip(full_gens, packed_gens, strict=True):
            assert torch.equal(a.get_state(), b.get_state())


@pytest.mark.parametrize(
    ("first", "match"),
    [
        (torch.tensor([0, 3]), "first_position"),  # row 1 reads rows 3..4 of 4
        (torch.tensor([-1, 2]), "first_position"),
        (torch.tensor([0.0, 2.0]), "integer tensor"),
        (torch.tensor([0]), "first_position must have shape"),
    ],
)
def test_packed_rejects_bad_first_position(first, match):
    args = _good()
    packed = torch.cat([args["target_probs"][0, :3], args["target_probs"][1, :1]])  # 4 rows
    with pytest.raises(ValueError, match=match):
        rejection_sample(args["draft_tokens"], args["draft_probs"], packed, torch.tensor([2, 1]),
                         args["generators"], first_position=first)  # fmt: skip


def test_by_depth_equals_the_packed_form_and_asks_only_where_the_scan_goes():
    """`rejection_sample` given a function for p, over 60 random batches: the packed form's
    outputs and generator states, p asked for at exactly num_accepted + 1 positions a row (its
    accepted drafts and the position its token is drawn at), each at most once; and a variant
    that asks for every verified position is told apart by that count."""
    asked_more = 0
    for seed in range(60):
        batch, k, vocab = 1 + seed % 6, 1 + seed % 5, (3, 8, 50)[seed % 3]
        drafts, q, p = _random_case(batch, k, vocab, seed=300 + seed)
        gen = torch.Generator().manual_seed(seed)
        num_verify = torch.randint(0, k + 1, (batch,), generator=gen)
        if seed % 2:  # drafts at p's argmax: accepts and bonus tokens
            drafts = p[:, :k].argmax(-1)
        packed = torch.cat([p[r, : int(num_verify[r]) + 1] for r in range(batch)])
        first = torch.cumsum(num_verify + 1, 0) - (num_verify + 1)
        asked: list[int] = []

        def probs_at(positions, packed=packed, asked=asked):
            asked.extend(positions.tolist())
            return packed[positions]

        seeds = [1000 * seed + r for r in range(batch)]
        packed_gens, depth_gens = _gens(*seeds), _gens(*seeds)
        want = rejection_sample(drafts, q, packed, num_verify, RequestStreams(packed_gens, k + 2),
                                first_position=first)  # fmt: skip
        got = rejection_sample(drafts, q, probs_at, num_verify, RequestStreams(depth_gens, k + 2),
                               first_position=first)  # fmt: skip
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
        for a, b in zip(packed_gens, depth_gens, strict=True):
            assert torch.equal(a.get_state(), b.get_state())
        assert len(asked) == len(set(asked)) == int((got[1] + 1).sum()), seed
        asked_more += int((num_verify - got[1]).sum())
    assert asked_more > 30  # rows rejected before num_verify: positions never warped


def test_by_depth_rejects_bad_input():
    args = _good()
    p = args["target_probs"].flatten(0, 1)
    first = torch.tensor([0, 3])

    def call(**change):
        a = {
            "draft_tokens": args["draft_tokens"],
            "draft_probs": args["draft_probs"],
            "target_probs": lambda positions: p[positions],
            "first_position": first,
            "num_verify": torch.tensor([2, 1]),
            "generators": args["generators"],
        } | change
        return rejection_sample(**a)  # fmt: skip

    with pytest.raises(ValueError, match="num_verify must lie"):
        call(num_verify=torch.tensor([2, 9]))
    with pytest.raises(ValueError, match="draft_probs"):
        call(draft_probs=-args["draft_probs"])
    with pytest.raises(ValueError, match="first_position must have shape"):
        call(first_position=torch.tensor([0]))
    with pytest.raises(ValueError, match="integer tensor"):
        call(first_position=torch.tensor([0.0, 3.0]))


def test_one_entry_point_refuses_an_ambiguous_call():
    args = _good()
    noise = (torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(ValueError, match="either generators or noise"):
        rejection_sample(**args, noise=noise)
    with pytest.raises(ValueError, match="either generators or noise"):
        rejection_sample(**(args | {"generators": None}))
    with pytest.raises(ValueError, match="needs first_position"):
        rejection_sample(**(args | {"target_probs": lambda positions: positions}))
    with pytest.raises(ValueError, match="uniforms must have shape"):
        rejection_sample(**(args | {"generators": None}), noise=(torch.zeros(2, 5), noise[1]))
