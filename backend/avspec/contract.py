"""The tensor contract of one speculative decode step (see docs/architecture.md).

`StepInputs` and `StepOutputs` are what the entry model's scheduler sends to the step ensemble
and gets back; the in-process step (`SpeculativeStep`) and the Triton ensemble take and return
the same fields, so the scheduler cannot tell them apart.

Each tensor field declares its dtype and shape (`tensor`, read back as `TensorSpec`s):
`STEP_TENSORS` is every tensor of the step by name, the one declaration that the serving dtype
tables and the model repository's config.pbtxt files (avspec.serving.model_configs) derive from.

`HostStep` is the host view the stages read (`read_step_inputs`), and `base_tokens` the budget's
T, one rule for every caller. The bottom layer above the utilities: it imports no stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from avspec.checks import check_shape

# numpy dtype of each torch dtype a step tensor may have (what the Triton adapters hold).
NUMPY_DTYPES: dict[torch.dtype, type] = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
    torch.float32: np.float32,
}


@dataclass(frozen=True)
class TensorSpec:
    """A step tensor as every model passing it declares it: name, dtype and symbolic shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[str, ...]  # e.g. ("batch", "K"): the rank; every dimension varies per step

    @property
    def numpy_dtype(self) -> type:
        return NUMPY_DTYPES[self.dtype]

    @property
    def dims(self) -> tuple[int, ...]:
        """Triton's dims: -1 (variable) for every dimension."""
        return (-1,) * len(self.shape)


_TENSOR = "tensor"  # the field metadata key holding a field's (dtype, shape)


def tensor(dtype: torch.dtype, *shape: str, empty_default: bool = False) -> Any:
    """A contract field's declaration: its dtype and shape (machine-readable), and with
    `empty_default` an empty tensor of that dtype as default (an optional tensor)."""
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"no step tensor has dtype {dtype}")
    metadata = {_TENSOR: (dtype, shape)}
    if empty_default:  # empty, of the declared rank
        empty = (0,) * len(shape)
        return field(default_factory=lambda: torch.zeros(empty, dtype=dtype), metadata=metadata)
    return field(metadata=metadata)


def tensor_specs(cls: type) -> tuple[TensorSpec, ...]:
    """The TensorSpecs of a contract dataclass's fields, in field order."""
    return tuple(TensorSpec(f.name, *f.metadata[_TENSOR]) for f in fields(cls))


