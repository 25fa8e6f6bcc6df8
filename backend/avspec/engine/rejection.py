"""Batched lossless rejection sampling with a per-request number of verified drafts.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"). For request r with drafts x_0..x_{K-1} drawn from q and the target's p:

- accepted tokens: draft j (j < num_verify) is accepted with probability
  min(1, p_j(x_j) / q_j(x_j)), scanning left to right until the first rejection;
- recovered (correction) token: at the first rejected position a, a token drawn from
  norm(max(0, p_a - q_a)) (from p_a if that residual is all zero, i.e. p_a == q_a on the support);
- bonus token: if all num_verify verified drafts are accepted, a token drawn from p at position
  num_verify (not K: unverified drafts are simply dropped).

Each call emits num_accepted + 1 tokens distributed exactly as sampling from p token by token, as
long as the choice of num_verify for position j depends only on what was known before x_j was drawn
(see avspec.av.survival / avspec.av.budget). Greedy rows (p, q one-hot) reduce to: accept iff the
draft equals the target's argmax; the correction is the target's argmax.

Randomness: each request draws a FIXED amount from its own generator per call: K + 1 uniforms,
K for the accept tests and one for the one token drawn by `avspec.engine.sampling.inverse_cdf`
(recovered or bonus, whichever position it lands at: that uniform is drawn before and
independently of the accept decisions, so one draw per call is exact), so its output never
depends on the other requests in the batch nor on their num_verify (what it costs:
docs/benchmarks.md).

Work: besides the one row drawn from, the test reads p and q at the drafted tokens only, and p
only at positions 0..num_verify. `rejection_sample` is the one entry point; p comes in one of
three forms (all K + 1 positions of each row; packed, exactly the positions read, as the target
stage warps no others; or a function asked depth by depth, only where the test gets to), and the
noise from the requests' generators or given (tests vectorise many trials with it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from avspec.checks import check_finite, check_same_device, check_shape
from avspec.engine.sampling import check_generators, inverse_cdf, uniform_noise

ProbsAt = Callable[[torch.Tensor], torch.Tensor]  # packed positions [n] int64 -> p [n, vocab]


@dataclass(frozen=True)
class RequestStreams:
    """The requests' own generators (one per request), each drawing `positions` + 1 uniforms a
    call (None: K + 1), the accept tests cut to the K verified: a caller verifying a prefix of a
    longer draft window keeps every request's stream as the window's."""

    generators: Sequence[torch.Generator]
    positions: int | None = None


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor | ProbsAt,
    num_verify: torch.Tensor,
    generators: Sequence[torch.Generator] | RequestStreams | None = None,
    *,
    first_position: torch.Tensor | None = None,
    noise: tuple[torch.Tensor, torch.Tensor] | None = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts -> output_ids [batch, K + 1] int32 (padding -1), num_accepted [batch] int32.

    draft_tokens [batch, K] int, draft_probs [batch, K, vocab] (q, warped), num_verify [batch]
    int in 0..K. p (warped), in one of three forms, the same outputs for the same p:

    - `target_probs` [batch, K + 1, vocab]: every position of each row (row K: the bonus);
    - with `first_position` [batch] int, `target_probs` [positions, vocab] packed: row r's
      position j at first_position[r] + j, for j in 0..num_verify[r] (what lies past them is
      never read);
    - with `first_position`, `target_probs` a function of packed positions [n] int64 -> p
      [n, vocab], asked depth by depth for the rows whose drafts so far were all accepted: a
      row's p is computed at num_accepted + 1 positions instead of num_verify + 1 (about
      1 / (1 - a) at acceptance a). One host sync a depth: the CPU's path; on CUDA one pass
      over the packed positions costs less than the syncs.

    Randomness: `generators` (one per request: K + 1 uniforms each; as `RequestStreams` with
    `positions`, that many + 1 with the accept tests cut to K, so a caller verifying a prefix of
    a longer draft window keeps every request's stream as the window's), or `noise` = (uniforms
    [batch, K] for the accept tests, draw [batch] for the token), in [0, 1). `check_values`
    validates the arguments: shapes, devices, value ranges and what is read (a host sync on
    CUDA); the target stage passes False, its inputs checked once where the step entered it.
    An empty batch returns empty outputs.
    """
    if check_values:
        _check_drafts(draft_tokens)
    batch, num_pos = draft_tokens.shape
    device = draft_tokens.device
    if (generators is None) == (noise is None):
        raise ValueError("give either generators or noise, not both or neither")
    if first_position is None:
        if callable(target_probs):
            raise ValueError("target_probs as a function needs first_position")
        if check_values:
            check_shape("target_probs", target_probs, (batch, num_pos + 1, None))
        first_position = torch.arange(batch, device=device) * (num_pos + 1)
        target_probs = target_probs.flatten(0, 1)
    elif check_values:
        check_shape("first_position", first_position, (batch,))
        _check_integer("first_position", first_position)
    if noise is None:
        assert generators is not None  # exactly one of the two (checked above)
        if not isinstance(generators, RequestStreams):
            generators = RequestStreams(generators)
        uniforms, draw = _window_noise(generators, batch, num_pos, device)
    else:
        uniforms, draw = noise
        if check_values:
            check_shape("uniforms", uniforms, (batch, num_pos))
            check_shape("draw", draw, (batch,))
    if callable(target_probs):
        return _by_depth(
            draft_tokens, draft_probs, target_probs, first_position, num_verify, uniforms, draw,
            check_values,
        )  # fmt: skip
    if check_values:
        check_shape("target_probs", target_probs, (None, None))
        _check_probs(draft_tokens, draft_probs, target_probs, num_verify)
        check_same_device(target_probs=target_probs, first_position=first_position)
    if check_values and batch > 0:
        last = first_position.long() + num_verify.long()
        if bool(((first_position < 0) | (last >= target_probs.shape[0])).any()):
            raise ValueError(
                f"first_position + 0..num_verify must lie in 0..{target_probs.shape[0] - 1}"
            )
    return _packed(
        draft_tokens, draft_probs, target_probs, first_position, num_verify, uniforms, draw,
        check_values,
    )  # fmt: skip


