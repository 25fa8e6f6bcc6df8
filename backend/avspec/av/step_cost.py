"""The cost model of one speculative step, in milliseconds, as the plan and the budget see it.

    step_ms = overhead_ms                                   fixed: the served path's hops, verifier
            + pending_pass(tokens the draft runs first)     the pass over pending inputs (draft 0)
            + sum_{p >= 1} draft_pass(rows drafting at p)   one decode pass per further draft
            + verify(tokens the target runs)                base tokens + admitted drafts
            + verify_row_ms * rows the target runs          per-row work (sampling, attention
                                                            over each row's own context)
            + probs_row_ms * rows * width                   the hop of the draft's probabilities
                                                            [rows, width, vocab] to the target

`draft_pass` is the cost of one draft forward as a function of the rows (tokens) it runs; a pass
with no row is not run and costs 0. `pending_pass` prices the first pass, over each row's pending
inputs, by its tokens; None (as profiled) means the draft-pass table. Served, the first pass
costs more than a decode pass of as many rows: its time also holds the cache rule (each row's
rejected drafts rolled back) and the gathering of each row's inputs. On this project's CPU host
(torch bf16, chat at temperature 0.7, bench/av_sweep/torch-t0.7-chat-defer) it ran at 2.2-2.5x
the profiled draft pass from 1 to 64 tokens, the decode passes at 1.5-1.7x; a table shared by
both, refreshed at its ladder sizes, priced neither. `avspec.av.cost_refresh` learns it as a
table of its own. `verify` is the target forward as a function of tokens, net of its per-row
part: measured here, 64 tokens cost 28 ms as 64 rows of 1 and 14 ms as 16 rows of 4, so a table
by tokens alone mistakes batch size for verification cost. All are
`CostTable`s (monotone, measured; avspec.tools.bench.profiler). The file format is
`avspec.av.cost_file`.

`probs_row_ms` prices the draft's probabilities on their way to the target: a float32 tensor of
[rows, width, vocab], width the deepest draft position any row may reach this step (on the CPU,
where passes are compacted; CUDA sends all K positions, a width the plan does not change). On the
CPU host (vocab 49,152, 192 KiB a row and position) the steps' time outside the stages grew by
0.20-0.27 ms per row and position (least squares with outliers trimmed over the step logs of
bench/av_sweep/torch-t0.7-{chat,code}, torch-t1.0-chat, torch-t0.7-chat-defer): at 64 rows,
13-17 ms for each deeper draft, a third of a served 64-row decode pass. Profiling in process has
no hop: it is 0 as profiled and learned from served steps (avspec.av.cost_refresh).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from avspec.av.cost_table import CostTable


@dataclass
class StepCost:
    """Overhead plus the draft-pass and verify cost tables of one step."""

    draft_pass: CostTable  # ms of one draft forward, by rows (tokens) in it
    verify: CostTable  # ms of the target forward, by tokens
    overhead_ms: float = 0.0  # per-step fixed cost paid whatever is drafted or verified
    verify_row_ms: float = 0.0  # target ms per row it runs, besides the tokens
    pending_pass: CostTable | None = None  # ms of the pass over pending inputs (None: draft_pass)
    probs_row_ms: float = 0.0  # ms per row and draft position of the probabilities' hop

    def __post_init__(self) -> None:
        for name in ("overhead_ms", "verify_row_ms", "probs_row_ms"):
            value = float(getattr(self, name))
            if not 0.0 <= value < float("inf"):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
            setattr(self, name, value)

    @property
    def first_pass(self) -> CostTable:
        """The table that prices the draft's pass over pending inputs."""
        return self.draft_pass if self.pending_pass is None else self.pending_pass

    def pending_ms(self, tokens: float) -> float:
        """Host ms of the draft's pass over `tokens` pending inputs (0 tokens: not run)."""
        return self.first_pass.at(tokens) if tokens > 0 else 0.0

    def verify_ms(self, tokens: float, rows: float) -> float:
        """Host ms of the target over `tokens` tokens in `rows` rows."""
        return (self.verify.at(tokens) if tokens > 0 else 0.0) + self.verify_row_ms * rows

    def step_ms(self, rows_per_pass: Sequence[int], verify_tokens: int, verify_rows: int) -> float:
        """Host ms of one step: draft passes of `rows_per_pass` rows (pass 0: the pending tokens,
        priced by `first_pass`; a pass with 0 rows is not run) and the target over
        `verify_tokens` in `verify_rows`."""
        draft = sum(
            (self.first_pass if p == 0 else self.draft_pass).at(r)
            for p, r in enumerate(rows_per_pass)
            if r > 0
        )
        hop = self.probs_row_ms * verify_rows * draft_width(rows_per_pass)
        return self.overhead_ms + draft + hop + self.verify_ms(verify_tokens, verify_rows)

    def pass_ms(self, rows: torch.Tensor) -> torch.Tensor:
        """ms of draft passes with `rows` rows each (any shape); 0 where rows == 0 (not run)."""
        cost = self.draft_pass(rows).double()
        return torch.where(rows > 0, cost, torch.zeros_like(cost))

    def verify_to_draft_ratio(self, rows: int, drafts: int) -> float:
        """Target ms per verified token over draft ms per row of a pass, at `rows` rows each
        verifying `drafts` drafts: how many draft passes one verified token costs (an 8B target
        over a 1B draft is about 8 on a GPU)."""
        if rows < 1 or drafts < 0:
            raise ValueError(f"need rows >= 1 and drafts >= 0, got {rows}, {drafts}")
        tokens = rows * (1 + drafts)
        per_token = self.verify_ms(tokens, rows) / tokens
        draft_ms = self.draft_pass.at(rows)
        if draft_ms <= 0:  # a pass measured as free (its fixed cost subtracted on a noisy run)
            return math.inf
        return per_token / (draft_ms / rows)

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
        verify_row_ms: float = 0.0,
        probs_row_ms: float = 0.0,
    ) -> StepCost:
        """Straight-line tables (defaults and tests): fixed + per-unit * size."""
        return cls(
            CostTable.linear(draft_fixed_ms, draft_per_row_ms, max_rows, name="draft_pass"),
            CostTable.linear(verify_fixed_ms, verify_per_token_ms, max_tokens, name="verify"),
            overhead_ms,
            verify_row_ms,
            probs_row_ms=probs_row_ms,
        )


def draft_width(rows_per_pass: Sequence[int]) -> int:
    """Draft positions in the probabilities a step hands to the target: its deepest pass run
    plus one, at least 1 (a step whose rows draw nothing still sends one position)."""
    return 1 + max((p for p, r in enumerate(rows_per_pass) if p >= 1 and r > 0), default=0)


def rows_per_pass(pending_tokens: int, num_drafted: Sequence[int], passes: int) -> list[int]:
    """Rows of each of `passes` draft passes: pass 0 runs the pending tokens, pass p >= 1 the
    rows that drafted more than p tokens (their draft p - 1 is fed to get draft p)."""
    return [pending_tokens] + [sum(1 for d in num_drafted if d > p) for p in range(1, passes)]
