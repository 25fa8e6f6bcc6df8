#!/usr/bin/env python3
"""GPU check for a lent GPU machine: verifier, draft and target on CUDA; sync-free verifier step.

Three checks, one call (a few minutes on a GPU; plain torch with CUDA, no TensorRT-LLM needed):

1. sync: AdaptiveVerifier.step (check_values=False, seq ids on the CPU, refits included, every
   row drafting adaptively: the budget, the next step's drafting plan and the stale rows) runs
   under torch.cuda.set_sync_debug_mode("warn"): every host synchronisation in the per-step
   path is recorded with the avspec frames that caused it, and the check fails if there is any.
2. verifier throughput: median ms per verifier step at --batch (default 64) and K drafts.
3. pipeline throughput: the in-process speculative step (draft -> verifier -> target stand-in,
   avspec.engine.step) on random-weight models at --batch, in tokens/s, every row drafting by
   the plan the previous step returned (the draft stage's masked mode on CUDA).

Without CUDA (or with --device cpu) the same code runs on the CPU and the sync check is skipped
with a message saying so. Exit status 0 when every check that ran passed, 1 otherwise.

    .venv/bin/python client/gpu_check.py                  # on the GPU machine
    .venv/bin/python client/gpu_check.py --device cpu --batch 4 --steps 4   # quick, anywhere
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from avspec.av.estimator import AcceptanceEstimator
from avspec.av.step_cost import StepCost
from avspec.av.verifier import AdaptiveVerifier
from avspec.config import EstimatorConfig
from avspec.contract import StepInputs, StepOutputs, VerifierInputs
from avspec.engine.step import SpeculativeStep, StepCapacity
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.bench.profiler import median_ms, synchronize


def pick_device(requested: str) -> torch.device:
    """`auto` = cuda when available, else cpu."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda requested but torch sees no CUDA device")
    return device


def make_verifier(k: int, device: torch.device, refit_interval: int) -> AdaptiveVerifier:
    estimator = AcceptanceEstimator(
        EstimatorConfig(num_positions=k, refit_interval=refit_interval), device
    )
    cost = StepCost.linear(
        draft_fixed_ms=0.5, draft_per_row_ms=0.01, verify_fixed_ms=10.0,
        verify_per_token_ms=0.4, max_rows=4096, max_tokens=4096, overhead_ms=1.0,
    )  # fmt: skip
    return AdaptiveVerifier(estimator, cost, check_values=False)


