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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from avspec.checks import check_finite, check_same_device, check_shape
from avspec.engine.sampling import check_generators, inverse_cdf, uniform_noise


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_verify: torch.Tensor,
    generators: Sequence[torch.Generator],
    *,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts -> output_ids [batch, K + 1] int32 (padding -1), num_accepted [batch] int32.

    draft_tokens [batch, K] int, draft_probs [batch, K, vocab] (q, warped), target_probs
    [batch, K + 1, vocab] (p, warped; row K is the bonus position), num_verify [batch] int in 0..K,
    generators: one per request. An empty batch returns empty outputs. `check_values` validates
    value ranges (a host sync on CUDA).
    """
    batch, num_pos, _ = _check_inputs(
        draft_tokens, draft_probs, target_probs, num_verify, check_values
    )
    device = target_probs.device
    check_generators("generators", generators, batch, device)
    noise = uniform_noise(generators, (num_pos + 1,), device)
    return rejection_sample_from_noise(
        draft_tokens, draft_probs, target_probs, num_verify, noise[:, :num_pos], noise[:, num_pos]
    )


def rejection_sample_from_noise(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_verify: torch.Tensor,
    uniforms: torch.Tensor,
    draw: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The vectorised core of `rejection_sample`, given its noise (no input checks).

    uniforms [batch, K] in [0, 1) for the accept tests, draw [batch] in [0, 1) for the recovered
    or bonus token. Tests call it directly
    to vectorise many trials with one generator.
    """
    batch, num_pos = draft_tokens.shape
    device = target_probs.device
    tokens = draft_tokens.long()
    p = target_probs.float()
    q = draft_probs.float()
    p_draft = p[:, :num_pos].gather(-1, tokens[..., None]).squeeze(-1)  # [batch, K]
    q_draft = q.gather(-1, tokens[..., None]).squeeze(-1)  # [batch, K]
    positions = torch.arange(num_pos, device=device)
    verified = positions[None, :] < num_verify[:, None].long()  # [batch, K]
    # u < p/q, written without the division; always true when p >= q since u < 1.
    accepted = (uniforms * q_draft < p_draft) & verified
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]

    rows = torch.arange(batch, device=device)
    p_at = p[rows, num_accepted]  # [batch, vocab]
    q_at = q[rows, num_accepted.clamp(max=num_pos - 1)]  # [batch, vocab]
    rejected = (num_accepted < num_verify.long())[:, None]
    residual = torch.where(rejected, (p_at - q_at).clamp_min(0), p_at)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_at)
    last = inverse_cdf(residual, draw)  # [batch]

    out_pos = torch.arange(num_pos + 1, device=device)[None, :]
    padded = torch.cat([tokens, torch.full((batch, 1), -1, device=device)], dim=-1)
    output_ids = torch.where(out_pos < num_accepted[:, None], padded, -1)
    output_ids = torch.where(out_pos == num_accepted[:, None], last[:, None], output_ids)
    return output_ids.int(), num_accepted.int()


def _check_inputs(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_verify: torch.Tensor,
    check_values: bool,
) -> tuple[int, int, int]:
    check_shape("draft_tokens", draft_tokens, (None, None))
    batch, num_pos = draft_tokens.shape
    if num_pos == 0:
        raise ValueError("draft_tokens has K = 0 draft positions; K must be >= 1")
    check_shape("target_probs", target_probs, (batch, num_pos + 1, None))
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
    for name, tensor in (("draft_tokens", draft_tokens), ("num_verify", num_verify)):
        if tensor.is_floating_point() or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if check_values and batch > 0:
        check_finite("draft_probs", draft_probs)
        check_finite("target_probs", target_probs)
        if bool((draft_probs < 0).any()) or bool((target_probs < 0).any()):
            raise ValueError("draft_probs and target_probs must be non-negative")
        if bool(((draft_tokens < 0) | (draft_tokens >= vocab)).any()):
            raise ValueError(f"draft_tokens must lie in 0..{vocab - 1}")
        if bool(((num_verify < 0) | (num_verify > num_pos)).any()):
            raise ValueError(f"num_verify must lie in 0..{num_pos}")
    return batch, num_pos, vocab
