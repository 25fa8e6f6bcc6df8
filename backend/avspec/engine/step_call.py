"""One call of the step function for a batch, with error isolation and the refit guard's rows.

The scheduler (avspec.engine.scheduler) builds nothing itself: `call_step` assembles the batch's
`StepInputs` (avspec.engine.sequence.build_inputs: the live sequences' states, the releases, the
carried state of the previous step), calls `step_fn`, reads the outcomes back and makes the
`Carry` for the next step (the refit guard's `prev_num_accepted`, avspec.engine.refit_guard).

- Error isolation: if the call raises, the step is replayed for each sequence alone (the cache
  rule makes a replay safe; replays carry nothing: no `prev_num_accepted`, plan or timing). A
  sequence that still fails alone is returned among the failures; the others' outcomes stand.
- Releases are never lost: releases whose every carrying call raised are returned, for the
  caller to send with the next step (a release is idempotent on the stages).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from avspec.contract import StepInputs, StepOutputs
from avspec.engine.refit_guard import RefitGuard, RefitRow
from avspec.engine.sequence import Carry, Outcome, SequenceState, build_inputs, read_outputs

logger = logging.getLogger(__name__)

StepFn = Callable[[StepInputs], StepOutputs]


def call_step(
    step_fn: StepFn,
    batch: list[SequenceState],
    releases: list[int],
    prev: Carry,
    guard: RefitGuard,
    max_draft_tokens: int,
    on_batch_failure: Callable[[], None],
) -> tuple[dict[int, Outcome], dict[int, Exception], Carry, list[int]]:
    """Call step_fn on the batch; on failure call `on_batch_failure` and replay each sequence
    alone (a release-only call that fails is not replayed and not counted).

    Returns (outcomes, failures, the carry for the next step, releases whose every carrying
    call raised).
    """
    empty = Carry()
    try:
        started = time.perf_counter()
        outputs = step_fn(build_inputs(batch, releases, prev))
        wall_ms = (time.perf_counter() - started) * 1e3
        releases = []  # the call returned: every stage has freed them
        outcomes = read_outputs(outputs, batch, max_draft_tokens)
        accepted = guard.prev_num_accepted(refit_rows(batch, outcomes))
        carry = Carry.after(outputs, accepted, wall_ms)
        if batch and all(seq.prefilling for seq in batch):
            # rows that may not draft say nothing about drafting: a plan from them alone
            # (depth 0) would keep the first decoding steps from drafting
            carry.draft_plan = prev.draft_plan
        return outcomes, {}, carry, []
    except Exception as exc:  # noqa: BLE001 - isolate the failing sequence below
        if not batch:
            logger.warning("release-only step failed (%s); releases kept for the next", exc)
            return {}, {}, empty, releases
        logger.warning("step of %d sequences failed (%s); replaying each alone", len(batch), exc)
        on_batch_failure()
    outcomes, failures = {}, {}
    for seq in batch:
        try:
            outputs = step_fn(build_inputs([seq], releases, empty))
            releases = []
            outcomes.update(read_outputs(outputs, [seq], max_draft_tokens))
        except Exception as exc:  # noqa: BLE001 - reported through on_error
            failures[seq.seq_id] = exc
    return outcomes, failures, empty, releases


def refit_rows(batch: list[SequenceState], outcomes: dict[int, Outcome]) -> list[RefitRow]:
    """What the refit guard judges each row of a step by, in batch order."""
    return [
        RefitRow(
            seq.seq_id,
            seq.request.client,
            seq.request.temperature,
            outcomes[seq.seq_id].verified,
            outcomes[seq.seq_id].accepted,
        )
        for seq in batch
    ]