def planned_drafts(plan: torch.Tensor, features: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """num_drafted [batch] under a draft plan [4 + K] (empty: the caps), on the device.

    The draft stage's rule (avspec.av.drafting) as tensor ops, no host read: draft 0 always,
    then position i while i < depth and the survival up to i - 1 stays >= the threshold.
    """
    if plan.numel() == 0:
        return caps.clone()
    k = features.shape[1]
    threshold, depth, slope, intercepts = plan[0], plan[1], plan[2], plan[4 : 4 + k]
    values = torch.cumprod(torch.sigmoid(slope * features.float() + intercepts), dim=1)
    keeps = torch.cumprod((values[:, :-1] >= threshold).int(), dim=1)  # [batch, K - 1]
    within = torch.arange(1, k, device=features.device) < depth
    return torch.minimum(1 + (keeps * within).sum(1), caps.long()).to(caps.dtype)


def verifier_steps(
    batch: int, k: int, device: torch.device, steps: int, refit_interval: int = 5
) -> Callable[[], None]:
    """A closure running one verifier step per call, as the GPU verifier model does.

    Features, num_draft_tokens, adaptive, adaptive_drafting, num_drafted and prev_num_accepted
    live on `device`; seq ids and releases on the CPU (the scheduler's bookkeeping). Every row
    drafts adaptively: num_drafted follows the plan of the previous step (`planned_drafts`). The
    outcome fed back is a device function of last step's num_verify, so no value ever returns
    to the host.
    """
    gen = torch.Generator().manual_seed(0)
    features = (torch.randn(steps, batch, k, generator=gen) * 2).to(device)
    verifier = make_verifier(k, device, refit_interval)
    seq_ids = torch.arange(batch, dtype=torch.int64)
    no_release = torch.zeros(0, dtype=torch.int64)
    num_draft = torch.full((batch,), k, dtype=torch.int32, device=device)
    adaptive = torch.ones(batch, dtype=torch.bool, device=device)
    state = {
        "i": 0,
        "prev": torch.zeros(0, dtype=torch.int32, device=device),
        "plan": torch.zeros(0, device=device),
    }

    def one_step() -> None:
        i = state["i"] % steps
        decision = verifier.step(
            VerifierInputs(
                seq_ids,
                features[i],
                num_draft,
                adaptive,
                state["prev"],
                no_release,
                batch,
                num_drafted=planned_drafts(state["plan"], features[i], num_draft),
                adaptive_drafting=adaptive,
            )  # fmt: skip
        )
        state["prev"] = torch.div(decision.num_verify, 2, rounding_mode="floor").int()
        state["plan"] = decision.draft_plan
        state["i"] += 1

    return one_step


def check_sync(batch: int, k: int, device: torch.device, steps: int) -> dict:
    """Run verifier steps (refits included) under the CUDA sync debug mode 'warn'."""
    if device.type != "cuda":
        return {"status": "skipped", "reason": f"no CUDA device (ran on {device})"}
    one_step = verifier_steps(batch, k, device, steps, refit_interval=5)
    for _ in range(3):  # first calls build the cost tables' device copies (a host -> device copy)
        one_step()
    synchronize(device)
    return run_under_sync_debug(one_step, steps, torch.cuda.set_sync_debug_mode)


SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's, in either mode


def run_under_sync_debug(
    one_step: Callable[[], None], steps: int, set_mode: Callable[[int | str], None]
) -> dict:
    """Call one_step `steps` times with the sync debug mode at 'warn'; report every distinct
    host sync (the avspec frames that led to it, and how often), not only the first.

    torch reports a sync in 'warn' mode as a Python warning raised inside the op, so the stack
    at the warning holds the avspec line that asked for it. A RuntimeError (a failed step, or a
    stand-in raising in the manner of mode 'error') ends the loop and is reported the same way.
    """
    sites: dict[tuple[str, ...], int] = {}
    first: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if SYNC_MESSAGE not in str(message):  # e.g. torch's note that the mode is a prototype
            return
        first.append(str(message).splitlines()[0])
        frames = _avspec_frames(traceback.extract_stack()[:-1])
        sites[frames] = sites.get(frames, 0) + 1

    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        set_mode("warn")
        try:
            for _ in range(steps):
                one_step()
        except RuntimeError as err:
            error = str(err).splitlines()[0]
            frames = _avspec_frames(traceback.extract_tb(err.__traceback__))
            sites[frames] = sites.get(frames, 0) + 1
        finally:
            set_mode(0)
    if not sites:
        return {"status": "passed", "steps": steps}
    return {
        "status": "failed",
        "error": first[0] if first else error,
        "frames": list(next(iter(sites))),
        "sites": [{"frames": list(f), "count": n} for f, n in sites.items()],
    }


def _avspec_frames(frames: traceback.StackSummary) -> tuple[str, ...]:
    """`file:line function: code` of the avspec frames among `frames`, outermost first."""
    return tuple(
        f"{Path(f.filename).name}:{f.lineno} {f.name}: {f.line}"
        for f in frames
        if "avspec" in f.filename
    )


def bench_verifier(batch: int, k: int, device: torch.device, repeats: int) -> dict:
    one_step = verifier_steps(batch, k, device, steps=64, refit_interval=100)
    for _ in range(5):
        one_step()
    ms = median_ms(one_step, repeats, 0, device)
    return {"status": "passed", "batch": batch, "k": k, "step_ms": ms, "steps_per_s": 1e3 / ms}


def random_pair(
    device: torch.device, max_length: int, width: int
) -> tuple[Transformer, Transformer]:
    """A random 4-layer target and a 1-layer draft sharing its embedding and first block."""
    gen = torch.Generator().manual_seed(0)
    target = Transformer(TransformerConfig(4, width, 4, max_length=max_length))
    init_weights(target, gen)
    draft = Transformer(TransformerConfig(1, width, 4, max_length=max_length))
    draft.load_state_dict(target.state_dict(), strict=False)
    return target.to(device).eval(), draft.to(device).eval()


def first_inputs(batch: int, k: int, prompt_length: int) -> StepInputs:
    gen = torch.Generator().manual_seed(1)
    return StepInputs(
        seq_ids=torch.arange(batch, dtype=torch.int64),
        input_ids=torch.randint(32, 127, (batch, prompt_length), generator=gen, dtype=torch.int32),
        input_lengths=torch.full((batch,), prompt_length, dtype=torch.int32),
        start_positions=torch.zeros(batch, dtype=torch.int32),
        reusable=torch.zeros(batch, dtype=torch.int32),
        num_draft_tokens=torch.full((batch,), k, dtype=torch.int32),
        adaptive=torch.ones(batch, dtype=torch.bool),
        temperature=torch.ones(batch),
        top_p=torch.full((batch,), 0.95),
        random_seed=torch.arange(batch, dtype=torch.int64),
        prev_num_accepted=torch.zeros(0, dtype=torch.int32),
        release_seq_ids=torch.zeros(0, dtype=torch.int64),
        # odd rows draft adaptively, even rows to their cap: a random pair's drafts never pay,
        # so adaptive rows alone would fall back to no drafts (plan depth 0) and the masked
        # draft passes would go unexercised
        adaptive_drafting=torch.arange(batch) % 2 == 1,
    )


def next_inputs(previous: StepInputs, out: StepOutputs) -> StepInputs:
    """The scheduler's bookkeeping: commit accepted drafts + one token, feed them next step,
    with the drafting plan the step returned (on the CPU, as the scheduler carries it)."""
    accepted, output_ids = out.num_accepted, out.output_ids
    gained = accepted.cpu() + 1
    return StepInputs(
        seq_ids=previous.seq_ids,
        input_ids=output_ids.cpu().int(),
        input_lengths=gained.int(),
        start_positions=previous.start_positions + previous.input_lengths,
        reusable=accepted.cpu().int(),
        num_draft_tokens=previous.num_draft_tokens,
        adaptive=previous.adaptive,
        temperature=previous.temperature,
        top_p=previous.top_p,
        random_seed=previous.random_seed,
        prev_num_accepted=accepted.cpu().int(),
        release_seq_ids=previous.release_seq_ids,
        adaptive_drafting=previous.adaptive_drafting,
        draft_plan=out.next_draft_plan.detach().cpu().float(),
    )


def bench_pipeline(batch: int, k: int, device: torch.device, steps: int, width: int) -> dict:
    """Tokens/s of `steps` speculative steps of `batch` sequences (after one warm-up step)."""
    prompt = 16
    max_length = prompt + (steps + 2) * (k + 1)
    target, draft = random_pair(device, max_length, width)
    step = SpeculativeStep.from_models(target, draft, StepCapacity(k, batch, max_length), device)
    step.verifier.check_values = False
    inputs = first_inputs(batch, k, prompt)
    out = step(inputs)  # warm-up: prefill, cost-table copies, kernels
    inputs = next_inputs(inputs, out)
    synchronize(device)
    tokens, verified, passes, start = 0, 0, 0, time.perf_counter()
    for _ in range(steps):
        out = step(inputs)
        tokens += int(out.num_accepted.sum()) + batch
        verified += int(out.num_verify.sum())
        passes += int((out.draft_ms > 0).sum())
        inputs = next_inputs(inputs, out)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "status": "passed",
        "batch": batch,
        "k": k,
        "steps": steps,
        "step_ms": seconds * 1e3 / steps,
        "tokens_per_s": tokens / seconds,
        "tokens_per_step_per_sequence": tokens / (steps * batch),
        "verified_per_step_per_sequence": verified / (steps * batch),
        "draft_passes_per_step": passes / steps,
    }


