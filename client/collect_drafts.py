"""Collect labelled drafts with adaptive verification off (every draft verified), in-process.

Runs the serving stage code (DraftStage -> AdaptiveVerifier -> TargetStage under the in-flight
Scheduler) on each workload's prompts with AV off for every request, so every draft gets an
accept/reject outcome, and records per (step, request) row:

    workload, step, seq_id, num_draft, num_accepted          [rows]
    refits: online refits done before the row's draft-time prediction    [rows]
    logit_qmax (as served), served_pred (the online estimator's prediction at draft time),
    log_qmax, top2_margin, entropy, neg_log_neg_log_qmax, logit_qsampled      [rows, K]
    base_tokens                                              [steps] tokens run anyway
    final_slope [workloads], final_intercepts [workloads, K] (online estimator at the end),
    refit_interval []

into one compressed .npz (float16 features would lose the clamp range; float32 is kept).
Each workload gets a fresh estimator (starting values), as a freshly started server would.

    python client/collect_drafts.py --out bench/drafts.npz --prompts 24 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from avspec.av.cost_file import default_step_cost, load_step_cost
from avspec.av.estimator import AcceptanceEstimator
from avspec.av.step_cost import StepCost
from avspec.av.verifier import AdaptiveVerifier
from avspec.config import EstimatorConfig
from avspec.contract import StepInputs, base_tokens
from avspec.engine.draft_stage import DraftOutput, DraftStage
from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep
from avspec.engine.target_stage import TargetStage
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.tools.train.features_zoo import ZOO_FEATURES, feature_zoo

WORKLOADS = ("code", "prose", "high_entropy")


class RecordingDraftStage(DraftStage):
    """DraftStage that also computes the alternative features from each position's logits."""

    def __call__(self, inputs: StepInputs) -> DraftOutput:
        shape = (inputs.batch_size, self.max_draft_tokens)
        self.zoo = {name: torch.zeros(shape) for name in ZOO_FEATURES}
        return super().__call__(inputs)

    def _draft_position(self, position, draw, logits, out, drafting) -> torch.Tensor:  # noqa: ANN001
        features = super()._draft_position(position, draw, logits, out, drafting)
        sampled = out.draft_tokens[draw.index, position].unsqueeze(1).long()  # [rows, 1]
        extra = feature_zoo(logits[:, None, :], draw.temperature, sampled)
        for name, values in extra.items():
            values = values[:, 0]
            if drafting is not None:  # rows masked off (stopped) keep padding
                values = torch.where(drafting, values, torch.zeros_like(values))
            self.zoo[name][draw.index.cpu(), position] = values.cpu()
        return features


class RecordingStep(SpeculativeStep):
    """The in-process step (draft -> verifier -> target) that appends one row per request."""

    def __init__(self, draft: RecordingDraftStage, verifier: AdaptiveVerifier, target: TargetStage):
        super().__init__(draft, verifier, target, on_step=self._record)
        self.rows: dict[str, list[np.ndarray]] = {}
        self.base_tokens: list[int] = []

    def _record(self, inputs, drafted, decision, out) -> None:  # noqa: ANN001
        if inputs.batch_size:
            pending = base_tokens(inputs.input_lengths, inputs.reusable)
            refits = self.verifier.estimator.num_refits  # refits behind this step's predictions
            self._append(inputs, drafted, decision.confidences, out, pending, refits)

    def _append(self, inputs, drafted, confidences, out, base_tokens, refits) -> None:  # noqa: ANN001
        step = len(self.base_tokens)
        self.base_tokens.append(base_tokens)
        batch = inputs.batch_size
        columns = {
            "step": np.full(batch, step, dtype=np.int32),
            "seq_id": inputs.seq_ids.numpy().astype(np.int32),
            # drafts actually drafted (= num_draft_tokens: AV and adaptive drafting are off)
            "num_draft": drafted.num_drafted.cpu().numpy().astype(np.int8),
            "num_accepted": out.num_accepted.cpu().numpy().astype(np.int8),
            "refits": np.full(batch, refits, dtype=np.int16),
            "logit_qmax": drafted.draft_features.cpu().numpy(),
            "served_pred": confidences.cpu().numpy(),
            **{name: t.numpy() for name, t in self.draft.zoo.items()},
        }
        for name, values in columns.items():
            self.rows.setdefault(name, []).append(values)


def step_cost(path: Path, max_rows: int, max_tokens: int) -> StepCost:
    """The step cost file at `path` (avspec.av.cost_file), or the linear default when it does
    not exist; a file that exists but is malformed or of the old format raises ValueError."""
    try:
        return load_step_cost(path)
    except FileNotFoundError:
        print(f"collect_drafts: {path} not found: linear default step cost", file=sys.stderr)
        return default_step_cost(max_rows, max_tokens)


