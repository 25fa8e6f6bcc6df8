#!/usr/bin/env python3
"""Per-step cost of the verifier stage: feature + scoring + labelling + survival + budget + top-k.

Times `logit_qmax` on draft logits plus one `AdaptiveVerifier.step` (which labels the previous
step's outcome, predicts, trims, picks the budget and plans the next step's drafting: every row
drafts adaptively, to its cap here), and one estimator refit, at a chosen batch and K, on the CPU
or CUDA. Prints a table of medians; it asserts nothing (these machines are
noisy: compare rows of one run, not runs).

    .venv/bin/python client/bench_verifier.py --batch 64 --draft-tokens 8
"""

from __future__ import annotations

import argparse
import sys

import torch

from avspec.av.estimator import AcceptanceEstimator
from avspec.av.features import logit_qmax
from avspec.av.step_cost import StepCost
from avspec.av.verifier import AdaptiveVerifier
from avspec.config import EstimatorConfig
from avspec.contract import VerifierInputs
from avspec.tools.bench.profiler import median_ms


def bench(batch: int, k: int, vocab: int, device: str, repeats: int, check_values: bool) -> dict:
    """Median milliseconds of feature + verifier step, of the feature alone, and of one refit."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(batch, k, vocab, generator=gen) * 3).to(device)
    temperature = torch.ones(batch, device=device)
    seq_ids = torch.arange(batch, dtype=torch.int64)
    num_draft = torch.full((batch,), k, dtype=torch.int32, device=device)
    adaptive = torch.ones(batch, dtype=torch.bool, device=device)
    no_release = torch.zeros(0, dtype=torch.int64)
    estimator = AcceptanceEstimator(EstimatorConfig(num_positions=k, refit_interval=10**9), device)
    cost = StepCost.linear(
        draft_fixed_ms=0.5, draft_per_row_ms=0.01, verify_fixed_ms=10.0,
        verify_per_token_ms=0.4, max_rows=4096, max_tokens=4096, overhead_ms=1.0,
    )  # fmt: skip
    verifier = AdaptiveVerifier(estimator, cost, check_values=check_values)
    last = {"num_verify": torch.zeros(0, dtype=torch.int32, device=device)}

    def one_step() -> None:
        accepted = torch.minimum(last["num_verify"], torch.full_like(last["num_verify"], 3))
        features = logit_qmax(logits, temperature, check_values=check_values)
        decision = verifier.step(
            VerifierInputs(
                seq_ids,
                features,
                num_draft,
                adaptive,
                accepted,
                no_release,
                base_tokens=batch,
                num_drafted=num_draft,
                adaptive_drafting=adaptive,
            )  # fmt: skip
        )
        last["num_verify"] = decision.num_verify

    for _ in range(20):
        one_step()
    step_ms = median_ms(one_step, repeats, 0, device)
    feature_ms = median_ms(
        lambda: logit_qmax(logits, temperature, check_values=check_values), repeats, 0, device
    )
    refit_ms = median_ms(estimator.refit, max(20, repeats // 10), 0, device)
    return {"step_ms": step_ms, "feature_ms": feature_ms, "refit_ms": refit_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="requests per step")
    parser.add_argument("--draft-tokens", type=int, default=8, help="K, drafts per request")
    parser.add_argument("--vocab", type=int, default=257, help="draft vocabulary size")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    parser.add_argument("--repeats", type=int, default=500, help="timed steps per row")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: keep)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"batch={args.batch} K={args.draft_tokens} vocab={args.vocab} device={args.device}")
    print(f"{'check_values':>12} {'step ms':>9} {'of which feature ms':>20} {'refit ms':>9}")
    for check_values in (False, True):
        row = bench(
            args.batch, args.draft_tokens, args.vocab, args.device, args.repeats, check_values
        )
        print(
            f"{check_values!s:>12} {row['step_ms']:>9.3f} {row['feature_ms']:>20.3f}"
            f" {row['refit_ms']:>9.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
