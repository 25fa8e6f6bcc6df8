"""The tensor contract of one speculative decode step (see docs/architecture.md).

`StepInputs` and `StepOutputs` are what the entry model's scheduler sends to the step ensemble
and gets back; the in-process step (`SpeculativeStep`) and the Triton ensemble take and return
the same fields, so the scheduler cannot tell them apart.

`HostStep` is the host view the stages read (`read_step_inputs`), and `base_tokens` the budget's
T, one rule for every caller. The bottom layer above the utilities: it imports no stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from avspec.checks import check_shape


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(0, dtype=dtype)


@dataclass
class StepInputs:
    """One decode step for `batch` sequences. Shapes in the field comments."""

    seq_ids: torch.Tensor  # [batch] int64
    input_ids: torch.Tensor  # [batch, seq] int32, committed tokens new since the last step
    input_lengths: torch.Tensor  # [batch] int32, >= 1
    start_positions: torch.Tensor  # [batch] int32, committed length before input_ids
    reusable: torch.Tensor  # [batch] int32, leading input_ids that were last step's drafts
    num_draft_tokens: torch.Tensor  # [batch] int32, 0..K
    adaptive: torch.Tensor  # [batch] bool, drafts compete in the verifier's top-k
    temperature: torch.Tensor  # [batch] float32, 0 = greedy
    top_p: torch.Tensor  # [batch] float32 in (0, 1]
    random_seed: torch.Tensor  # [batch] int64
    # [prev_batch] int32, previous batch order; negative: kept out of the refit
    # (avspec.av.estimator.refit_excluded)
    prev_num_accepted: torch.Tensor
    release_seq_ids: torch.Tensor  # [released] int64, freed before this step
    # [batch] bool: an adaptive row also stops drafting by the plan (avspec.av.drafting)
    adaptive_drafting: torch.Tensor = field(default_factory=lambda: _empty(torch.bool))
    # [3 + K] float32, the previous step's DraftPlan; empty: no plan, every row drafts its cap
    draft_plan: torch.Tensor = field(default_factory=lambda: _empty(torch.float32))
    # [K + 2] float32, the previous step's draft ms per pass, target ms, step wall ms; or empty
    prev_timing_ms: torch.Tensor = field(default_factory=lambda: _empty(torch.float32))

    @property
    def batch_size(self) -> int:
        return int(self.seq_ids.shape[0])

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class VerifierInputs:
    """What the verifier reads of one step: the StepInputs it needs and the draft's output.

    An empty batch is valid (a release-only call): it labels the previous step only.
    """

    seq_ids: torch.Tensor  # [batch] int64, distinct
    features: torch.Tensor  # [batch, position] float, logit(q_max); padding may hold anything
    num_draft_tokens: torch.Tensor  # [batch] int in 0..position, the caps
    adaptive: torch.Tensor  # [batch] bool
    # [prev_batch] int, previous batch order; empty: no outcome; another length drops that
    # record; negative: unlabelled (kept out of the refit)
    prev_num_accepted: torch.Tensor
    release_seq_ids: torch.Tensor  # [released] int64, forgotten before matching
    base_tokens: int  # tokens the target runs anyway (`base_tokens` below)
    num_drafted: torch.Tensor | None = None  # [batch] int in 0..caps; None: the caps
    adaptive_drafting: torch.Tensor | None = (
        None  # [batch] bool, rows the plan may stop; None: none
    )
    prev_timing_ms: torch.Tensor | None = None  # [K + 2]; None or empty: no timing


@dataclass
class StepOutputs:
    """What the target returns: accepted drafts then one correction or bonus token."""

    output_ids: torch.Tensor  # [batch, K + 1] int32
    num_accepted: torch.Tensor  # [batch] int32; the sequence gains num_accepted + 1 tokens
    num_verify: torch.Tensor  # [batch] int32, drafts the verifier admitted
    # [3 + K] float32, the plan of the next step (avspec.av.drafting); empty: none
    next_draft_plan: torch.Tensor = field(default_factory=lambda: _empty(torch.float32))
    draft_ms: torch.Tensor = field(default_factory=lambda: _empty(torch.float32))  # [K] ms per pass
    # [batch] int32, drafts the draft stage produced (<= num_draft_tokens); empty: not reported
    num_drafted: torch.Tensor = field(default_factory=lambda: _empty(torch.int32))
    target_ms: torch.Tensor = field(default_factory=lambda: _empty(torch.float32))  # [1] ms

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class HostStep:
    """The bookkeeping vectors of one step, read to the host once (they arrive on the CPU)."""

    seq_ids: list[int]
    input_lengths: list[int]
    start_positions: list[int]
    reusable: list[int]
    num_draft_tokens: list[int]
    random_seed: list[int]
    release_seq_ids: list[int]
    adaptive: list[bool]
    adaptive_drafting: list[bool]


_PER_SEQUENCE = (
    "input_lengths",
    "start_positions",
    "reusable",
    "num_draft_tokens",
    "adaptive",
    "temperature",
    "top_p",
    "random_seed",
)


def read_step_inputs(inputs: StepInputs, max_draft_tokens: int, check: bool = True) -> HostStep:
    """Check `inputs` against the contract and read its bookkeeping vectors to the host.

    Host-side by design: the scheduler builds these small vectors on the CPU, and the stages
    need them as Python ints to pack the ragged batch and apply the cache rule. The check runs
    once a step, where the step enters its first stage (the draft's); the target, which gets
    the same inputs after the draft, reads them with `check=False`.
    """
    batch = inputs.batch_size
    drafting = inputs.adaptive_drafting
    if drafting.numel() == 0:  # not sent: fixed drafting
        drafting = torch.zeros(batch, dtype=torch.bool)
    if check:
        _check_shapes(inputs, drafting)
    step = HostStep(
        seq_ids=inputs.seq_ids.tolist(),
        input_lengths=inputs.input_lengths.tolist(),
        start_positions=inputs.start_positions.tolist(),
        reusable=inputs.reusable.tolist(),
        num_draft_tokens=inputs.num_draft_tokens.tolist(),
        random_seed=inputs.random_seed.tolist(),
        release_seq_ids=inputs.release_seq_ids.tolist(),
        adaptive=inputs.adaptive.tolist(),
        adaptive_drafting=drafting.tolist(),
    )
    if check:
        _check_values(inputs, step, max_draft_tokens)
    return step


def _check_shapes(inputs: StepInputs, drafting: torch.Tensor) -> None:
    batch = inputs.batch_size
    check_shape("seq_ids", inputs.seq_ids, (batch,))
    check_shape("input_ids", inputs.input_ids, (batch, None))
    for name in _PER_SEQUENCE:
        check_shape(name, getattr(inputs, name), (batch,))
    check_shape("prev_num_accepted", inputs.prev_num_accepted, (None,))
    check_shape("release_seq_ids", inputs.release_seq_ids, (None,))
    check_shape("adaptive_drafting", drafting, (batch,))
    check_shape("draft_plan", inputs.draft_plan, (None,))
    check_shape("prev_timing_ms", inputs.prev_timing_ms, (None,))


def _check_values(inputs: StepInputs, step: HostStep, max_draft_tokens: int) -> None:
    batch = inputs.batch_size
    width = inputs.input_ids.shape[1]
    if len(set(step.seq_ids)) != batch:
        raise ValueError(f"seq_ids must be distinct, got {step.seq_ids}")
    for i in range(batch):
        length, reusable = step.input_lengths[i], step.reusable[i]
        if not 1 <= length <= width:
            raise ValueError(f"input_lengths[{i}] = {length} outside 1..{width}")
        if not 0 <= reusable < length:
            raise ValueError(f"reusable[{i}] = {reusable} outside 0..input_lengths - 1")
        if step.start_positions[i] < 0:
            raise ValueError(f"start_positions[{i}] = {step.start_positions[i]} is negative")
        if not 0 <= step.num_draft_tokens[i] <= max_draft_tokens:
            raise ValueError(
                f"num_draft_tokens[{i}] = {step.num_draft_tokens[i]} outside 0..{max_draft_tokens}"
            )
    if bool((inputs.temperature < 0).any()) or bool(torch.isnan(inputs.temperature).any()):
        raise ValueError("temperature must be >= 0")
    if bool(((inputs.top_p <= 0) | (inputs.top_p > 1) | torch.isnan(inputs.top_p)).any()):
        raise ValueError("top_p must lie in (0, 1]")


def base_tokens(
    input_lengths: torch.Tensor | np.ndarray, reusable: torch.Tensor | np.ndarray
) -> int:
    """T of the budget rule: tokens the target runs this step whatever the verifier admits.

    Each row runs its pending inputs, `input_lengths - reusable` (the reusable ones are last
    step's accepted drafts, already in the target's cache). input_lengths, reusable: [batch]
    integers, torch or numpy (the Triton adapters hold numpy), on the CPU where the scheduler
    builds them.
    """
    return int((input_lengths - reusable).sum())
