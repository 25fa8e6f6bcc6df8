"""Refit guard: which outcomes of a step feed the estimator's refit.

The scheduler (avspec.engine.scheduler) sends each step's outcomes back with the next step as
`prev_num_accepted`; rows whose outcome must not feed the refit are encoded with
`avspec.av.estimator.refit_excluded` (a accepted drafts sent as -1 - a; the accepted-token
metrics still recover a). Excluded are:

(a) rows whose temperature exceeds `refit_max_temperature`: both distributions flatten towards
    uniform, acceptance approaches 1 whatever q_max says, so such traffic would drag the slope
    down;
(b) rows over a client's share: of a step's n rows, one client labels at most max(1, floor(s n))
    rows, s = `refit_client_share`, taken in seq-id order round robin from where its last
    labelled row left off, so each of its sequences is labelled in turn. No single client
    supplies more than max(1, floor(s n)) of the n sequence-steps of any step, hence at most
    share s (plus one row per step) of a refit window.

Rows that verified no draft carry no label and do not count against the share.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from avspec.av.estimator import refit_excluded


@dataclass(frozen=True)
class RefitRow:
    """One sequence's outcome in a step, with the request settings the guard judges it by."""

    seq_id: int
    client: str
    temperature: float
    verified: int  # drafts verified
    accepted: int  # drafts accepted


class RefitGuard:
    """Turns a step's rows into the next step's `prev_num_accepted`; keeps the rotation cursors.

    The defaults label every row.
    """

    def __init__(
        self, refit_max_temperature: float = math.inf, refit_client_share: float = 1.0
    ) -> None:
        if not refit_max_temperature >= 0:
            raise ValueError(f"refit_max_temperature must be >= 0, got {refit_max_temperature}")
        if not 0 < refit_client_share <= 1:
            raise ValueError(f"refit_client_share must lie in (0, 1], got {refit_client_share}")
        self.refit_max_temperature = refit_max_temperature
        self.refit_client_share = refit_client_share
        self._cursor: dict[str, int] = {}  # client -> seq id of its last labelled row

    def prev_num_accepted(self, rows: Sequence[RefitRow]) -> torch.Tensor:
        """prev_num_accepted [batch] int32 for the next step, in `rows` order, rows kept out of
        the refit encoded by `refit_excluded`. Advances the cursors of the clients that label."""
        excluded: set[int] = set()
        candidates: dict[str, list[int]] = {}  # client -> its rows that would be labelled
        for i, row in enumerate(rows):
            if row.temperature > self.refit_max_temperature:
                excluded.add(i)
            elif row.verified > 0:
                candidates.setdefault(row.client, []).append(i)
        # 1e-9: a float product like 0.29 * 100 = 28.999999999999996 must still give 29
        cap = max(1, math.floor(self.refit_client_share * len(rows) + 1e-9))
        cursors = {}  # a client with no row to label this step starts over
        for client, mine in candidates.items():
            cursors[client] = self._cursor.get(client, 0)
            if len(mine) <= cap:
                continue
            by_id = {rows[i].seq_id: i for i in mine}
            chosen = _round_robin(sorted(by_id), cursors[client], cap)
            cursors[client] = chosen[-1]
            excluded.update(by_id[seq_id] for seq_id in by_id.keys() - set(chosen))
        self._cursor = cursors
        values = torch.tensor([row.accepted for row in rows], dtype=torch.int32)
        out = torch.tensor(sorted(excluded), dtype=torch.long)
        values[out] = refit_excluded(values[out])
        return values


def _round_robin(ids: list[int], cursor: int, count: int) -> list[int]:
    """`count` of the sorted `ids`, cyclically from the first one above `cursor`."""
    start = bisect.bisect_right(ids, cursor)
    return [ids[(start + i) % len(ids)] for i in range(count)]
