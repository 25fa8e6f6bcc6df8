"""The estimator's feature: logit(q_max) of the temperature-scaled draft distribution (spec 2).

With z = logits / temperature and m = max z, q_max / (1 - q_max) = 1 / sum_{z != m} exp(z - m),
so f = -log(sum over the non-max entries of exp(z - m)): a logsumexp with the argmax entry
masked out. It never forms q, so it stays finite for extreme logits. If several entries tie for
the max, only the first (argmax) is masked; the others count as non-max, giving q_max = 1/2 for a
two-way tie. The result is clamped to [-clamp, clamp] (a one-hot distribution gives +clamp).
"""

from __future__ import annotations

import torch

from avspec.checks import check_finite, check_shape


def logit_qmax(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    clamp: float = 40.0,
    check_values: bool = True,
) -> torch.Tensor:
    """Return logit(q_max) per draft position, [batch, position] float32.

    logits: [batch, position, vocab]; -inf entries (masked vocabulary) are allowed.
    temperature: [batch] or a scalar; 0 (greedy) is treated as 1.
    check_values: validate the arguments (shapes, devices; NaN / +inf logits: a host sync on
    CUDA); the stages pass False, their inputs checked once where the step enters a stage.
    """
    if check_values:
        _check_arguments(logits, temperature)
    z = scaled_logits(logits, temperature)  # [batch, position, vocab]
    m, top = z.max(dim=-1, keepdim=True)  # [batch, position, 1]
    # exp(z - m) of the non-max entries, summed: no subtraction from 1, so no cancellation
    # when q_max is close to 1 (the sum just shrinks towards 0 and f towards +clamp).
    others = torch.exp(z - m).scatter_(-1, top, 0.0)
    f = -torch.log(others.sum(dim=-1))  # [batch, position]
    # An all -inf row (m = -inf) gives NaN above; such a row counts as one-hot (+clamp).
    f = torch.where(torch.isfinite(m.squeeze(-1)), f, clamp)
    return f.clamp(-clamp, clamp)


def _check_arguments(logits: torch.Tensor, temperature: torch.Tensor | float) -> None:
    check_shape("logits", logits, (None, None, None))
    if logits.shape[2] < 1:
        raise ValueError("logits must have a non-empty vocab dimension")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() != 0:
            check_shape("temperature", temperature, (logits.shape[0],))
        if temperature.device != logits.device:
            raise ValueError(f"temperature on {temperature.device} but logits on {logits.device}")
    check_finite("logits", logits)
    if isinstance(temperature, torch.Tensor):
        check_finite("temperature", temperature)


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """logits [batch, position, vocab] / temperature ([batch] or scalar; 0 counts as 1), fp32."""
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    temp = torch.where(temp == 0, torch.ones_like(temp), temp)
    temp = temp.reshape(-1, 1, 1) if temp.dim() == 1 else temp
    return logits.float() / temp