def run(args: argparse.Namespace) -> dict:
    device = pick_device(args.device)
    report: dict = {
        "torch": torch.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    checks = {
        "sync": lambda: check_sync(args.batch, args.draft_tokens, device, args.sync_steps),
        "verifier": lambda: bench_verifier(args.batch, args.draft_tokens, device, args.repeats),
        "pipeline": lambda: bench_pipeline(
            args.batch, args.draft_tokens, device, args.steps, args.width
        ),
    }
    if device.type != "cuda" and args.device == "auto":
        # Random models at batch 64 take minutes on a small CPU: opt in with --device cpu.
        checks["pipeline"] = lambda: {
            "status": "skipped",
            "reason": "no CUDA device; pass --device cpu to run the pipeline on the CPU",
        }
    for name, check in checks.items():
        try:
            report[name] = check()
        except Exception as err:  # noqa: BLE001 - a failed check is reported, the others still run
            report[name] = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
        print(f"[{name}] {json.dumps(report[name])}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--draft-tokens", type=int, default=8, help="K, drafts per sequence")
    parser.add_argument("--sync-steps", type=int, default=50, help="verifier steps checked")
    parser.add_argument("--repeats", type=int, default=200, help="timed verifier steps")
    parser.add_argument("--steps", type=int, default=32, help="timed pipeline steps")
    parser.add_argument("--width", type=int, default=256, help="model width of the random pair")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    for name in ("sync", "pipeline"):
        if report[name]["status"] == "skipped":
            print(f"gpu_check: {name} check SKIPPED: {report[name]['reason']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    failed = [
        name for name in ("sync", "verifier", "pipeline") if report[name]["status"] == "failed"
    ]
    print(
        "gpu_check: " + (f"FAILED: {', '.join(failed)}" if failed else "all checks that ran passed")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
