"""The online acceptance estimator: p = sigmoid(w f + b_k), refitted from verification outcomes.

Spec sections 2 and 3. f is logit(q_max) of the draft distribution (`avspec.av.features`), w one
slope shared by all draft positions, b_k one intercept per position. Labels come from
verification: with a drafts accepted out of v verified, positions 0..a-1 are labelled 1, position
a is labelled 0 if a < v (the first rejection), later and unverified positions get no label.
Every `refit_interval` decode steps one damped Newton step (`avspec.av.refit`) updates (w, b) and
the accumulators are cleared, so each window fits its own data and the fit follows drift.

Host syncs: `predict`, `observe(check_values=False)` and `step()` when it does not refit never
synchronise with the host (all bookkeeping stays in device tensors; the step counter is a Python
int). `observe(check_values=True)` checks values on the host; `refit` needs no sync either but
runs only every `refit_interval` steps; `window_calibration` and `state_dict` are host-side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from avspec.av.refit import SufficientStats, newton_step
from avspec.checks import check_same_device, check_shape
from avspec.config import EstimatorConfig

# Sanity bounds on the coefficients, kept by every refit and checked on every snapshot
# (avspec.av.snapshot): at w = 100 the acceptance curve is already a step.
MAX_SLOPE = 100.0
MAX_ABS_INTERCEPT = 100.0

NUM_BINS = 10  # equal-width calibration bins, as the spec's ECE


class AcceptanceEstimator:
    """Predicts per-draft acceptance probabilities and refits itself online."""

    def __init__(self, config: EstimatorConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        k = config.num_positions
        self.slope = torch.tensor(config.initial_slope, dtype=torch.float32, device=device)
        self.device = self.slope.device
        self.intercepts = torch.full((k,), config.initial_intercept, device=self.device)
        self.stats = SufficientStats(k, self.device)
        zeros = torch.zeros(3, NUM_BINS, dtype=torch.float64, device=self.device)
        self._bins = zeros.clone()  # rows: sum_p, sum_y, count for the current window
        self._last_bins = zeros.clone()  # the same for the last completed window
        self.num_steps = 0
        self.num_refits = 0

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """Return acceptance probabilities [batch, position] for features [batch, position].

        position <= num_positions; column k uses intercept b_k. NaN features give NaN.
        """
        self._check_features("features", features)
        positions = features.shape[1]
        return torch.sigmoid(self.slope * features.float() + self.intercepts[:positions])

    def observe(
        self,
        features: torch.Tensor,
        predictions: torch.Tensor,
        num_verified: torch.Tensor,
        num_accepted: torch.Tensor,
        check_values: bool = True,
    ) -> None:
        """Label one step's verified drafts and accumulate them for the next refit.

        features, predictions: [batch, position], as made at draft time.
        num_verified, num_accepted: [batch] integer, 0 <= num_accepted <= num_verified <= position;
        A negative num_accepted (`refit_excluded`) leaves that row unlabelled.
        An empty batch is accepted and changes nothing. Everything is validated before any state
        changes. check_values=True also rejects non-finite features / predictions, predictions
        outside [0, 1] and out-of-range counts (a host sync on CUDA); with False, such entries
        are left unlabelled (counts are clipped, a negative num_accepted labels nothing) so they
        never reach the coefficients. The verifier passes its own `check_values` (False in the
        stages: what it hands on was checked where the step entered the stage).
        """
        if check_values:
            self._check_arguments(features, predictions, num_verified, num_accepted)
        positions = features.shape[1]
        if check_values:
            self._check_values(features, predictions, num_verified, num_accepted, positions)
        labels, mask = verification_labels(num_verified, num_accepted, positions)
        # NaN predictions fail both comparisons, so the range test also drops them
        valid = mask & torch.isfinite(features) & (predictions >= 0) & (predictions <= 1)
        self.stats.add(features, predictions, labels, valid)
        self._add_to_bins(predictions, labels, valid)

    def step(self) -> bool:
        """Count one decode step; refit when the count reaches a multiple of refit_interval."""
        self.num_steps += 1
        if self.num_steps % self.config.refit_interval == 0:
            self.refit()
            return True
        return False

    def refit(self) -> None:
        """Apply one damped Newton step, then start a new window.

        A step with any NaN / inf component is dropped whole; each component is capped at
        `max_step` (trust region); the slope is kept in [min_slope, MAX_SLOPE] and each
        intercept in [-MAX_ABS_INTERCEPT, MAX_ABS_INTERCEPT] (the bounds a snapshot must meet).
        """
        cfg = self.config
        dw, db = newton_step(self.stats, cfg.ridge, cfg.damping)
        ok = torch.isfinite(dw) & torch.isfinite(db).all()
        dw, db = dw.clamp(-cfg.max_step, cfg.max_step), db.clamp(-cfg.max_step, cfg.max_step)
        slope = torch.where(ok, self.slope.double() + dw, self.slope.double())
        intercepts = torch.where(ok, self.intercepts.double() + db, self.intercepts.double())
        self.slope.copy_(slope.clamp(cfg.min_slope, MAX_SLOPE))
        self.intercepts.copy_(intercepts.clamp(-MAX_ABS_INTERCEPT, MAX_ABS_INTERCEPT))
        self.stats.clear()
        self._last_bins.copy_(self._bins)
        self._bins.zero_()
        self.num_refits += 1

    def window_calibration(self) -> dict[str, float]:
        """Calibration over the last completed refit window (host-side, for metrics).

        Returns mean_predicted, observed_rate, ece (10 equal-width bins) and labels (the count);
        with no labels in the window the three rates are NaN.
        """
        sum_p, sum_y, count = self._last_bins.cpu()
        total = float(count.sum())
        if total == 0:
            nan = float("nan")
            return {"mean_predicted": nan, "observed_rate": nan, "ece": nan, "labels": 0.0}
        return {
            "mean_predicted": float(sum_p.sum()) / total,
            "observed_rate": float(sum_y.sum()) / total,
            "ece": float((sum_p - sum_y).abs().sum()) / total,
            "labels": total,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return coefficients, accumulators, counters and config (tensors are CPU copies)."""
        return {
            "config": dataclasses.asdict(self.config),
            "slope": self.slope.detach().cpu().clone(),
            "intercepts": self.intercepts.detach().cpu().clone(),
            "stats": {k: v.cpu() for k, v in self.stats.state_dict().items()},
            "bins": self._bins.cpu().clone(),
            "last_bins": self._last_bins.cpu().clone(),
            "num_steps": self.num_steps,
            "num_refits": self.num_refits,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; all-or-nothing (validated first, ValueError on mismatch).

        The saved config must have the same num_positions; the estimator keeps its own config
        (so a restart may change e.g. refit_interval).
        """
        k = self.config.num_positions
        try:
            saved_k = int(state["config"]["num_positions"])
            slope = torch.as_tensor(state["slope"], dtype=torch.float32)
            intercepts = torch.as_tensor(state["intercepts"], dtype=torch.float32)
            bins = torch.as_tensor(state["bins"], dtype=torch.float64)
            last_bins = torch.as_tensor(state["last_bins"], dtype=torch.float64)
            num_steps, num_refits = int(state["num_steps"]), int(state["num_refits"])
            stats_state = state["stats"]
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed estimator state: {err!r}") from None
        if saved_k != k:
            raise ValueError(f"state has num_positions={saved_k}, estimator has {k}")
        check_shape("slope", slope, ())
        check_shape("intercepts", intercepts, (k,))
        check_shape("bins", bins, (3, NUM_BINS))
        check_shape("last_bins", last_bins, (3, NUM_BINS))
        if not (bool(torch.isfinite(intercepts).all()) and float(slope) >= self.config.min_slope):
            raise ValueError(f"slope must be >= min_slope and intercepts finite, got {slope}")
        if num_steps < 0 or num_refits < 0:
            raise ValueError("num_steps and num_refits must be >= 0")
        probe = SufficientStats(k, self.device)
        probe.load_state_dict(stats_state)  # validates before the real state changes
        self.stats = probe
        self.slope.copy_(slope)
        self.intercepts.copy_(intercepts)
        self._bins.copy_(bins)
        self._last_bins.copy_(last_bins)
        self.num_steps, self.num_refits = num_steps, num_refits

    def _check_arguments(
        self,
        features: torch.Tensor,
        predictions: torch.Tensor,
        num_verified: torch.Tensor,
        num_accepted: torch.Tensor,
    ) -> None:
        self._check_features("features", features)
        batch, positions = features.shape
        check_shape("predictions", predictions, (batch, positions))
        check_shape("num_verified", num_verified, (batch,))
        check_shape("num_accepted", num_accepted, (batch,))
        check_same_device(
            features=features,
            predictions=predictions,
            num_verified=num_verified,
            num_accepted=num_accepted,
        )
        for name, t in (("num_verified", num_verified), ("num_accepted", num_accepted)):
            if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
                raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")

    def _check_features(self, name: str, features: torch.Tensor) -> None:
        check_shape(name, features, (None, None))
        positions = features.shape[1]
        if positions > self.config.num_positions:
            raise ValueError(
                f"{name} has {positions} positions, estimator has {self.config.num_positions}"
            )
        if features.device != self.device:
            raise ValueError(f"{name} on {features.device}, estimator on {self.device}")
        if not features.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {features.dtype}")

    @staticmethod
    def _check_values(
        features: torch.Tensor,
        predictions: torch.Tensor,
        num_verified: torch.Tensor,
        num_accepted: torch.Tensor,
        positions: int,
    ) -> None:
        if not bool(torch.isfinite(features).all()):
            raise ValueError("features contains NaN or inf")
        if not bool((torch.isfinite(predictions) & (predictions >= 0) & (predictions <= 1)).all()):
            raise ValueError("predictions must be finite probabilities in [0, 1]")
        if not bool(((num_verified >= 0) & (num_verified <= positions)).all()):
            raise ValueError(f"num_verified must be in [0, {positions}]")
        if not bool(((num_accepted >= -1 - num_verified) & (num_accepted <= num_verified)).all()):
            raise ValueError("num_accepted must be in [0, num_verified], or -1 - that (unlabelled)")

    def _add_to_bins(
        self, predictions: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor
    ) -> None:
        p = torch.where(valid, predictions.double(), 0.0)
        y = torch.where(valid, labels.double(), 0.0)
        index = (p * NUM_BINS).long().clamp(0, NUM_BINS - 1).flatten()  # [batch * position]
        rows = torch.stack((p.flatten(), y.flatten(), valid.double().flatten()))  # [3, entries]
        # one index_add_ into the flattened [3, NUM_BINS] table: row r's bins start at r * NUM_BINS
        offsets = torch.arange(0, 3 * NUM_BINS, NUM_BINS, device=p.device).unsqueeze(1)
        self._bins.view(-1).index_add_(0, (index + offsets).flatten(), rows.flatten())


def refit_excluded(num_accepted: torch.Tensor) -> torch.Tensor:
    """Encode outcomes that must not feed the refit: a accepted drafts travel as -1 - a.

    The verifier leaves negative rows unlabelled, and `accepted_counts` still recovers a, so
    the accepted-token metrics stay exact for rows kept out of the refit.
    """
    return -1 - num_accepted


def accepted_counts(prev_num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts, feeds the refit) per row of a `prev_num_accepted` [prev_batch]."""
    labelled = prev_num_accepted >= 0
    return torch.where(labelled, prev_num_accepted, -1 - prev_num_accepted), labelled


def verification_labels(
    num_verified: torch.Tensor, num_accepted: torch.Tensor, positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (labels, mask), each [batch, position], from [batch] verification outcomes.

    labels is float (1 accepted, 0 first rejection); mask is True where a label exists.
    A negative num_accepted (-1: not for the refit) labels nothing in its row; other counts are
    clipped into range (num_accepted to num_verified, num_verified to [0, position]).
    """
    pos = torch.arange(positions, device=num_verified.device)  # [position]
    verified = num_verified.long().clamp(0, positions).unsqueeze(1)  # [batch, 1]
    accepted = torch.minimum(num_accepted.long().unsqueeze(1), verified)  # [batch, 1]
    accept = pos < accepted  # [batch, position]
    reject = (pos == accepted) & (accepted < verified)
    return accept.float(), accept | reject
