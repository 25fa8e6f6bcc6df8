"""The in-process speculative step: draft -> adaptive verifier -> target, one call per step.

`SpeculativeStep` takes and returns the step contract (`avspec.contract`) like the Triton
ensemble of the draft, verifier and target models, so the scheduler drives either one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from avspec.av.estimator import AcceptanceEstimator
from avspec.av.step_cost import StepCost
from avspec.av.verifier import AdaptiveVerifier, VerifyDecision
from avspec.config import EstimatorConfig
from avspec.contract import StepInputs, StepOutputs, VerifierInputs, base_tokens
from avspec.engine.draft_stage import DraftOutput, DraftStage
from avspec.engine.head_stage import HeadDraftStage
from avspec.engine.target_stage import TargetStage
from avspec.runtime.head import DraftHead
from avspec.runtime.model_dir import load_model
from avspec.runtime.transformer import Transformer

# (inputs, what the draft produced, the verifier's decision, the target's outputs)
StepObserver = Callable[[StepInputs, DraftOutput, VerifyDecision, StepOutputs], None]


@dataclass(frozen=True)
class StepCapacity:
    """What a step's stages are built to hold: `max_draft_tokens` (K) drafts a row, and KV
    caches of `max_sequences` slots of `max_length` positions each."""

    max_draft_tokens: int
    max_sequences: int
    max_length: int


class SpeculativeStep:
    """One in-process speculative decode step: draft -> adaptive verifier -> target."""

    def __init__(
        self,
        draft: DraftStage,
        verifier: AdaptiveVerifier,
        target: TargetStage,
        on_step: StepObserver | None = None,
    ) -> None:
        """`on_step(inputs, drafted, decision, outputs)` runs after every step (measurement
        tools record rows with it; the served path passes none)."""
        if draft.max_draft_tokens != target.max_draft_tokens:
            raise ValueError(
                f"draft drafts {draft.max_draft_tokens} tokens, target verifies "
                f"{target.max_draft_tokens}"
            )
        self.draft = draft
        self.verifier = verifier
        self.target = target
        self.on_step = on_step

    @property
    def max_draft_tokens(self) -> int:
        return self.draft.max_draft_tokens

    def __call__(self, inputs: StepInputs) -> StepOutputs:
        """Run one step for the whole batch; returns the target's outputs."""
        drafted = self.draft(inputs)
        device = drafted.draft_features.device
        drafting = inputs.adaptive_drafting
        if drafting.numel() == 0:
            drafting = torch.zeros_like(inputs.adaptive)
        # seq ids stay on the host: the verifier matches rows by id there anyway.
        decision = self.verifier.step(
            VerifierInputs(
                seq_ids=inputs.seq_ids,
                features=drafted.draft_features,
                num_draft_tokens=inputs.num_draft_tokens.to(device),
                adaptive=inputs.adaptive.to(device),
                prev_num_accepted=inputs.prev_num_accepted.to(device),
                release_seq_ids=inputs.release_seq_ids,
                base_tokens=base_tokens(inputs.input_lengths, inputs.reusable),
                num_drafted=drafted.num_drafted,
                adaptive_drafting=drafting.to(device),
                prev_timing_ms=inputs.prev_timing_ms,
            )
        )
        outputs = self.target(
            inputs, drafted.draft_tokens, drafted.draft_probs, decision.num_verify
        )
        outputs.next_draft_plan = decision.draft_plan
        outputs.draft_ms = drafted.pass_ms
        outputs.num_drafted = drafted.num_drafted
        if self.on_step is not None:
            self.on_step(inputs, drafted, decision, outputs)
        return outputs

    @classmethod
    def from_model_dirs(
        cls,
        target_dir: str | Path,
        draft_dir: str | Path,
        capacity: StepCapacity,
        device: torch.device | str = "cpu",
        cost: StepCost | None = None,
        dtype: torch.dtype = torch.float32,
        vocab_limit: int | None = None,
    ) -> SpeculativeStep:
        """Load both models (Hugging Face checkpoints, `load_model`) and build a step.

        Default cost: linear, target 10x draft. `vocab_limit`: see `from_models`.
        """
        max_length = capacity.max_length
        context = max_length if max_length > 0 else None
        target_model = load_model(target_dir, device, dtype, context)
        draft_model = load_model(draft_dir, device, dtype, context)
        return cls.from_models(
            target_model, draft_model, capacity, device, cost, vocab_limit=vocab_limit
        )

    @classmethod
    def from_models(
        cls,
        target_model: Transformer,
        draft_model: Transformer | DraftHead,
        capacity: StepCapacity,
        device: torch.device | str = "cpu",
        cost: StepCost | None = None,
        *,
        vocab_limit: int | None = None,
        draft_top_k: int = 0,
    ) -> SpeculativeStep:
        """Build caches, stages and a fresh estimator around two loaded models.

        `vocab_limit`: the tokenizer's size when the models have padded embedding rows
        (`PairInfo.num_tokens`); logits past it are masked to -inf in both stages.
        `draft_top_k`: the draft stage's `top_k` (0: the target's warp). A `DraftHead` as the
        drafter drafts from the target's features (`HeadDraftStage`; the target emits them).
        """
        max_draft_tokens = capacity.max_draft_tokens
        max_sequences, max_length = capacity.max_sequences, capacity.max_length
        tokens = max_sequences * (max_length if max_length > 0 else 1)
        if cost is None:
            cost = StepCost.linear(1.0, 0.01, 10.0, 0.1, max_sequences, tokens)
        estimator = AcceptanceEstimator(EstimatorConfig(num_positions=max_draft_tokens), device)
        draft: DraftStage
        if isinstance(draft_model, DraftHead):
            cache = draft_model.layers.new_cache(max_sequences, max_length, device)
            draft = HeadDraftStage(
                draft_model, cache, max_draft_tokens, vocab_limit=vocab_limit, top_k=draft_top_k
            )
        else:
            cache = draft_model.new_cache(max_sequences, max_length, device)
            draft = DraftStage(
                draft_model, cache, max_draft_tokens, vocab_limit=vocab_limit, top_k=draft_top_k
            )
        return cls(
            draft,
            AdaptiveVerifier(estimator, cost),
            TargetStage(
                target_model,
                target_model.new_cache(max_sequences, max_length, device),
                max_draft_tokens,
                vocab_limit=vocab_limit,
                emit_features=isinstance(draft_model, DraftHead),
            ),
        )
