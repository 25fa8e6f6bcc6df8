"""Verification budget: the number of drafts that maximises expected tokens per millisecond.

Spec section 4: sort candidate scores descending, then

    expected_tokens[b] = N + cumsum(scores)[b - 1]        (expected_tokens[0] = N)
    cost[b]            = draft_cost(num_requests) + verify_cost(base_tokens + b)
    budget             = argmax_b expected_tokens[b] / cost[b]     (ties -> smallest b)

For losslessness the scores must be known before this step's drafts were sampled: the verifier
passes the PREVIOUS step's survival values (see avspec.av.verifier).
"""

from __future__ import annotations

import torch

from avspec.av.cost_table import CostTable
from avspec.checks import check_shape


def choose_budget(
    scores: torch.Tensor,
    num_requests: int,
    base_tokens: int | torch.Tensor,
    draft_cost: CostTable,
    verify_cost: CostTable,
) -> torch.Tensor:
    """Budget b in 0..len(scores) as a 0-dim int64 tensor on scores' device (no host sync).

    scores [candidates]: one score per candidate draft position, any order. Zero scores never
    raise the argmax (they add no tokens and cost is non-decreasing), so callers may pass a padded
    [batch * position] tensor with 0 for non-candidates. num_requests: N, the requests that sample
    a token this step; base_tokens: T, tokens the target processes anyway (int or 0-dim tensor).
    """
    check_shape("scores", scores, (None,))
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not isinstance(base_tokens, torch.Tensor) and base_tokens < 0:
        raise ValueError(f"base_tokens must be >= 0, got {base_tokens}")
    device = scores.device
    ordered = torch.sort(scores.double(), descending=True).values
    expected = num_requests + torch.cat([ordered.new_zeros(1), torch.cumsum(ordered, dim=0)])
    sizes = torch.arange(scores.shape[0] + 1, device=device)
    # The draft cost is a host-side lookup (num_requests is a Python int); building device
    # tensors from Python numbers would be a blocking host-to-device copy on CUDA.
    draft_ms = float(draft_cost(float(num_requests)))
    cost = draft_ms + verify_cost(sizes + base_tokens).double()
    # A zero-cost table would divide by zero; a tiny floor keeps the ratio ordered.
    ratio = expected / cost.clamp_min(1e-12)
    best = ratio == ratio.max()
    return torch.where(best, sizes, sizes.shape[0]).min().long()
