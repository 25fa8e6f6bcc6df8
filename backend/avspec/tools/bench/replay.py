"""Replay of served steps: each speculation arm's tokens/s, predicted from a step log.

The source is the step log (avspec.av.step_log) of a served phase in which every draft was
verified (a `k<N>` arm): each row's features, drafts and outcome are known there, so any
decision rule can be replayed over them (avspec.tools.bench.oracle.arm_steps: fixed K, AV, AV
with adaptive drafting and the oracle, through `AdaptiveVerifier.step` and `drafted_by_plan`,
the functions the served verifier and draft call). Each arm's steps are priced by a cost model
(a StepCost): tokens/s = tokens / modelled time over the phase's steps, and tokens/s per user =
the mean over sequences of their tokens / the modelled time of the steps they were in.

Arms, by the names of client/bench_serving.py: `none` (no draft), `k<N>`, `av<K>` (AV at K),
`ad<K>` (AV with adaptive drafting at most K), `oracle` (knows each row's outcome: every row
drafts and verifies exactly the drafts it will accept, up to a batch depth D; the fastest of D
chosen each step by its tokens per ms and of each D = 0..K held for the run. A batch drafts as
deep as its deepest row, so a per-row oracle without D falls below k1 on large batches; with D
held at k it is k's steps without the drafts that will be rejected, so it is never below k<k>).
With `defers_draft` (the server since the draft defers, avspec.engine.draft_stage) a
row that drafts nothing in a step defers its inputs to its next pass 0 (a step in which no row
drafts runs no draft pass): each request's deferred tokens are counted and priced there.
Without it (recordings of servers before that), every step runs the draft over its pending
tokens, `none` included.

`served_cost` fits a StepCost to the served path: the profiled tables refreshed
(avspec.av.cost_refresh) by the stage times the log recorded, with each step's overhead the gap
between consecutive steps less its stages' time, so the time between steps (the entry's work,
the responses) is priced too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from avspec.av.cost_refresh import CostRefresh
from avspec.av.drafting import DraftPlan
from avspec.av.estimator import AcceptanceEstimator, accepted_counts
from avspec.av.step_cost import StepCost, rows_per_pass
from avspec.av.step_log import logged_accepted
from avspec.av.verifier import PROBE_INTERVAL, AdaptiveVerifier
from avspec.config import EstimatorConfig
from avspec.tools.bench.oracle import RecordedSteps, av_step, step_ms


def recorded_steps(lines: Sequence[dict[str, Any]], positions: int) -> RecordedSteps:
    """The rows of step-log `lines` (one phase, in order) labelled by the line after each.

    A line whose successor's outcome does not match its batch (a failed step) and the last line
    are left out. ValueError if a row's drafts were not all verified: the replay needs the
    outcome of every draft (record a `k<N>` arm).
    """
    step: list[int] = []
    seq_id: list[int] = []
    num_draft: list[int] = []
    num_accepted: list[int] = []
    features: list[np.ndarray] = []
    base: list[int] = []
    for line, after in zip(lines, lines[1:], strict=False):
        if len(after["prev_accepted"]) != len(line["ids"]):
            continue
        if line["verify"] != line["drafted"]:
            raise ValueError(
                f"step at t={line['t']} verified {line['verify']} of drafts {line['drafted']}: "
                "a replay needs every draft verified (record a k<N> arm)"
            )
        accepted, _ = accepted_counts(torch.tensor(after["prev_accepted"], dtype=torch.int64))
        for row, row_id in enumerate(line["ids"]):
            drafted = min(int(line["drafted"][row]), positions)
            padded = np.zeros(positions)
            padded[:drafted] = line["features"][row][:drafted]
            step.append(len(base))
            seq_id.append(row_id)
            num_draft.append(drafted)
            num_accepted.append(min(int(accepted[row]), drafted))
            features.append(padded)
        base.append(int(line["base"]))
    if not base:
        raise ValueError("no labelled step in the log lines")
    return RecordedSteps(
        step=np.array(step),
        seq_id=np.array(seq_id, dtype=np.int64),
        num_draft=np.array(num_draft),
        num_accepted=np.array(num_accepted),
        features=np.array(features, dtype=np.float32),
        base_tokens=np.array(base),
    )


def served_cost(profiled: StepCost, phases: Iterable[Sequence[dict[str, Any]]]) -> StepCost:
    """`profiled` refreshed by every step of `phases` (step-log lines, each phase in order).

    Each line's `timing` is the previous line's step: its draft passes (rows from the previous
    line's drafts), its target over base + verified tokens, and as its wall time the gap
    between the two lines' clocks (the step and everything between steps). A step right after
    one whose draft deferred its inputs is left out by the refresh, as served.
    """
    cost = copy.deepcopy(profiled)
    refresh = CostRefresh(cost, window=1 << 30, every=1 << 30)
    for lines in phases:
        for line, after in zip(lines, lines[1:], strict=False):
            timing = after["timing"]
            if not timing or len(after["prev_accepted"]) != len(line["ids"]):
                continue
            k = len(timing) - 2
            refresh.observe(
                rows_per_pass(line["base"], line["drafted"], k),
                timing[:k],
                line["base"] + sum(line["verify"]),
                timing[k],
                (after["t"] - line["t"]) * 1000.0,
                verify_rows=len(line["ids"]),
            )
    refresh.refresh_now()
    return cost


def draft_deferred(phases: Iterable[Sequence[dict[str, Any]]]) -> bool:
    """Whether the server of these step-log lines deferred the draft (see the module doc): some
    step's timing shows a pass 0 of 0 ms, which a server that always ran it never records."""
    return any(line["timing"] and line["timing"][0] == 0 for lines in phases for line in lines)


@dataclass
class RecordedSequence:
    """One request of a recording: its rows (indices into the RecordedSteps, in step order),
    the prompt tokens its first step ran and the tokens it produced."""

    seq_id: int
    rows: list[int]
    prompt_tokens: int
    length: int


def recorded_sequences(recorded: RecordedSteps) -> list[RecordedSequence]:
    """The recording's requests in order of arrival. A request's prompt tokens are its first
    step's base tokens less one per row already decoding, shared among the rows that arrived."""
    order: dict[int, RecordedSequence] = {}
    bounds = np.flatnonzero(np.diff(recorded.step)) + 1
    for rows in np.split(np.arange(recorded.step.shape[0]), bounds):
        if rows.size == 0:
            continue
        ids = [int(i) for i in recorded.seq_id[rows]]
        new = [i for i in ids if i not in order]
        base = int(recorded.base_tokens[recorded.step[rows[0]]])
        prompt = max(1, (base - (len(ids) - len(new))) // len(new)) if new else 0
        for seq in new:
            order[seq] = RecordedSequence(seq, [], prompt, 0)
        for row, seq in zip(rows.tolist(), ids, strict=True):
            order[seq].rows.append(row)
            order[seq].length += int(recorded.num_accepted[row]) + 1
    return list(order.values())


def served_lengths(lines: Sequence[dict[str, Any]]) -> list[int]:
    """Tokens each request of a phase's step-log lines produced, in order of arrival: one per
    step it was in plus the drafts the next line reports accepted (the phase's last step: +1)."""
    lengths: dict[int, int] = {}
    for index, line in enumerate(lines):
        after = lines[index + 1]["prev_accepted"] if index + 1 < len(lines) else []
        outcomes = after if len(after) == len(line["ids"]) else [0] * len(line["ids"])
        for seq, got in zip(line["ids"], outcomes, strict=True):
            lengths[seq] = lengths.get(seq, 0) + logged_accepted(got) + 1
    return list(lengths.values())


ARM_KEYS = {"av": "av", "ad": "av_drafting"}


def replay_point(
    recorded: RecordedSteps,
    cost: StepCost,
    arms: Sequence[str],
    concurrency: int,
    config: EstimatorConfig | None = None,
    defers_draft: bool = True,
    lengths: dict[str, Sequence[int]] | None = None,
    probe_interval: int = PROBE_INTERVAL,
) -> dict[str, dict[str, float]]:
    """Per arm (bench_serving names, plus `oracle`): tokens, modelled ms, tokens/s and tokens/s
    per user of the recorded requests served again by `concurrency` closed-loop users.

    Each request keeps its recorded length (or `lengths[arm]`, the lengths that arm's requests
    had as served, in order of arrival: a request's length depends on the text sampled, which
    differs between arms) and uses its recorded rows in order (its decoding rows again from the
    first if the arm needs more steps than were recorded): the arm decides what each row drafts
    and verifies, and the row's outcome accepts min(verified, accepted) + 1 tokens. The batch
    is whatever the arm's own pace leaves running, so a slower arm has a longer tail, as served.
    Tokens/s per user leaves out each request's first step (its time to first token).
    probe_interval: the verifier's (AdaptiveVerifier; 0 replays a server without probes).
    defers_draft: a step where no row drafts runs no draft pass (see the module doc).
    """
    positions = recorded.features.shape[1]
    sequences = recorded_sequences(recorded)
    out = {}
    for arm in arms:
        key = _arm_key(arm, positions)
        verifier = None
        if key in ("av", "av_drafting"):
            estimator = AcceptanceEstimator(config or EstimatorConfig(num_positions=positions))
            verifier = AdaptiveVerifier(
                estimator, cost, drafting=key == "av_drafting", probe_interval=probe_interval
            )
        served = sequences
        if lengths is not None and arm in lengths:
            served = [
                replace(seq, length=max(1, int(n)))
                for seq, n in zip(sequences, lengths[arm], strict=False)
            ]
        keys = [key]
        if key == "oracle":  # the best of a depth chosen each step and each depth held
            keys += [f"oracle{depth}" for depth in range(positions + 1)]
        runs = [
            _serve(recorded, served, concurrency, k, cost, verifier, defers_draft) for k in keys
        ]
        out[arm] = max(runs, key=lambda run: run["output_tokens_per_s"])
    return out


def _serve(
    recorded: RecordedSteps,
    sequences: list[RecordedSequence],
    concurrency: int,
    key: str,
    cost: StepCost,
    verifier: AdaptiveVerifier | None,
    defers_draft: bool,
) -> dict[str, float]:
    """One arm's closed loop over `sequences`; see replay_point."""
    positions = recorded.features.shape[1]
    queue = list(range(len(sequences)))[::-1]
    live: list[int] = []  # indices into sequences
    produced = [0] * len(sequences)
    steps_done = [0] * len(sequences)
    user_ms = [0.0] * len(sequences)
    total_tokens = total_ms = 0.0
    prev_ids: list[int] = []
    prev_outcome = np.zeros(0, dtype=np.int64)
    plan: DraftPlan | None = None
    deferred = [0] * len(sequences)  # tokens each request's draft holds for its next pass
    while queue or live:
        while queue and len(live) < concurrency:
            live.append(queue.pop())
        rows = [_row(sequences[i], steps_done[i]) for i in live]
        ids = [sequences[i].seq_id for i in live]
        n, a = recorded.num_draft[rows], recorded.num_accepted[rows]
        inputs = [1 if steps_done[i] else sequences[i].prompt_tokens for i in live]
        base = sum(inputs)
        remaining = np.array([sequences[i].length - produced[i] for i in live])
        held = np.array([deferred[i] for i in live]) if defers_draft else None

        step = _Step(cost, np.array(inputs), held, a, remaining)
        if key == "k0":
            drafted = verified = np.zeros(len(rows), dtype=np.int64)
        elif key == "oracle":  # each step the batch depth whose tokens per ms are best
            options = [np.minimum(a, depth) for depth in range(positions + 1)]
            # deferred tokens are owed whatever it picks: leaving them out of the choice keeps
            # it from deferring ever more (each step would see drawing as dearer than the last)
            drafted = verified = max(options, key=lambda d: _rate(*step.priced(d, d, owed=False)))
        elif key.startswith("oracle"):  # one batch depth for the whole run
            drafted = verified = np.minimum(a, int(key[len("oracle") :]))
        elif key.startswith("k"):
            drafted = verified = np.minimum(n, int(key[1:]))
        else:
            assert verifier is not None
            drafted, verified, plan = av_step(
                verifier, recorded, rows, ids, prev_ids, prev_outcome, base, plan
            )
        gained, ms = step.priced(drafted, verified)
        if defers_draft:  # a row without draws leaves its inputs to its next pass
            for i, count, drew in zip(live, inputs, drafted.tolist(), strict=True):
                deferred[i] = 0 if drew else deferred[i] + count
        total_tokens += float(gained.sum())
        total_ms += ms
        prev_ids, prev_outcome = ids, np.minimum(verified, a)
        for i, got in zip(live, gained.tolist(), strict=True):
            if steps_done[i]:
                user_ms[i] += ms
            produced[i] += got
            steps_done[i] += 1
        live = [i for i in live if produced[i] < sequences[i].length]
    rates = [(produced[i] - 1) / ms * 1000.0 for i, ms in enumerate(user_ms) if ms > 0]
    return {
        "tokens": total_tokens,
        "ms": total_ms,
        "output_tokens_per_s": total_tokens / total_ms * 1000.0 if total_ms else 0.0,
        "tokens_per_s_per_user": float(np.mean(rates)) if rates else 0.0,
    }


@dataclass
class _Step:
    """One replayed step's pricing: each row's input tokens, the tokens each row's draft holds
    deferred (None: a server that never defers), each row's accepted drafts and the tokens each
    request still needs."""

    cost: StepCost
    inputs: np.ndarray
    held: np.ndarray | None
    accepted: np.ndarray
    remaining: np.ndarray

    def priced(
        self, drafted: np.ndarray, verified: np.ndarray, owed: bool = True
    ) -> tuple[np.ndarray, float]:
        """Tokens gained per row and the step's ms when its rows draft / verify these: the
        draft's pass 0 runs the inputs of the rows that draw, with their deferred tokens when
        `owed` (every row's inputs when the server never defers)."""
        gained = np.minimum(np.minimum(verified, self.accepted) + 1, self.remaining)
        base = int(self.inputs.sum())
        if self.held is None:
            pending = base
        else:
            draws = drafted > 0
            pending = int(self.inputs[draws].sum()) + (int(self.held[draws].sum()) if owed else 0)
        return gained, step_ms(self.cost, base, drafted, verified, pending)


def _rate(gained: np.ndarray, ms: float) -> float:
    """Tokens per ms of a step: with the tokens of a run fixed, the option with the best rate
    each step takes the least time for them."""
    return float(gained.sum()) / ms if ms > 0 else float("inf")


def _row(sequence: RecordedSequence, step: int) -> int:
    """The recorded row a request uses at its `step`-th step: its rows in order, then its rows
    after the first (the prompt's) again from the start."""
    rows = sequence.rows
    if step < len(rows) or len(rows) == 1:
        return rows[min(step, len(rows) - 1)]
    return rows[1 + (step - 1) % (len(rows) - 1)]


def _arm_key(arm: str, positions: int) -> str:
    """The arm_steps key of a bench_serving arm name; ValueError naming a bad one."""
    if arm == "none":
        return "k0"
    if arm == "oracle":
        return "oracle"
    prefix = next((p for p in ("av", "ad", "k") if arm.startswith(p)), "")
    digits = arm[len(prefix) :]
    if prefix and digits.isdigit():
        k = int(digits)
        if prefix == "k" and 1 <= k <= positions:
            return f"k{k}"
        if prefix in ARM_KEYS and k == positions:
            return ARM_KEYS[prefix]
    raise ValueError(
        f"bad replay arm {arm!r}: none, oracle, k1..k{positions}, av{positions} or ad{positions}"
    )
