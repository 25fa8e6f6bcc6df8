#!/usr/bin/env python3
"""The target stage at two revisions, side by side (last: p warped depth by depth).

    .venv/bin/python client/bench_target_stage.py --baseline HEAD --threads 1

`--baseline` names the git revision of the old stage: its target_stage.py, rejection.py and
sampling.py (`git show REV:backend/avspec/engine/...`) are imported from a temporary package, so the
two stages run in one process on one model (`--target`, bf16 by default). Each gets the same
sequences as the cost tables do (`avspec.tools.bench.profiler`: `context` cached tokens of the
workloads' text (`--text`), one pending token, the text's next tokens as drafts, q uniform or
one-hot at each draft (`--q`: a draft is accepted with probability min(1, p(x) x vocab) or p(x); the
table prints how many positions the new stage read; `--temperature`, default the tables' 1.0) at
every batch x num_verify point, and the points are timed round-robin (`interleaved_ms`: per round
old, new, then the target's blocks alone on the same packed batch), so load from elsewhere lands on
all alike. Both stages start from the same seeds and are called equally often, so their generators
stay in step: every call's output_ids and num_accepted are compared, and the run stops if they ever
differ. Prints a markdown table of medians; it asserts nothing about speed (these machines are
noisy: compare rows of one run).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from avspec.contract import read_step_inputs
from avspec.engine.target_stage import TargetStage, pack_verify_batch
from avspec.runtime.model_dir import load_model
from avspec.tools.bench.profiler import (
    _cache,
    _draft_probs,
    _first_ids,
    _prefill,
    _sequences,
    interleaved_ms,
    step_inputs,
    workload_text,
)

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("target_stage", "rejection", "sampling", "top_p")  # top_p: since its split


def old_stage_class(revision: str, folder: Path) -> type:
    """The TargetStage of `revision`, its rejection, sampling (and top_p) modules beside it."""
    package = folder / "baseline_engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in MODULES:
        shown = subprocess.run(
            ["git", "show", f"{revision}:backend/avspec/engine/{name}.py"],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        if shown.returncode != 0 and name == "top_p":
            continue  # a revision from before top_p left sampling.py
        shown.check_returncode()
        source = shown.stdout
        for other in MODULES:
            source = source.replace(f"avspec.engine.{other} ", f"baseline_engine.{other} ")
        (package / f"{name}.py").write_text(source)
    sys.path.insert(0, str(folder))
    return importlib.import_module("baseline_engine.target_stage").TargetStage


def forward_only(stage: TargetStage, inputs, drafts: torch.Tensor, verify: list[int]) -> None:
    """The target's blocks on the packed batch a stage call would run (its cache rolled back
    first, as a call does), without the output layer: the rest of a call is the output layer,
    the warp and the rejection."""
    step = read_step_inputs(inputs, stage.max_draft_tokens)
    offsets = stage.slots.prepare(step)
    packed = pack_verify_batch(inputs.input_ids, offsets, step.input_lengths, drafts, verify)
    stage.model.forward_cached(
        stage.cache, step.seq_ids, packed.tokens, packed.lengths, hidden=True, at=packed.positions
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision of the old stage")
    parser.add_argument("--target", default=str(ROOT / "models" / "target"))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--verify", default="0,2,8", help="num_verify of every row, per point")
    parser.add_argument("--draft-tokens", type=int, default=8, help="K")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--q", choices=["uniform", "one-hot"], default="uniform",
                        help="the drafts' q: 1/vocab everywhere, or 1 at each draft")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--text", choices=["workloads", "random"], default="workloads",
        help="the sequences' tokens (as client/profile_costs.py --text)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    verifies = [int(v) for v in args.verify.split(",")]
    k = args.draft_tokens
    model = load_model(
        args.target, dtype=getattr(torch, args.dtype), max_length=args.context + k + 8
    )
    vocab = model.config.vocab_size
    text = workload_text(args.target) if args.text == "workloads" else None

    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        old_class = old_stage_class(args.baseline, Path(folder))
        stages = {
            name: cls(model, _cache(model, sum(batches), args.context, k), k, check_values=False)
            for name, cls in (("old", old_class), ("new", TargetStage))
        }
        outputs: dict[str, tuple] = {}
        warped: dict[tuple[int, int], list[int]] = {}  # per point: the new stage's positions

        def call(name: str, inputs, drafts, probs, verify) -> None:
            out = stages[name](inputs, drafts, probs, verify)
            outputs[name] = (out.output_ids.clone(), out.num_accepted.clone())
            if name == "new":
                warped.setdefault((len(verify), int(verify[0])), []).append(
                    int(out.num_accepted.sum()) + len(verify)
                )  # where it reads p on the CPU: the accepted drafts and the drawn token
                old, new = outputs["old"], outputs["new"]
                if not (torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])):
                    raise SystemExit(f"outputs differ at batch {len(verify)}, verify {verify[0]}")

        calls, points = [], []
        for batch, first in zip(batches, _first_ids(batches), strict=True):
            gen = torch.Generator().manual_seed(batch)
            tokens = _sequences(text, batch, args.context + 1 + k, first, gen)
            for stage in stages.values():
                _prefill(stage, tokens[:, : args.context], k, first)
            inputs = step_inputs(tokens[:, args.context : args.context + 1], args.context, k,
                                 first, temperature=args.temperature)  # fmt: skip
            if text is None:
                drafts = torch.randint(0, vocab, (batch, k), generator=gen)
            else:
                drafts = tokens[:, args.context + 1 :]
            probs = _draft_probs(drafts, vocab, one_hot=args.q == "one-hot")
            for n in verifies:
                verify = torch.full((batch,), n, dtype=torch.int32)
                calls.append((
                    lambda a=(inputs, drafts, probs, verify): call("old", *a),
                    lambda a=(inputs, drafts, probs, verify): call("new", *a),
                    lambda b=(inputs, drafts, [n] * batch): forward_only(stages["new"], *b),
                ))  # fmt: skip
                points.append((batch, n))
        timed = interleaved_ms(calls, args.repeats, args.warmup, "cpu")

    print(f"threads {args.threads}, {args.dtype}, K {k}, context {args.context}, q {args.q}, "
          f"temperature {args.temperature}, {args.repeats} rounds; ms, median; positions: "
          f"verified / where the new stage read p (mean a call)")  # fmt: skip
    print("| batch | num_verify | positions verified / read | old | new | old / new | blocks "
          "| old - blocks | new - blocks |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for (batch, n), samples in zip(points, timed, strict=True):
        old, new, fwd = (statistics.median(s) for s in samples)
        read = statistics.mean(warped[(batch, n)])
        print(f"| {batch} | {n} | {batch * (n + 1)} / {read:.0f} | {old:.1f} | {new:.1f} "
              f"| {old / new:.2f} | {fwd:.1f} | {old - fwd:.1f} | {new - fwd:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