@dataclass
class StepInputs:
    """One decode step for `batch` sequences. Shapes in the field comments."""

    seq_ids: torch.Tensor = tensor(torch.int64, "batch")  # [batch] int64
    # [batch, seq] int32, committed tokens new since the last step
    input_ids: torch.Tensor = tensor(torch.int32, "batch", "seq")
    input_lengths: torch.Tensor = tensor(torch.int32, "batch")  # [batch] int32, >= 1
    # [batch] int32, committed length before input_ids
    start_positions: torch.Tensor = tensor(torch.int32, "batch")
    # [batch] int32, leading input_ids that were last step's drafts
    reusable: torch.Tensor = tensor(torch.int32, "batch")
    num_draft_tokens: torch.Tensor = tensor(torch.int32, "batch")  # [batch] int32, 0..K
    # [batch] bool, drafts compete in the verifier's top-k
    adaptive: torch.Tensor = tensor(torch.bool, "batch")
    temperature: torch.Tensor = tensor(torch.float32, "batch")  # [batch] float32, 0 = greedy
    top_p: torch.Tensor = tensor(torch.float32, "batch")  # [batch] float32 in (0, 1]
    random_seed: torch.Tensor = tensor(torch.int64, "batch")  # [batch] int64
    # [prev_batch] int32, previous batch order; negative: kept out of the refit
    # (avspec.av.estimator.refit_excluded)
    prev_num_accepted: torch.Tensor = tensor(torch.int32, "prev_batch")
    # [released] int64, freed before this step
    release_seq_ids: torch.Tensor = tensor(torch.int64, "released")
    # [batch] bool: an adaptive row also stops drafting by the plan (avspec.av.drafting)
    adaptive_drafting: torch.Tensor = tensor(torch.bool, "batch", empty_default=True)
    # [4 + K] float32, the previous step's DraftPlan; empty: no plan, every row drafts its cap
    draft_plan: torch.Tensor = tensor(torch.float32, "plan", empty_default=True)
    # [K + 2] float32, the previous step's draft ms per pass, target ms, step wall ms; or empty
    prev_timing_ms: torch.Tensor = tensor(torch.float32, "timing", empty_default=True)
    # The previous step's StepOutputs.target_features, feature_counts and feature_starts (a draft
    # head's input, avspec.engine.head_stage); empty: none (a draft model ignores them)
    prev_target_features: torch.Tensor = tensor(
        torch.float32, "prev_features", "width", empty_default=True
    )
    prev_feature_counts: torch.Tensor = tensor(torch.int32, "prev_batch", empty_default=True)
    prev_feature_starts: torch.Tensor = tensor(torch.int32, "prev_batch", empty_default=True)

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

    output_ids: torch.Tensor = tensor(torch.int32, "batch", "K + 1")  # [batch, K + 1] int32
    # [batch] int32; the sequence gains num_accepted + 1 tokens
    num_accepted: torch.Tensor = tensor(torch.int32, "batch")
    num_verify: torch.Tensor = tensor(torch.int32, "batch")  # [batch] int32, drafts admitted
    # [4 + K] float32, the plan of the next step (avspec.av.drafting); empty: none
    next_draft_plan: torch.Tensor = tensor(torch.float32, "plan", empty_default=True)
    # [K] float32, ms per draft pass
    draft_ms: torch.Tensor = tensor(torch.float32, "K", empty_default=True)
    # [batch] int32, drafts the draft stage produced (<= num_draft_tokens); empty: not reported
    num_drafted: torch.Tensor = tensor(torch.int32, "batch", empty_default=True)
    target_ms: torch.Tensor = tensor(torch.float32, "1", empty_default=True)  # [1] ms
    # [features, width] float32: the target's last hidden state after its final norm at every
    # position it ran this step and kept (pending inputs, then accepted drafts), row after row;
    # only from a target that emits them (a draft head reads them next step), else empty
    target_features: torch.Tensor = tensor(torch.float32, "features", "width", empty_default=True)
    feature_counts: torch.Tensor = tensor(torch.int32, "batch", empty_default=True)  # per row
    # [batch] int32, the sequence position of each row's first feature
    feature_starts: torch.Tensor = tensor(torch.int32, "batch", empty_default=True)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


STEP_INPUTS = tensor_specs(StepInputs)
STEP_OUTPUTS = tensor_specs(StepOutputs)
_OUT = {spec.name: spec for spec in STEP_OUTPUTS}
# What the draft stage hands the verifier and the target besides the StepInputs.
DRAFT_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("draft_tokens", torch.int32, ("batch", "K")),  # [batch, K] int32
    TensorSpec("draft_probs", torch.float32, ("batch", "K", "vocab")),  # q, [batch, K, vocab]
    TensorSpec("draft_features", torch.float32, ("batch", "K")),  # logit(q_max), [batch, K]
    _OUT["num_drafted"],
    _OUT["draft_ms"],
)
# The target's outputs a draft head reads the next step (empty unless the target emits them).
FEATURE_OUTPUTS = ("target_features", "feature_counts", "feature_starts")


def no_features() -> dict[str, torch.Tensor]:
    """FEATURE_OUTPUTS empty, of their declared dtypes and ranks (a target that emits none)."""
    specs = (_OUT[name] for name in FEATURE_OUTPUTS)
    return {spec.name: torch.zeros((0,) * len(spec.shape), dtype=spec.dtype) for spec in specs}


# Every tensor of one step by name: the names the models and the ensemble pass them under.
STEP_TENSORS: dict[str, TensorSpec] = {
    spec.name: spec for spec in (*STEP_INPUTS, *DRAFT_OUTPUTS, *STEP_OUTPUTS)
}


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
    check_shape("prev_target_features", inputs.prev_target_features, (None, None))
    check_shape("prev_feature_counts", inputs.prev_feature_counts, (None,))
    count = inputs.prev_feature_counts.shape[0]
    check_shape("prev_feature_starts", inputs.prev_feature_starts, (count,))


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
    counts, features = inputs.prev_feature_counts, inputs.prev_target_features
    if counts.numel() and (bool((counts < 0).any()) or int(counts.sum()) != features.shape[0]):
        raise ValueError(
            f"prev_feature_counts must be >= 0 and add up to prev_target_features' "
            f"{features.shape[0]} rows, got {counts.tolist()}"
        )
    if bool((inputs.prev_feature_starts < 0).any()):
        raise ValueError("prev_feature_starts must be >= 0")


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
