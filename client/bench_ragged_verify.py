#!/usr/bin/env python3
"""The target stage on ragged verifications: rows verifying different numbers of drafts.

    .venv/bin/python client/bench_ragged_verify.py --rows 64 --context 384 --rounds 11 \\
        --padding 2.0:0,1.25:8

Under adaptive verification the rows of one step verify different numbers of drafts. This
times one target-stage call (the default pair's target, `--dtype`, `--threads`) over `--rows`
rows with `--context` cached tokens of the workloads' text, for a fixed set of verify mixes
scaled to the rows (no drafts; a tenth of the rows verifying one draft; a quarter verifying one;
half verifying two; a few rows verifying 3; every row one, as k1; a cycle of 0-4), under each
attention-tile rule of `--padding` (`MAX:SLACK`: a tile pads at most MAX times its real query
rows or SLACK rows above them, avspec.runtime.ragged). Calls are timed round-robin over every
(mix, rule) pair (avspec.tools.bench.profiler.interleaved_ms), so load from elsewhere lands on
all alike. Drafts are the text's next tokens with one-hot q (accepted with probability p(x)).
Prints medians in ms; it asserts nothing about speed (compare rows of one run).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from unittest import mock

import torch

from avspec.engine.target_stage import TargetStage
from avspec.runtime import ragged
from avspec.runtime.precision import load_served_model
from avspec.tools.bench.profiler import (
    _cache,
    _decode_inputs,
    _draft_probs,
    _prefill,
    _sequences,
    interleaved_ms,
    workload_text,
)
from avspec.tools.script import doc_parser

ROOT = Path(__file__).resolve().parent.parent
K = 8


def verify_mixes(rows: int) -> dict[str, list[int]]:
    """Named num_verify vectors over `rows` rows (each at most K)."""

    def some(count: int, drafts: int) -> list[int]:
        count = max(1, min(rows, count))
        return [drafts] * count + [0] * (rows - count)

    return {
        "no drafts": [0] * rows,
        f"{max(1, rows // 10)} rows x 1": some(rows // 10, 1),
        f"{max(1, rows // 4)} rows x 1": some(rows // 4, 1),
        f"{max(1, rows // 2)} rows x 2": some(rows // 2, 2),
        "2 rows x 3": some(2, 3),
        "every row x 1 (k1)": [1] * rows,
        "cycle 0-4": [j % 5 for j in range(rows)],
    }


def tile_rule(spec: str) -> tuple[float, int]:
    """`MAX:SLACK` -> (max_padding >= 1, slack >= 0)."""
    try:
        most, slack = spec.split(":")
        rule = float(most), int(slack)
    except ValueError as err:
        raise ValueError(f"--padding wants MAX:SLACK pairs such as 1.25:8, got {spec!r}") from err
    if rule[0] < 1.0 or rule[1] < 0:
        raise ValueError(f"--padding {spec!r}: MAX must be >= 1 and SLACK >= 0")
    return rule


def with_tile_rule(rule: tuple[float, int], call: Callable[[], object]) -> Callable[[], None]:
    """`call` run with avspec.runtime.ragged's tile rule set to `rule` (restored after)."""

    def run() -> None:
        with mock.patch.multiple(ragged, MAX_PADDING=rule[0], PAD_SLACK=rule[1]):
            call()

    return run


def main(argv: list[str] | None = None) -> int:
    p = doc_parser(__doc__)
    p.add_argument("--target", type=Path, default=ROOT / "models/target")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--padding", default=f"{ragged.MAX_PADDING}:{ragged.PAD_SLACK}",
                   help="comma list of MAX:SLACK tile rules to compare")  # fmt: skip
    args = p.parse_args(argv)
    if args.rows < 1 or args.context < 1 or args.rounds < 1:
        p.error("--rows, --context and --rounds must be >= 1")
    try:
        rules = [tile_rule(spec) for spec in args.padding.split(",")]
    except ValueError as err:
        p.error(str(err))
    torch.set_num_threads(args.threads)
    model = load_served_model(args.target, "cpu", args.dtype)
    stage = TargetStage(model, _cache(model, args.rows, args.context, K), K, check_values=False)
    tokens = _sequences(workload_text(args.target), args.rows, args.context + 1 + K, 1,
                        torch.Generator().manual_seed(0))  # fmt: skip
    _prefill(stage, tokens[:, : args.context], K, 1)
    inputs = _decode_inputs(tokens[:, args.context : args.context + 1], args.context, K, 1)
    drafts = tokens[:, args.context + 1 :]
    probs = _draft_probs(drafts, model.vocab_size, True)
    names, calls = [], []
    for name, verify in verify_mixes(args.rows).items():
        num_verify = torch.tensor(verify, dtype=torch.int32)
        width = max(1, max(verify))
        step = partial(stage, inputs, drafts, probs[:, :width], num_verify)
        for rule in rules:
            names.append((name, rule))
            calls.append((with_tile_rule(rule, step),))
    timed = interleaved_ms(calls, args.rounds, args.warmup, "cpu")
    print(f"target stage, {args.rows} rows, {args.context} cached tokens, {args.threads} thread(s),"
          f" medians of {args.rounds} rounds (ms)")  # fmt: skip
    print("| mix | " + " | ".join(f"tiles {m}:{s}" for m, s in rules) + " |")
    print("|---|" + "---|" * len(rules))
    for start in range(0, len(names), len(rules)):
        cells = [f"{statistics.median(timed[start + j][0]):.1f}" for j in range(len(rules))]
        print(f"| {names[start][0]} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