def build_step(args: argparse.Namespace) -> RecordingStep:
    target_model = load_model(args.target_dir, max_length=args.max_length)
    draft_model = load_model(args.draft_dir, max_length=args.max_length)
    k, sequences = args.k, args.concurrency + 1

    def cache(model):  # noqa: ANN001, ANN202
        return model.new_cache(sequences, args.max_length, "cpu", torch.float32)

    cost = step_cost(args.cost_tables, sequences, sequences * args.max_length)
    config = EstimatorConfig(num_positions=k, refit_interval=args.refit_interval)
    estimator = AcceptanceEstimator(config)
    return RecordingStep(
        RecordingDraftStage(draft_model, cache(draft_model), k, top_k=args.draft_top_k),
        AdaptiveVerifier(estimator, cost),
        TargetStage(target_model, cache(target_model), k),
    )


def load_prompts(workload_dir: Path, workload: str, count: int) -> list[str]:
    lines = (workload_dir / f"{workload}.jsonl").read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    if len(prompts) < count:
        raise SystemExit(f"{workload}: {len(prompts)} prompts, need {count}")
    return [prompts[i * len(prompts) // count] for i in range(count)]  # evenly spaced


def collect(args: argparse.Namespace) -> dict[str, np.ndarray]:
    tokenizer = load_tokenizer(args.target_dir)  # the pair's: the target's tokenizer.json
    parts: dict[str, list[np.ndarray]] = {}
    slopes, intercepts, steps_before = [], [], 0
    for w, workload in enumerate(args.workloads):
        step = build_step(args)
        scheduler = Scheduler(step, tokenizer.eos_ids, args.concurrency, args.max_length, args.k)
        prompts = load_prompts(args.workload_dir, workload, args.prompts)
        bar = tqdm(total=len(prompts), desc=f"collect {workload}", file=sys.stderr)
        errors: list[Exception] = []
        for i, prompt in enumerate(prompts):
            request = GenerationRequest(
                tokenizer.encode(prompt), args.max_tokens, args.temperature, args.top_p,
                random_seed=args.seed + i, num_draft_tokens=args.k, adaptive=False,
            )  # fmt: skip
            scheduler.submit(request, lambda r, bar=bar: bar.update(int(r.finished)), errors.append)
        scheduler.run_until_idle()
        bar.close()
        if errors:
            raise SystemExit(f"{workload}: {len(errors)} request(s) failed: {errors[0]!r}")
        rows = {name: np.concatenate(values) for name, values in step.rows.items()}
        rows["step"] = rows["step"] + steps_before
        rows["workload"] = np.full(rows["step"].shape, w, dtype=np.int8)
        rows["seq_id"] = rows["seq_id"] + 100_000 * w  # distinct across workloads
        steps_before += len(step.base_tokens)
        for name, values in {**rows, "base_tokens": np.asarray(step.base_tokens)}.items():
            parts.setdefault(name, []).append(values)
        slopes.append(float(step.verifier.estimator.slope))
        intercepts.append(step.verifier.estimator.intercepts.numpy().copy())
    data = {name: np.concatenate(values) for name, values in parts.items()}
    data["final_slope"] = np.asarray(slopes, dtype=np.float32)
    data["final_intercepts"] = np.stack(intercepts).astype(np.float32)
    data["workloads"] = np.asarray(args.workloads)
    data["refit_interval"] = np.asarray(args.refit_interval)
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-dir", type=Path, default=Path("models/target"))
    parser.add_argument("--draft-dir", type=Path, default=Path("models/draft"))
    parser.add_argument("--workload-dir", type=Path, default=Path("workloads"))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list")
    parser.add_argument("--prompts", type=int, default=24, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16, help="requests stepped together")
    parser.add_argument("--k", type=int, default=8, help="drafts per step (Kmax)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument(
        "--draft-top-k", type=int, default=0, help="the draft's top_k (0: the target's warp)"
    )
    parser.add_argument("--seed", type=int, default=0, help="request i gets seed + i")
    parser.add_argument("--refit-interval", type=int, default=100, help="online estimator's N")
    parser.add_argument("--max-length", type=int, default=512, help="KV positions per sequence")
    parser.add_argument("--cost-tables", type=Path, default=Path("models/cost_tables.json"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("bench/drafts.npz"))
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    data = collect(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **data)
    mask = data["num_draft"] > 0
    print(
        f"{args.out}: {int(data['num_draft'].sum())} drafts in {int(mask.sum())} request-steps, "
        f"{data['base_tokens'].size} steps, {time.monotonic() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
