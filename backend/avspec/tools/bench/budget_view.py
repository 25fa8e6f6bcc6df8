"""What the budget chose, per concurrency: the operator's view of adaptive verification.

From step-log lines (avspec.av.step_log) of one served phase: per decode row, the drafts it
could have drafted (its cap), drafted, verified and had accepted, and the share of drafted
tokens the budget trimmed. The live server exports the same totals as metrics
(`av_drafted_tokens_total`, `av_verified_tokens_total`, `av_trimmed_tokens_total`,
`av_drafts_stopped_early_total`, `av_step_batch_size`): per row = a counter's rate over the
rate of `av_step_batch_size_sum`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from avspec.av.step_log import logged_accepted


def budget_choices(lines: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per-row means over the decode rows of `lines` (in order): rows with a cap above 0, the
    first step of each request (its prompt) left out. `batch`: decode rows per step."""
    rows = capped = drafted = verified = accepted = steps = 0
    seen: set[int] = set()
    for index, line in enumerate(lines):
        after = lines[index + 1]["prev_accepted"] if index + 1 < len(lines) else []
        outcomes = after if len(after) == len(line["ids"]) else None
        decoding = False
        for row, (seq, cap) in enumerate(zip(line["ids"], line["caps"], strict=True)):
            first = seq not in seen
            seen.add(seq)
            if cap <= 0 or first:
                continue
            decoding = True
            rows += 1
            capped += cap
            drafted += line["drafted"][row]
            verified += line["verify"][row]
            if outcomes is not None:
                accepted += logged_accepted(outcomes[row])
        steps += decoding
    if not rows:
        return {"rows": 0}
    return {
        "rows": rows,
        "batch": rows / steps,
        "cap_per_row": capped / rows,
        "drafted_per_row": drafted / rows,
        "verified_per_row": verified / rows,
        "accepted_per_row": accepted / rows,
        "trimmed_share": (drafted - verified) / drafted if drafted else 0.0,
        "stopped_early_share": (capped - drafted) / capped if capped else 0.0,
    }
