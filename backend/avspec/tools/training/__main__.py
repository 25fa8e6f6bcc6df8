"""Train the default draft/target pair on the Python standard library and its pydoc topics.

The command line of `avspec.tools.training` (`make models`): train the draft, train the target,
then report on both saved models and write `training_log.json` and `MODEL_CARD.md`; `--only`
runs one of the three phases.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from avspec.runtime.model_dir import load_model_dir, save_model_dir
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.tools.training.corpus import corpus_files, encode_files, split_files
from avspec.tools.training.evaluate import report
from avspec.tools.training.model_card import model_card
from avspec.tools.training.train import DRAFT_CONFIG, TARGET_CONFIG, TrainSettings, train_model


def train_and_save(name: str, args: argparse.Namespace, corpus: dict) -> None:
    """Train one model of the pair and write `out/<name>` plus its `training.json` log."""
    config, settings, seed = {
        "draft": (DRAFT_CONFIG, TrainSettings(args.draft_steps, lr=3e-3), args.seed + 100),
        "target": (TARGET_CONFIG, TrainSettings(args.target_steps), args.seed),
    }[name]
    start = time.perf_counter()
    model, curve = train_model(
        config, settings, corpus["train_ids"], corpus["held_out_ids"], seed, name
    )
    save_model_dir(args.out / name, model, ByteTokenizer())
    log = {
        "config": config.to_dict(),
        "settings": asdict(settings),
        "seed": seed,
        "threads": args.threads,
        "parameters": model.num_parameters(),
        "train_seconds": time.perf_counter() - start,
        "curve": curve,
    }
    (args.out / name / "training.json").write_text(json.dumps(log, indent=2) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.training", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("models"), help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=800)
    parser.add_argument("--draft-steps", type=int, default=1500)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: robust when shared)"
    )
    parser.add_argument(
        "--only",
        choices=("draft", "target", "report"),
        help="run one phase (train draft, train target, or report on both saved models)",
    )
    return parser.parse_args(argv)


def write_report(out: Path, seed: int, train: list, held_out: list, corpus: dict) -> dict:
    """Evaluate both saved models; write `training_log.json` and `MODEL_CARD.md`; return the log."""
    draft, _ = load_model_dir(out / "draft")
    target, _ = load_model_dir(out / "target")
    log = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "corpus": {
            "train_files": len(train),
            "held_out_files": len(held_out),
            "train_bytes": len(corpus["train_ids"]),
            "held_out_bytes": len(corpus["held_out_ids"]),
        },
        "models": {
            name: json.loads((out / name / "training.json").read_text())
            for name in ("draft", "target")
        },
        "report": report(draft, target, held_out, seed),
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(out, log))
    return log


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = ByteTokenizer()
    train, held_out = split_files(corpus_files())
    corpus = {
        "train_ids": encode_files(train, tokenizer),
        "held_out_ids": encode_files(held_out, tokenizer),
    }
    for name in ("draft", "target"):
        if args.only in (None, name):
            train_and_save(name, args, corpus)
    if args.only in (None, "report"):
        log = write_report(args.out, args.seed, train, held_out, corpus)
        print(json.dumps(log["report"], indent=2))


if __name__ == "__main__":
    main()
