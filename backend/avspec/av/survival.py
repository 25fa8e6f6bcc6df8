"""Survival of draft positions and global top-`budget` admission (spec section 4).

survival[r, k] = prod_{j <= k} c[r, j] never increases along k, so admitting the `budget` highest
survival values of the batch (ties to the earlier position, then the lower batch index) keeps a
prefix of each request's drafts. Whether position k is admitted then depends only on values that
rank above it: other requests and positions < k of its own request, all known before x_k was drawn.

Both functions accept extra leading dimensions (`...`), each slice handled on its own; the
verifier uses none, the losslessness test uses one to vectorise trials.
"""

from __future__ import annotations

import torch

from avspec.checks import check_same_device, check_shape


def survival(
    confidences: torch.Tensor, num_draft_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Survival values and candidate mask, both [..., batch, position].

    confidences [..., batch, position] in [0, 1]; num_draft_tokens [..., batch]. Positions
    >= num_draft_tokens are padding: survival 0 and candidate False. Padding confidences may hold
    anything (even NaN): they never reach a candidate's value.
    """
    if confidences.dim() < 2:
        raise ValueError(
            f"confidences must have shape (..., batch, position), got "
            f"{tuple(confidences.shape)}"
        )
    check_shape("num_draft_tokens", num_draft_tokens, tuple(confidences.shape[:-1]))
    check_same_device(confidences=confidences, num_draft_tokens=num_draft_tokens)
    positions = torch.arange(confidences.shape[-1], device=confidences.device)
    candidates = positions < num_draft_tokens[..., None]
    safe = torch.where(candidates, confidences, torch.ones_like(confidences))
    values = torch.where(candidates, torch.cumprod(safe, dim=-1), torch.zeros_like(safe))
    return values, candidates


def admitted_mask(
    survival: torch.Tensor, candidates: torch.Tensor, budget: torch.Tensor | int
) -> torch.Tensor:
    """Admitted positions [..., batch, position] bool: the `budget` best candidates per slice.

    budget: an int or a tensor broadcastable to the leading dims `...` (0-dim: one budget).
    Ties go to the earlier position, then to the lower batch index. No host sync.
    """
    *lead, batch, num_pos = survival.shape
    # Position-major flattening: a stable sort then breaks ties by position, then batch index.
    flat = survival.transpose(-1, -2).reshape(*lead, num_pos * batch)
    flat_cand = candidates.transpose(-1, -2).reshape(*lead, num_pos * batch)
    key = torch.where(flat_cand, flat.float(), torch.full_like(flat, -1.0, dtype=torch.float32))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    budget = torch.as_tensor(budget, device=survival.device)
    admitted = (ranks < budget[..., None]) & flat_cand
    return admitted.reshape(*lead, num_pos, batch).transpose(-1, -2)


def admit(
    survival: torch.Tensor, candidates: torch.Tensor, budget: torch.Tensor | int
) -> torch.Tensor:
    """num_verify [..., batch] int32: admit the `budget` highest candidate survival values.

    survival, candidates [..., batch, position] (from `survival`); budget: int >= 0 or an integer
    tensor (0-dim, may live on the device: no host sync). The result is the admitted prefix length
    of each request; with survival non-increasing along position it equals the admitted count.
    """
    if survival.dim() < 2:
        raise ValueError(
            f"survival must have shape (..., batch, position), got " f"{tuple(survival.shape)}"
        )
    check_shape("candidates", candidates, tuple(survival.shape))
    if candidates.dtype != torch.bool:
        raise ValueError(f"candidates must be a bool tensor, got {candidates.dtype}")
    if isinstance(budget, torch.Tensor):
        check_same_device(survival=survival, candidates=candidates, budget=budget)
        if budget.is_floating_point() or budget.dtype == torch.bool:
            raise ValueError(f"budget must be an integer tensor, got {budget.dtype}")
    else:
        check_same_device(survival=survival, candidates=candidates)
        if int(budget) < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
    admitted = admitted_mask(survival, candidates, budget)
    return admitted.int().cumprod(dim=-1).sum(dim=-1).int()
