"""Tokens/s while every user of a closed-loop phase is busy: the steady state of a served phase.

A sweep phase at concurrency c sends each user's requests and ends when the last one ends. With
speculation, requests of the same length end at different steps (each row accepts what it
accepts), so the phase ends on a tail of ever smaller batches; without speculation every request
of one length ends at the same step, and there is no tail.

`full_batch_rate` reads the phase's step log (avspec.av.step_log: one line per step, each with
the step's rows and the previous step's outcomes) and counts only the steps whose batch holds c
rows: output tokens (each row's accepted drafts plus its one sampled token) over the time from
each such step's line to the next. Its `share` is that time over the phase's stepped time: how
much of the phase was steady.

A server where users send their next request as one ends (most deployments) runs the steady
state; a phase of one request per user runs the whole tail too. Both are reported, the phase's
figure stays the goal's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from avspec.av.step_log import logged_accepted


def full_batch_rate(lines: Sequence[dict[str, Any]], concurrency: int) -> dict[str, float]:
    """{tokens_per_s, share, steps} over the steps of `lines` (one phase, in order) that ran
    `concurrency` rows; tokens_per_s 0.0 and share 0.0 when no step did."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    tokens = full_ms = all_ms = 0.0
    steps = 0
    for line, after in zip(lines, lines[1:], strict=False):
        outcomes = after["prev_accepted"]
        if len(outcomes) != len(line["ids"]):
            continue  # the next line is not this step's outcome (a phase boundary)
        ms = (after["t"] - line["t"]) * 1000.0
        all_ms += ms
        if len(line["ids"]) != concurrency:
            continue
        steps += 1
        full_ms += ms
        tokens += sum(logged_accepted(n) + 1 for n in outcomes)
    return {
        "tokens_per_s": tokens / full_ms * 1000.0 if full_ms > 0 else 0.0,
        "share": full_ms / all_ms if all_ms > 0 else 0.0,
        "steps": float(steps),
    }
