"""Per-sequence bookkeeping of the step contract: what each request sends and what it keeps.

The scheduler (avspec.engine.scheduler) holds one `SequenceState` per request and, each step,
turns the batch into `StepInputs` with `build_inputs`, reads the answer back with
`read_outputs` and commits it with `SequenceState.commit`. The contract (docs/architecture.md),
per sequence:

- `input_ids` are the tokens committed since the last step: the prompt on the first step, then
  the last step's accepted drafts and its correction/bonus token (`pending`);
- `reusable` is how many of those were drafts (the stages may keep their cache for them);
- `start_positions` is the committed length before them (`start`).

A prompt longer than `prefill_chunk` (when set) is sent in pieces of that many tokens, one a
step, without drafts (`sent`): the rows already decoding beside it wait for one piece, not for
the whole prompt. A piece's outputs are discarded and it emits nothing; the last piece is an
ordinary first step.

Per request:

- EOS (any of the model's EOS ids, `eos_ids`) ends a request and is not emitted (finish reason
  "stop"), unless the request sets `ignore_eos`: EOS is then a token like any other and only
  max_tokens ends the request;
- `max_tokens` is honoured exactly: tokens past it are dropped (finish reason "length");
- a request drafts at most `max_tokens - generated - 1` tokens (`drafts_wanted`), so no step
  overshoots its budget (fewer verified drafts never changes the output distribution).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from avspec.contract import StepInputs, StepOutputs


def as_eos_ids(eos_ids: Collection[int] | int) -> frozenset[int]:
    """The EOS ids as a non-empty frozenset of ints; a single int is one id."""
    ids = frozenset([eos_ids] if isinstance(eos_ids, int) else (int(i) for i in eos_ids))
    if not ids:
        raise ValueError("eos_ids must name at least one token id")
    return ids


@dataclass
class GenerationRequest:
    """One generation request; `num_draft_tokens` 0 turns speculation off for it.

    `client` is the identity fairness and the refit share are counted by ("" = anonymous, one
    client).
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    random_seed: int = 0
    num_draft_tokens: int = 8
    adaptive: bool = True
    adaptive_drafting: bool = True  # with `adaptive`: also draft by the plan (avspec.av.drafting)
    client: str = ""
    ignore_eos: bool = False  # generate past EOS to max_tokens (benchmarks of fixed length)


@dataclass
class StepReport:
    """What one step did for one request; `finish_reason` is "stop", "length" or "cancelled"."""

    new_tokens: list[int]
    drafted: int
    verified: int
    accepted: int
    finished: bool
    finish_reason: str | None
    prefilling: bool = False  # a piece of a chunked prompt: nothing to report to the client


@dataclass
class Outcome:
    """One sequence's result of a step, read from `StepOutputs`."""

    tokens: list[int]  # num_accepted + 1 output tokens
    verified: int
    accepted: int
    drafted: int | None = None  # drafts the draft stage produced; None: all it was asked for


@dataclass(eq=False)
class SequenceState:
    """One request's place in the contract, and the callbacks its reports go to."""

    seq_id: int
    request: GenerationRequest
    on_step: Callable[[StepReport], None]
    on_error: Callable[[Exception], None]
    pending: list[int]  # committed tokens not yet sent to the models
    start: int = 0  # committed length before `pending`
    reusable: int = 0  # how many of `pending` were drafts
    generated: int = 0  # tokens emitted so far
    deadline: float = math.inf  # scheduler clock time at which the request is ended unfinished
    prefill_chunk: int = 0  # prompt tokens sent per step while prefilling (0: all at once)

    @property
    def prefilling(self) -> bool:
        """Whether this step sends only a piece of the prompt (`prefill_chunk`)."""
        return 0 < self.prefill_chunk < len(self.pending)

    @property
    def sent(self) -> list[int]:
        """The tokens this step sends: `pending`, or its first `prefill_chunk` while
        prefilling."""
        return self.pending[: self.prefill_chunk] if self.prefilling else self.pending

    @property
    def stepped(self) -> bool:
        """Whether a step has committed for it: from then on the stages hold its KV cache and
        random generators until its id is released (a paused sequence keeps them)."""
        return self.start > 0

    def drafts_wanted(self) -> int:
        """Drafts to ask for: `num_draft_tokens`, capped at `max_tokens - generated - 1`; none
        while prefilling."""
        if self.prefilling:
            return 0
        return max(
            0, min(self.request.num_draft_tokens, self.request.max_tokens - self.generated - 1)
        )

    def commit(self, outcome: Outcome, eos_ids: Collection[int] | int) -> StepReport:
        """Commit a step's outcome; the report says what to emit and whether the request ended.

        `eos_ids`: the ids that end a request (any one of them); a single int is accepted too.

        All output tokens become `pending` (sent with the next step if the request goes on);
        only those before EOS and within `max_tokens` are emitted.
        """
        if self.prefilling:  # the piece is cached by the stages; its sampled token is not used
            sent = len(self.sent)
            self.start += sent
            self.pending = self.pending[sent:]
            return StepReport([], 0, 0, 0, False, None, prefilling=True)
        drafted = self.drafts_wanted() if outcome.drafted is None else outcome.drafted
        eos = frozenset() if self.request.ignore_eos else as_eos_ids(eos_ids)
        emitted: list[int] = []
        reason = None
        for token in outcome.tokens:
            if token in eos:
                reason = "stop"
                break
            emitted.append(token)
            if self.generated + len(emitted) == self.request.max_tokens:
                reason = "length"
                break
        self.start += len(self.pending)
        self.pending = outcome.tokens
        self.reusable = outcome.accepted
        self.generated += len(emitted)
        return StepReport(
            emitted, drafted, outcome.verified, outcome.accepted, reason is not None, reason
        )


