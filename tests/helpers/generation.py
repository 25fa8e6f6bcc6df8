"""Run requests to completion through a Scheduler and collect their tokens (tests only)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from avspec.engine.scheduler import Scheduler, StepFn
from avspec.engine.sequence import GenerationRequest


def generate(
    runner: Scheduler | StepFn,
    requests: Sequence[GenerationRequest],
    *,
    eos_ids: Collection[int] | int = 256,
    max_batch_size: int | None = None,
    max_context: int = 512,
    max_draft_tokens: int | None = None,
) -> list[list[int]]:
    """Run `requests` to completion and return each one's tokens.

    `runner` is a Scheduler or a step function (then `max_draft_tokens` defaults to its
    `max_draft_tokens` attribute). Raises RuntimeError if any request fails.
    """
    if isinstance(runner, Scheduler):
        scheduler = runner
    else:
        k = max_draft_tokens if max_draft_tokens is not None else runner.max_draft_tokens
        size = max_batch_size or max(1, len(requests))
        scheduler = Scheduler(runner, eos_ids, size, max_context, k)
    tokens: list[list[int]] = [[] for _ in requests]
    errors: list[Exception] = []
    for i, request in enumerate(requests):
        scheduler.submit(request, lambda r, i=i: tokens[i].extend(r.new_tokens), errors.append)
    scheduler.run_until_idle()
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; first: {errors[0]!r}") from errors[0]
    return tokens
