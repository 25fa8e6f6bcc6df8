"""The tensor contract of one speculative decode step (see docs/architecture.md).

`StepInputs` and `StepOutputs` are what the entry model's scheduler sends to the step ensemble
and gets back; the in-process step (`SpeculativeStep`) and the Triton ensemble take and return
the same fields, so the scheduler cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from avspec.checks import check_shape
from avspec.generators import HostStep

if TYPE_CHECKING:
    from avspec.cost_table import CostTable
    from avspec.draft_stage import DraftStage
    from avspec.target_stage import TargetStage
    from avspec.transformer import Transformer
    from avspec.verifier import AdaptiveVerifier


@dataclass
class StepInputs:
    """One decode step for `batch` sequences. Shapes in the field comments."""

    seq_ids: torch.Tensor  # [batch] int64
    input_ids: torch.Tensor  # [batch, seq] int32, committed tokens new since the last step
    input_lengths: torch.Tensor  # [batch] int32, >= 1
    start_positions: torch.Tensor  # [batch] int32, committed length before input_ids
    reusable: torch.Tensor  # [batch] int32, leading input_ids that were last step's drafts
    num_draft_tokens: torch.Tensor  # [batch] int32, 0..K
    adaptive: torch.Tensor  # [batch] bool
    temperature: torch.Tensor  # [batch] float32, 0 = greedy
    top_p: torch.Tensor  # [batch] float32 in (0, 1]
    random_seed: torch.Tensor  # [batch] int64
    # [prev_batch] int32, previous batch order; negative: kept out of the refit
    # (avspec.estimator.refit_excluded)
    prev_num_accepted: torch.Tensor
    release_seq_ids: torch.Tensor  # [released] int64, freed before this step

    @property
    def batch_size(self) -> int:
        return int(self.seq_ids.shape[0])

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class StepOutputs:
    """What the target returns: accepted drafts then one correction or bonus token."""

    output_ids: torch.Tensor  # [batch, K + 1] int32
    num_accepted: torch.Tensor  # [batch] int32; the sequence gains num_accepted + 1 tokens
    num_verify: torch.Tensor  # [batch] int32, drafts the verifier admitted

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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


def read_step_inputs(inputs: StepInputs, max_draft_tokens: int) -> HostStep:
    """Check `inputs` against the contract and read its bookkeeping vectors to the host.

    Host-side by design: the scheduler builds these small vectors on the CPU, and the stages
    need them as Python ints to pack the ragged batch and apply the cache rule.
    """
    batch = inputs.batch_size
    check_shape("seq_ids", inputs.seq_ids, (batch,))
    check_shape("input_ids", inputs.input_ids, (batch, None))
    for name in _PER_SEQUENCE:
        check_shape(name, getattr(inputs, name), (batch,))
    check_shape("prev_num_accepted", inputs.prev_num_accepted, (None,))
    check_shape("release_seq_ids", inputs.release_seq_ids, (None,))
    step = HostStep(
        seq_ids=inputs.seq_ids.tolist(),
        input_lengths=inputs.input_lengths.tolist(),
        start_positions=inputs.start_positions.tolist(),
        reusable=inputs.reusable.tolist(),
        num_draft_tokens=inputs.num_draft_tokens.tolist(),
        random_seed=inputs.random_seed.tolist(),
        release_seq_ids=inputs.release_seq_ids.tolist(),
    )
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
    return step


class SpeculativeStep:
    """One in-process speculative decode step: draft -> adaptive verifier -> target."""

    def __init__(self, draft: DraftStage, verifier: AdaptiveVerifier, target: TargetStage) -> None:
        if draft.max_draft_tokens != target.max_draft_tokens:
            raise ValueError(
                f"draft drafts {draft.max_draft_tokens} tokens, target verifies "
                f"{target.max_draft_tokens}"
            )
        self.draft = draft
        self.verifier = verifier
        self.target = target

    @property
    def max_draft_tokens(self) -> int:
        return self.draft.max_draft_tokens

    def __call__(self, inputs: StepInputs) -> StepOutputs:
        """Run one step for the whole batch; returns the target's outputs."""
        drafted = self.draft(inputs)
        # Tokens the target runs anyway (pending inputs), host-side from the CPU inputs.
        base_tokens = int((inputs.input_lengths - inputs.reusable).sum())
        device = drafted.draft_features.device
        # seq ids stay on the host: the verifier matches rows by id there anyway.
        decision = self.verifier.step(
            seq_ids=inputs.seq_ids,
            features=drafted.draft_features,
            num_draft_tokens=inputs.num_draft_tokens.to(device),
            adaptive=inputs.adaptive.to(device),
            prev_num_accepted=inputs.prev_num_accepted.to(device),
            release_seq_ids=inputs.release_seq_ids,
            base_tokens=base_tokens,
        )
        return self.target(inputs, drafted.draft_tokens, drafted.draft_probs, decision.num_verify)

    @classmethod
    def from_model_dirs(
        cls,
        target_dir: str | Path,
        draft_dir: str | Path,
        max_draft_tokens: int,
        max_sequences: int,
        max_length: int,
        device: torch.device | str = "cpu",
        draft_cost: CostTable | None = None,
        verify_cost: CostTable | None = None,
    ) -> SpeculativeStep:
        """Load both models and build a step (default cost tables: linear, target 10x draft)."""
        from avspec.model_dir import load_model_dir

        target_model, _ = load_model_dir(target_dir, device)
        draft_model, _ = load_model_dir(draft_dir, device)
        return cls.from_models(
            target_model, draft_model, max_draft_tokens, max_sequences, max_length, device,
            draft_cost, verify_cost,
        )  # fmt: skip

    @classmethod
    def from_models(
        cls,
        target_model: Transformer,
        draft_model: Transformer,
        max_draft_tokens: int,
        max_sequences: int,
        max_length: int,
        device: torch.device | str = "cpu",
        draft_cost: CostTable | None = None,
        verify_cost: CostTable | None = None,
    ) -> SpeculativeStep:
        """Build caches, stages and a fresh estimator around two loaded models."""
        from avspec.config import EstimatorConfig
        from avspec.cost_table import CostTable
        from avspec.draft_stage import DraftStage
        from avspec.estimator import AcceptanceEstimator
        from avspec.kv_cache import KVCache
        from avspec.target_stage import TargetStage
        from avspec.verifier import AdaptiveVerifier

        def make_cache(model: Transformer) -> KVCache:
            dtype = next(model.parameters()).dtype
            return KVCache(model.config, max_sequences, max_length, device, dtype)

        tokens = max_sequences * (max_length if max_length > 0 else 1)
        if draft_cost is None:
            draft_cost = CostTable.linear(1.0, 0.01, max_sequences)
        if verify_cost is None:
            verify_cost = CostTable.linear(10.0, 0.1, tokens)
        estimator = AcceptanceEstimator(EstimatorConfig(num_positions=max_draft_tokens), device)
        return cls(
            DraftStage(draft_model, make_cache(draft_model), max_draft_tokens),
            AdaptiveVerifier(estimator, draft_cost, verify_cost),
            TargetStage(target_model, make_cache(target_model), max_draft_tokens),
        )
