"""The tensor contract of one speculative decode step (see docs/architecture.md).

`StepInputs` and `StepOutputs` are what the entry model's scheduler sends to the step ensemble
and gets back; the in-process step (`SpeculativeStep`) and the Triton ensemble take and return
the same fields, so the scheduler cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


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
    prev_num_accepted: torch.Tensor  # [prev_batch] int32, aligned with the previous step's batch
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
