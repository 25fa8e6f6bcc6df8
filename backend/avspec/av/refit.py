"""Online IRLS for the acceptance model p = sigmoid(w f + b_k) (spec section 3).

Per draft position k the sufficient statistics of one Newton step are accumulated, with the
prediction p made at draft time and weight s = p (1 - p):

    A_k = sum s f^2,  B_k = sum s f,  C_k = sum s,  G0_k = sum (y - p) f,  G1_k = sum (y - p)

plus the label count n_k. The Hessian over (w, b_0..b_{K-1}) is an arrowhead: the slope couples
to every intercept, intercepts not to each other. With the ridge added to the slope's diagonal
entry the Schur complement gives the closed form

    dw   = (sum G0_k - sum B_k G1_k / C_k) / (sum A_k + ridge - sum B_k^2 / C_k)
    db_k = (G1_k - B_k dw) / C_k

then damped by evidence: dw * n / (n + damping) with n = sum n_k, db_k * n_k / (n_k + damping).
Positions with C_k == 0 have no usable labels: they are left out of the sums and get db_k = 0.
"""

from __future__ import annotations

import torch

from avspec.checks import check_same_device, check_shape

_NAMES = ("A", "B", "C", "G0", "G1", "n")


class SufficientStats:
    """Per-position accumulators A, B, C, G0, G1, n: each [position] float64, O(K) memory."""

    def __init__(self, num_positions: int, device: torch.device | str = "cpu") -> None:
        if num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {num_positions}")
        self.num_positions = num_positions
        # rows A, B, C, G0, G1, n: one tensor so that `add` is a single reduction
        self.sums = torch.zeros(len(_NAMES), num_positions, dtype=torch.float64, device=device)
        self.A, self.B, self.C, self.G0, self.G1, self.n = self.sums.unbind(0)  # row views

    @property
    def device(self) -> torch.device:
        return self.sums.device

    def add(
        self,
        features: torch.Tensor,
        predictions: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        """Accumulate one batch of labelled drafts; no host sync.

        features, predictions, labels: [batch, position] float (labels 0/1); mask: [batch,
        position] bool, True where a label exists. position may be < num_positions (the first
        positions are updated). Masked entries and entries with a non-finite feature, prediction
        or label contribute nothing.
        """
        check_shape("features", features, (None, None))
        batch, positions = features.shape
        if positions > self.num_positions:
            raise ValueError(f"features has {positions} positions, stats hold {self.num_positions}")
        for name, t in (("predictions", predictions), ("labels", labels), ("mask", mask)):
            check_shape(name, t, (batch, positions))
        check_same_device(
            features=features, predictions=predictions, labels=labels, mask=mask, stats=self.A
        )
        valid = mask.bool() & torch.isfinite(features) & torch.isfinite(predictions)
        valid &= torch.isfinite(labels)
        f = torch.where(valid, features.double(), 0.0)
        p = torch.where(valid, predictions.double(), 0.0)
        y = torch.where(valid, labels.double(), 0.0)
        s = p * (1 - p)  # zero where invalid since p = 0 there
        r = y - p  # zero where invalid
        sf = s * f
        terms = torch.stack((sf * f, sf, s, r * f, r, valid.double()))  # [6, batch, position]
        self.sums[:, :positions] += terms.sum(dim=1)

    def clear(self) -> None:
        """Zero every accumulator (start a new refit window)."""
        self.sums.zero_()

    def total(self) -> torch.Tensor:
        """Return the number of labels accumulated, a 0-dim float64 tensor (no host sync)."""
        return self.n.sum()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return copies of the accumulators, keyed A, B, C, G0, G1, n."""
        return {name: getattr(self, name).clone() for name in _NAMES}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore accumulators saved by `state_dict`; validates everything before assigning."""
        loaded = {}
        for name in _NAMES:
            if name not in state:
                raise ValueError(f"stats state lacks {name!r}")
            t = torch.as_tensor(state[name], dtype=torch.float64)
            check_shape(f"stats {name}", t, (self.num_positions,))
            loaded[name] = t.to(self.device)
        for name, t in loaded.items():
            getattr(self, name).copy_(t)


def newton_step(
    stats: SufficientStats, ridge: float, damping: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the damped Newton step (dw 0-dim, db [position]) in float64; no host sync.

    The ridge is added to every diagonal entry of H: the slope's (sum A_k) and each intercept's
    (C_k). On the intercepts it keeps the step defined when the predictions saturate (p rounds
    to 0 or 1, so C_k = 0 while labels still disagree with them); the caller caps the step
    (`EstimatorConfig.max_step`). The result may hold NaN (e.g. empty statistics with ridge 0):
    the caller drops it.
    """
    c = stats.C + ridge
    b_over_c = stats.B / c
    numerator = (stats.G0 - b_over_c * stats.G1).sum()
    denominator = (stats.A - b_over_c * stats.B).sum() + ridge
    dw = numerator / denominator
    db = (stats.G1 - stats.B * dw) / c
    n_k = stats.n
    n = n_k.sum()
    dw = dw * _evidence(n, damping)
    db = db * _evidence(n_k, damping)
    return dw, db


def _evidence(n: torch.Tensor, damping: float) -> torch.Tensor:
    """n / (n + damping), 0 where there is no evidence at all."""
    total = n + damping
    return torch.where(total > 0, n / torch.where(total > 0, total, torch.ones_like(total)), 0.0)
