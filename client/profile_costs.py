"""Measure the draft and verify cost tables of a model pair and write them as JSON.

The verifier's budget (spec section 4) divides expected tokens by measured cost:
draft_cost[batch size] + verify_cost[target tokens]. This script times the real draft and
target stages (avspec.tools.profiler) and writes

    {"draft_cost": {"sizes": [...], "millis": [...]},
     "verify_cost": {"sizes": [...], "millis": [...]}, "device": ..., "date": ..., ...}

Examples:
    python client/profile_costs.py --output costs.json
    python client/profile_costs.py --random-pair --device cuda --output costs_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
from tqdm import tqdm

from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.profiler import CostPoints, profile_draft_cost, profile_verify_cost

RANDOM_TARGET = TransformerConfig(num_layers=4, width=256, num_heads=4)
RANDOM_DRAFT = TransformerConfig(num_layers=1, width=96, num_heads=4)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Sizes: draft cost is indexed by batch size, verify cost by total target tokens "
        "(batch * (1 + verified drafts)).",
    )
    parser.add_argument("--target-dir", type=Path, default=Path("models/target"))
    parser.add_argument("--draft-dir", type=Path, default=Path("models/draft"))
    parser.add_argument(
        "--random-pair",
        action="store_true",
        help="profile seeded random-weight models of the default sizes instead of model dirs",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-draft-tokens", type=int, default=8, help="K (default 8)")
    parser.add_argument("--draft-batch-sizes", default="1,2,4,8,16,32", help="comma list")
    parser.add_argument(
        "--verify-batch-sizes", default="1,4,16", help="comma list; each verifies 0..K drafts"
    )
    parser.add_argument("--context", type=int, default=64, help="cached tokens per sequence")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per point")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per point")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is steadier on a busy box)"
    )
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    return parser.parse_args(argv)


def load_pair(args: argparse.Namespace) -> tuple[Transformer, Transformer, str]:
    """(target, draft, description) from model dirs or seeded random weights."""
    if args.random_pair:
        models = []
        for seed, config in ((1, RANDOM_TARGET), (2, RANDOM_DRAFT)):
            model = Transformer(config)
            init_weights(model, torch.Generator().manual_seed(seed))
            models.append(model.to(args.device).eval())
        return models[0], models[1], "random-weight pair (target 4x256, draft 1x96)"
    from avspec.runtime.model_dir import load_model_dir

    target, _ = load_model_dir(args.target_dir, args.device)
    draft, _ = load_model_dir(args.draft_dir, args.device)
    return target.eval(), draft.eval(), f"{args.target_dir} + {args.draft_dir}"


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def print_table(title: str, unit: str, points: CostPoints) -> None:
    print(f"\n{title}\n{unit:>10}  {'ms':>9}")
    for size, ms in zip(points.sizes, points.millis, strict=True):
        print(f"{size:>10}  {ms:>9.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    draft_sizes = [int(s) for s in args.draft_batch_sizes.split(",") if s]
    verify_sizes = [int(s) for s in args.verify_batch_sizes.split(",") if s]
    target, draft, what = load_pair(args)
    k = args.max_draft_tokens
    common = {"context_length": args.context, "repeats": args.repeats, "warmup": args.warmup}
    with tqdm(total=len(draft_sizes) + len(verify_sizes) * (k + 1), desc="profiling") as bar:
        draft_cost = profile_draft_cost(
            draft, k, draft_sizes, on_point=lambda *_: bar.update(), **common
        )
        verify_cost = profile_verify_cost(
            target, k, verify_sizes, on_point=lambda *_: bar.update(), **common
        )
    result = {
        "draft_cost": draft_cost.to_dict(),
        "verify_cost": verify_cost.to_dict(),
        "device": device_name(args.device),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "models": what,
        "max_draft_tokens": k,
        "context_length": args.context,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{what} on {result['device']}")
    print_table(f"draft cost ({k} drafts per sequence)", "batch", draft_cost)
    print_table("verify cost (target stage)", "tokens", verify_cost)
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