def _packed(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    first_position: torch.Tensor,
    num_verify: torch.Tensor,
    uniforms: torch.Tensor,
    draw: torch.Tensor,
    check_values: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The vectorised test over packed p, in one pass.

    Reads p and q at the drafted tokens and the full rows of one position per request (where
    its token is drawn), in their own dtype, converted to float32 after the reads.
    `check_values`: what it reads must be finite and non-negative (ValueError naming
    draft_probs or target_probs); values it never reads cannot change the output and are not
    looked at (on [positions, vocab] probabilities a check of every entry costs several passes
    over the vocabulary per step).
    """
    batch, num_pos = draft_tokens.shape
    device = target_probs.device
    tokens = draft_tokens.long()
    first, verify = first_position.long(), num_verify.long()
    positions = torch.arange(num_pos, device=device)
    verified = positions[None, :] < verify[:, None]  # [batch, K]
    # p at each draft's position; past num_verify the bonus position's (the test ignores it)
    at = first[:, None] + torch.minimum(positions[None, :], verify[:, None])  # [batch, K]
    p_draft = target_probs[at, tokens].float()  # [batch, K]
    q_draft = draft_probs.gather(-1, tokens[..., None]).squeeze(-1).float()  # [batch, K]
    if check_values:
        _check_read("draft_probs", q_draft)
        _check_read("target_probs", p_draft)
    # u < p/q, written without the division; always true when p >= q since u < 1.
    accepted = (uniforms * q_draft < p_draft) & verified
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]

    p_at = target_probs[first + num_accepted].float()  # [batch, vocab]
    return _emit(tokens, draft_probs, p_at, num_accepted, verify, draw, check_values)


def _by_depth(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    probs_at: ProbsAt,
    first_position: torch.Tensor,
    num_verify: torch.Tensor,
    uniforms: torch.Tensor,
    draw: torch.Tensor,
    check_values: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same test asking `probs_at` for p depth by depth: depth j for the rows whose drafts
    0..j-1 were all accepted (the test at depth j reads only p_j(x_j), and the token is drawn
    from the one position where the scan stops)."""
    batch, num_pos = draft_tokens.shape
    tokens, first, verify = draft_tokens.long(), first_position.long(), num_verify.long()
    device = draft_tokens.device
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    p_at: torch.Tensor | None = None  # [batch, vocab], filled row by row as each scan stops
    live = torch.arange(batch, device=device)  # the rows whose scan reaches this depth
    for depth in range(num_pos + 1):
        if not len(live):
            break
        p = probs_at(first[live] + depth).float()  # [n, vocab]
        if p_at is None:  # depth 0, every row: num_verify checked before any test reads it
            if check_values:
                _check_probs(tokens, draft_probs, p, num_verify)
            p_at = p.new_empty(batch, p.shape[-1])
        testing = verify[live] > depth
        accepted = torch.zeros_like(testing)
        if depth < num_pos and bool(testing.any()):
            x = tokens[live, depth]
            p_x = p.gather(-1, x[:, None])[:, 0]
            q_x = draft_probs[live, depth].gather(-1, x[:, None])[:, 0].float()
            if check_values:
                _check_read("draft_probs", q_x[testing])
                _check_read("target_probs", p_x[testing])
            # u < p/q, written without the division; always true when p >= q since u < 1
            accepted = testing & (uniforms[live, depth] * q_x < p_x)
        stopped = ~accepted
        p_at[live[stopped]] = p[stopped]
        live = live[accepted]
        num_accepted[live] = depth + 1
    if p_at is None:  # an empty batch
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return empty.reshape(0, num_pos + 1), empty
    return _emit(tokens, draft_probs, p_at, num_accepted, verify, draw, check_values)


def _emit(
    tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    p_at: torch.Tensor,
    num_accepted: torch.Tensor,
    verify: torch.Tensor,
    draw: torch.Tensor,
    check_values: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted drafts then one token drawn at the position where each row's scan stopped
    (p_at [batch, vocab] float32: p there): from norm(max(0, p - q)) after a rejection, from p
    after all verified drafts were accepted -> (output_ids [batch, K + 1] int32, num_accepted
    int32)."""
    batch, num_pos = tokens.shape
    device = p_at.device
    rows = torch.arange(batch, device=device)
    q_at = draft_probs[rows, num_accepted.clamp(max=num_pos - 1)].float()  # [batch, vocab]
    if check_values:
        _check_read("draft_probs", q_at)
        _check_read("target_probs", p_at)
    rejected = (num_accepted < verify)[:, None]
    residual = torch.where(rejected, (p_at - q_at).clamp_min(0), p_at)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_at)
    last = inverse_cdf(residual, draw)  # [batch]

    out_pos = torch.arange(num_pos + 1, device=device)[None, :]
    padded = torch.cat([tokens, torch.full((batch, 1), -1, device=device)], dim=-1)
    output_ids = torch.where(out_pos < num_accepted[:, None], padded, -1)
    output_ids = torch.where(out_pos == num_accepted[:, None], last[:, None], output_ids)
    return output_ids.int(), num_accepted.int()


def _noise(
    generators: Sequence[torch.Generator], batch: int, num_pos: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's K + 1 uniforms: K accept tests [batch, K], then the token draw [batch]."""
    check_generators("generators", generators, batch, device)
    noise = uniform_noise(generators, (num_pos + 1,), device)
    return noise[:, :num_pos], noise[:, num_pos]


def _window_noise(
    streams: RequestStreams, batch: int, num_pos: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_noise` of a window of `streams.positions` (>= num_pos, default num_pos) drafts, the
    accept tests cut to the num_pos verified: ([batch, num_pos], [batch])."""
    stream = num_pos if streams.positions is None else streams.positions
    if stream < num_pos:
        raise ValueError(f"stream positions {stream} < the {num_pos} draft positions")
    uniforms, draw = _noise(streams.generators, batch, stream, device)
    return uniforms[:, :num_pos], draw


def _check_read(name: str, values: torch.Tensor) -> None:
    """Probabilities read by the core must be finite and >= 0."""
    check_finite(name, values)
    if bool((values < 0).any()):
        raise ValueError(f"{name} must be non-negative")


def _check_integer(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")


def _check_drafts(draft_tokens: torch.Tensor) -> None:
    check_shape("draft_tokens", draft_tokens, (None, None))
    if draft_tokens.shape[1] == 0:
        raise ValueError("draft_tokens has K = 0 draft positions; K must be >= 1")


def _check_probs(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_verify: torch.Tensor,
) -> None:
    """The checks both forms share, once target_probs' leading dims are checked."""
    batch, num_pos = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if vocab == 0:
        raise ValueError("target_probs must have a non-empty vocab dimension")
    check_shape("draft_probs", draft_probs, (batch, num_pos, vocab))
    check_shape("num_verify", num_verify, (batch,))
    check_same_device(
        draft_tokens=draft_tokens,
        draft_probs=draft_probs,
        target_probs=target_probs,
        num_verify=num_verify,
    )
    _check_integer("draft_tokens", draft_tokens)
    _check_integer("num_verify", num_verify)
    if batch > 0:  # the values themselves: where they are read (`_check_read`)
        if bool(((draft_tokens < 0) | (draft_tokens >= vocab)).any()):
            raise ValueError(f"draft_tokens must lie in 0..{vocab - 1}")
        if bool(((num_verify < 0) | (num_verify > num_pos)).any()):
            raise ValueError(f"num_verify must lie in 0..{num_pos}")