@dataclass
class Carry:
    """What one step hands to the next, all CPU tensors: the stale state of the contract.

    Fields named as the StepInputs fields they become. Empty tensors: nothing carried (first
    step, after a failed step, on replays).
    """

    # [prev_batch] int32 (refit-excluded rows negative)
    prev_num_accepted: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, dtype=torch.int32)
    )
    # [4 + K] float32, the verifier's plan for the next draft
    draft_plan: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    # [K + 2] float32: draft ms per pass, target ms, the step's wall ms
    prev_timing_ms: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    # the target's features of the step, for a draft head (StepOutputs.target_features, ...)
    prev_target_features: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    prev_feature_counts: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, dtype=torch.int32)
    )
    prev_feature_starts: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, dtype=torch.int32)
    )

    @classmethod
    def after(cls, outputs: StepOutputs, accepted: torch.Tensor, wall_ms: float) -> Carry:
        """The carry of a step that returned `outputs` in `wall_ms`."""
        draft_ms = outputs.draft_ms.detach().cpu().float().reshape(-1)
        target_ms = outputs.target_ms.detach().cpu().float().reshape(-1)
        timing = torch.zeros(0)
        if draft_ms.numel() and target_ms.numel() == 1:
            timing = torch.cat([draft_ms, target_ms, torch.tensor([wall_ms])])
        plan = outputs.next_draft_plan.detach().cpu().float().reshape(-1)
        carry = cls(accepted, plan, timing)
        if outputs.feature_counts.numel():
            carry.prev_target_features = outputs.target_features.detach().cpu().float()
            carry.prev_feature_counts = outputs.feature_counts.detach().cpu().to(torch.int32)
            carry.prev_feature_starts = outputs.feature_starts.detach().cpu().to(torch.int32)
        return carry


def build_inputs(batch: list[SequenceState], releases: list[int], prev: Carry) -> StepInputs:
    """The contract's CPU tensors for `batch` (see docs/architecture.md)."""
    sent = [s.sent for s in batch]
    width = max((len(tokens) for tokens in sent), default=1)
    input_ids = torch.zeros(len(batch), width, dtype=torch.int32)
    for row, tokens in enumerate(sent):
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    return StepInputs(
        seq_ids=column([s.seq_id for s in batch], torch.int64),
        input_ids=input_ids,
        input_lengths=column([len(tokens) for tokens in sent], torch.int32),
        start_positions=column([s.start for s in batch], torch.int32),
        reusable=column([s.reusable for s in batch], torch.int32),
        num_draft_tokens=column([s.drafts_wanted() for s in batch], torch.int32),
        adaptive=column([s.request.adaptive for s in batch], torch.bool),
        adaptive_drafting=column(
            [s.request.adaptive and s.request.adaptive_drafting for s in batch], torch.bool
        ),
        temperature=column([s.request.temperature for s in batch], torch.float32),
        top_p=column([s.request.top_p for s in batch], torch.float32),
        random_seed=column([s.request.random_seed for s in batch], torch.int64),
        prev_num_accepted=prev.prev_num_accepted,
        release_seq_ids=column(releases, torch.int64),
        draft_plan=prev.draft_plan,
        prev_timing_ms=prev.prev_timing_ms,
        prev_target_features=prev.prev_target_features,
        prev_feature_counts=prev.prev_feature_counts,
        prev_feature_starts=prev.prev_feature_starts,
    )


def read_outputs(
    outputs: StepOutputs, batch: list[SequenceState], max_draft_tokens: int
) -> dict[int, Outcome]:
    """Host copies of the step outputs per sequence; ValueError on a malformed result."""
    n = len(batch)
    output_ids = outputs.output_ids.detach().cpu()
    if tuple(output_ids.shape) != (n, max_draft_tokens + 1):
        raise ValueError(
            f"output_ids has shape {tuple(output_ids.shape)}, want {(n, max_draft_tokens + 1)}"
        )
    accepted = outputs.num_accepted.detach().cpu().tolist()
    verified = outputs.num_verify.detach().cpu().tolist()
    if len(accepted) != n or len(verified) != n:
        raise ValueError(f"num_accepted / num_verify must hold {n} entries")
    drafted = outputs.num_drafted.detach().cpu().tolist()  # empty: not reported
    if drafted and len(drafted) != n:
        raise ValueError(f"num_drafted must hold {n} entries or none")
    rows = output_ids.tolist()
    outcomes = {}
    for i, (seq, row, a, v) in enumerate(zip(batch, rows, accepted, verified, strict=True)):
        d = drafted[i] if drafted else seq.drafts_wanted()
        if not 0 <= a <= v <= d <= seq.drafts_wanted():
            raise ValueError(
                f"sequence {seq.seq_id}: num_accepted {a}, num_verify {v}, num_drafted {d} "
                "out of range"
            )
        outcomes[seq.seq_id] = Outcome(row[: a + 1], v, a, d if drafted else None)
    return outcomes
