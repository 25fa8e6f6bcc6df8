"""The cost model of one speculative step, in milliseconds, as the plan and the budget see it.

    step_ms = overhead_ms                                   fixed: the served path's hops, verifier
            + draft_pass(tokens the draft runs first)       the pass over pending inputs (draft 0)
            + sum_{p >= 1} draft_pass(rows drafting at p)   one decode pass per further draft
            + verify(tokens the target runs)                base tokens + admitted drafts

`draft_pass` is the cost of one draft forward as a function of the rows (tokens) it runs; a pass
with no row is not run and costs 0. `verify` is the target forward as a function of tokens. Both
are `CostTable`s (monotone, measured; avspec.tools.profiler). The file format is
`avspec.av.cost_file`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avspec.av.cost_table import CostTable


@dataclass
class StepCost:
    """Overhead plus the draft-pass and verify cost tables of one step."""

    draft_pass: CostTable  # ms of one draft forward, by rows (tokens) in it
    verify: CostTable  # ms of the target forward, by tokens
    overhead_ms: float = 0.0  # per-step fixed cost paid whatever is drafted or verified

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.overhead_ms) < float("inf"):
            raise ValueError(f"overhead_ms must be finite and >= 0, got {self.overhead_ms}")
        self.overhead_ms = float(self.overhead_ms)

    def pass_ms(self, rows: torch.Tensor) -> torch.Tensor:
        """ms of draft passes with `rows` rows each (any shape); 0 where rows == 0 (not run)."""
        cost = self.draft_pass(rows).double()
        return torch.where(rows > 0, cost, torch.zeros_like(cost))

    @classmethod
    def linear(
        cls,
        draft_fixed_ms: float,
        draft_per_row_ms: float,
        verify_fixed_ms: float,
        verify_per_token_ms: float,
        max_rows: int,
        max_tokens: int,
        overhead_ms: float = 0.0,
    ) -> StepCost:
        """Straight-line tables (defaults and tests): fixed + per-unit * size."""
        return cls(
            CostTable.linear(draft_fixed_ms, draft_per_row_ms, max_rows, name="draft_pass"),
            CostTable.linear(verify_fixed_ms, verify_per_token_ms, max_tokens, name="verify"),
            overhead_ms,
        )
