"""The verifier stage: estimator confidences -> survival -> budget -> admitted draft prefixes.

One `AdaptiveVerifier.step` per decode step (spec sections 2-4), in this order:

1. label the previous step: its outcome `prev_num_accepted` (aligned with the previous batch; -1
   = this row does not feed the refit) and the features / predictions / num_verify recorded then
   go to `estimator.observe`; then
   `estimator.step()` (counts the decode step, refits on schedule);
2. confidences c = estimator.predict(features); survival = cumprod(c) over each request's drafts;
3. budget = argmax expected tokens / cost over the PREVIOUS step's survival values of the
   sequences present now (matched by seq id on the host; a sequence with no previous values
   scores 1.0 at each candidate position), with T = base_tokens + the drafts of requests whose
   `adaptive` flag is off (those are verified in full and take no part in the top-k);
4. admission: the `budget` best survival values among adaptive candidates (avspec.av.survival);
5. record this step for the next one, forget released sequences.

Why stale scores (losslessness): whether draft x_i is verified may depend only on what was known
before x_i was drawn. Top-k admission with a given budget satisfies this; a budget computed from
this step's survival values does not, because deeper values depend on x_i. Spec section 4's
staircase: one request, costs 1 with no drafts and 2 with one or two, s1 = 0.8, s2 = 0.8 * c2(x1):
the current-step argmax verifies both drafts when s2 > 0.2 and none otherwise, so whether x1 is
verified depends on x1 itself (tests/unit/av/test_lossless.py measures the bias). The previous
step's values are fixed before any of this step's drafts are drawn, so any budget built from them
is safe.

Host-side work: seq ids are read on the host (a device `seq_ids` is copied, which syncs) to
match rows; `check_values=True` also validates values on the host. Everything else stays on the
features' device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avspec.av.budget import choose_budget
from avspec.av.cost_table import CostTable
from avspec.av.estimator import AcceptanceEstimator, accepted_counts
from avspec.av.survival import admit, survival
from avspec.checks import check_finite, check_same_device, check_shape


@dataclass
class VerifyDecision:
    """What the verifier decided for one step. Shapes in the field comments."""

    num_verify: torch.Tensor  # [batch] int32, prefix of drafts to verify, <= num_draft_tokens
    confidences: torch.Tensor  # [batch, position] fp32, predicted acceptance probabilities
    survival: torch.Tensor  # [batch, position] fp32, 0 at padding positions
    budget: torch.Tensor  # [] int64, drafts admitted among adaptive requests (an upper bound)
    drafted: torch.Tensor  # [] int64, sum of num_draft_tokens
    verified: torch.Tensor  # [] int64, sum of num_verify
    trimmed: torch.Tensor  # [] int64, drafted - verified


@dataclass
class _Record:
    """The inputs of a step that its outcome, arriving next step, will label."""

    features: torch.Tensor  # [batch, position]
    predictions: torch.Tensor  # [batch, position]
    num_verify: torch.Tensor  # [batch]


class AdaptiveVerifier:
    """Chooses how many drafts each request verifies, and feeds outcomes back to the estimator."""

    def __init__(
        self,
        estimator: AcceptanceEstimator,
        draft_cost: CostTable,
        verify_cost: CostTable,
        check_values: bool = True,
    ) -> None:
        self.estimator = estimator
        self.draft_cost = draft_cost
        self.verify_cost = verify_cost
        self.check_values = check_values
        self._pending: _Record | None = None
        # Last step's survival rows [prev_batch, position] and seq id -> row; released ids leave
        # the map. In steady state the batch repeats in order and the rows are reused as they are.
        self._stale: dict[int, int] = {}
        self._stale_values = torch.ones(0, 0)
        self.num_steps = 0
        self.num_observed = 0
        self.num_dropped_records = 0  # outcomes whose length did not match the recorded batch

    def step(
        self,
        seq_ids: torch.Tensor,
        features: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        adaptive: torch.Tensor,
        prev_num_accepted: torch.Tensor,
        release_seq_ids: torch.Tensor,
        base_tokens: int,
    ) -> VerifyDecision:
        """Decide num_verify for one step; see the module docstring for the order of work.

        seq_ids [batch] int64 (distinct), features [batch, position] fp (logit q_max; padding
        positions may hold anything), num_draft_tokens [batch] int in 0..position, adaptive
        [batch] bool, prev_num_accepted [prev_batch] int (empty = no outcome; a length other than
        the previous batch drops that record, counted in num_dropped_records; -1 leaves that row
        unlabelled), release_seq_ids
        [released] int64 (forgotten before matching, so a reused id counts as new), base_tokens:
        tokens the target runs anyway. An empty batch is valid (e.g. a release-only call): it
        labels the previous step, returns empty tensors and does not count as a decode step.
        Bad input raises ValueError before any state changes.
        """
        ids, released = self._validate(
            seq_ids, features, num_draft_tokens, adaptive, prev_num_accepted, release_seq_ids,
            base_tokens,
        )  # fmt: skip
        self._label_previous(prev_num_accepted)
        batch, num_pos = features.shape
        for seq_id in released:
            self._stale.pop(seq_id, None)
        if batch == 0:
            self._pending = None
            return _empty_decision(features)
        self.estimator.step()
        self.num_steps += 1

        positions = torch.arange(num_pos, device=features.device)
        candidates = positions < num_draft_tokens[:, None]  # [batch, position]
        clean = torch.where(candidates, features.float(), torch.zeros_like(features.float()))
        confidences = self.estimator.predict(clean)
        values, candidates = survival(confidences, num_draft_tokens)

        in_topk = candidates & adaptive[:, None]
        stale = self._stale_rows(ids, num_pos, features.device)
        scores = torch.where(in_topk, stale, torch.zeros_like(stale)).flatten()
        full = torch.where(adaptive, torch.zeros_like(num_draft_tokens), num_draft_tokens)
        total_base = base_tokens + full.long().sum()
        budget = choose_budget(scores, batch, total_base, self.draft_cost, self.verify_cost)
        admitted = admit(values, in_topk, budget)
        num_verify = torch.where(adaptive, admitted, num_draft_tokens.int()).int()

        self._pending = _Record(clean, confidences, num_verify)
        # Survival with padding confidences set to 1: the last candidate's value carried forward,
        # 1.0 for a row with no candidates, so a longer row next step still has scores.
        rows = torch.cumprod(torch.where(candidates, confidences, torch.ones_like(confidences)), -1)
        self._stale = {seq_id: index for index, seq_id in enumerate(ids)}
        self._stale_values = rows
        drafted = num_draft_tokens.long().sum()
        verified = num_verify.long().sum()
        return VerifyDecision(
            num_verify, confidences, values, budget, drafted, verified, drafted - verified
        )

    def _label_previous(self, prev_num_accepted: torch.Tensor) -> None:
        pending = self._pending
        if prev_num_accepted.numel() == 0:
            self._pending = None
            return
        if pending is None or pending.num_verify.shape[0] != prev_num_accepted.shape[0]:
            self._pending = None
            self.num_dropped_records += 1
            return
        self.estimator.observe(
            pending.features,
            pending.predictions,
            pending.num_verify,
            prev_num_accepted,
            check_values=self.check_values,
        )
        self._pending = None
        self.num_observed += 1

    def _stale_rows(self, ids: list[int], num_pos: int, device: torch.device) -> torch.Tensor:
        """Previous survival rows [batch, position] for `ids`; 1.0 for sequences without one."""
        values = _fit_columns(self._stale_values, num_pos)
        if len(ids) == values.shape[0] and list(self._stale) == ids:
            return values  # the same batch in the same order as last step
        ones = torch.ones(num_pos, device=device)
        return torch.stack([values[self._stale[i]] if i in self._stale else ones for i in ids])

    def _validate(
        self,
        seq_ids: torch.Tensor,
        features: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        adaptive: torch.Tensor,
        prev_num_accepted: torch.Tensor,
        release_seq_ids: torch.Tensor,
        base_tokens: int,
    ) -> tuple[list[int], list[int]]:
        check_shape("features", features, (None, None))
        batch, num_pos = features.shape
        check_shape("seq_ids", seq_ids, (batch,))
        check_shape("num_draft_tokens", num_draft_tokens, (batch,))
        check_shape("adaptive", adaptive, (batch,))
        check_shape("prev_num_accepted", prev_num_accepted, (None,))
        check_shape("release_seq_ids", release_seq_ids, (None,))
        check_same_device(features=features, num_draft_tokens=num_draft_tokens, adaptive=adaptive)
        if prev_num_accepted.numel():
            check_same_device(features=features, prev_num_accepted=prev_num_accepted)
        if batch and num_pos == 0:
            raise ValueError("features has K = 0 draft positions; K must be >= 1")
        limit = self.estimator.config.num_positions
        if num_pos > limit:
            raise ValueError(f"features has {num_pos} positions, estimator has {limit}")
        if features.device != self.estimator.device:
            raise ValueError(f"features on {features.device}, estimator on {self.estimator.device}")
        if not features.is_floating_point():
            raise ValueError(f"features must be floating point, got {features.dtype}")
        if adaptive.dtype != torch.bool:
            raise ValueError(f"adaptive must be a bool tensor, got {adaptive.dtype}")
        for name, t in (
            ("seq_ids", seq_ids), ("num_draft_tokens", num_draft_tokens),
            ("prev_num_accepted", prev_num_accepted), ("release_seq_ids", release_seq_ids),
        ):  # fmt: skip
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        if isinstance(base_tokens, bool) or not isinstance(base_tokens, int) or base_tokens < 0:
            raise ValueError(f"base_tokens must be an int >= 0, got {base_tokens!r}")
        ids = [int(i) for i in seq_ids.cpu().tolist()]
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be distinct, got {ids}")
        if self.check_values:
            self._check_values(features, num_draft_tokens, prev_num_accepted)
        return ids, [int(i) for i in release_seq_ids.cpu().tolist()]

    def _check_values(
        self,
        features: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        prev_num_accepted: torch.Tensor,
    ) -> None:
        num_pos = features.shape[1]
        if bool(((num_draft_tokens < 0) | (num_draft_tokens > num_pos)).any()):
            raise ValueError(f"num_draft_tokens must lie in 0..{num_pos}")
        candidates = torch.arange(num_pos, device=features.device) < num_draft_tokens[:, None]
        check_finite("features at draft positions", torch.where(candidates, features, 0.0))
        if bool((features[candidates] == float("-inf")).any()):
            raise ValueError("features at draft positions contains -inf")
        pending = self._pending
        if pending is not None and pending.num_verify.shape[0] == prev_num_accepted.shape[0]:
            accepted, _ = accepted_counts(prev_num_accepted)
            if bool((accepted > pending.num_verify).any()):
                raise ValueError(
                    "prev_num_accepted must lie in 0..the previous step's num_verify, "
                    "or be -1 - that (refit_excluded: not for the refit)"
                )


def _fit_columns(values: torch.Tensor, num_pos: int) -> torch.Tensor:
    """Rows [n, old_position] cut or extended (repeating the last column, or 1.0) to num_pos."""
    if values.shape[1] >= num_pos:
        return values[:, :num_pos]
    last = values[:, -1:] if values.shape[1] else values.new_ones(values.shape[0], 1)
    return torch.cat([values, last.expand(-1, num_pos - values.shape[1])], dim=1)


def _empty_decision(features: torch.Tensor) -> VerifyDecision:
    device = features.device
    empty = torch.zeros(features.shape, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return VerifyDecision(
        torch.zeros(0, dtype=torch.int32, device=device), empty, empty.clone(), zero, zero,
        zero.clone(), zero.clone(),
    )  # fmt: skip
