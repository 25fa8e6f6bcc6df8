"""Train the default draft/target pair on the Python standard library and its pydoc topics.

The command line of `avspec.tools.train.tiny` (`make models`), in four phases:

1. a byte-level BPE tokenizer (`bpe.train_split_tokenizer`) on the train split;
2. the target, trained on the text;
3. the draft, distilled from the saved target (`train.train_model` with a teacher);
4. a report on both saved models: `training_log.json` and `MODEL_CARD.md`.

Both models are written as `LlamaForCausalLM` checkpoints (bf16 weights, the tokenizer files
alongside) that `transformers` and the served runtime load alike. `--only` runs one of the
phases 2-4 (the tokenizer is retrained every run: it is deterministic and takes a second).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from avspec.runtime.hf_checkpoint import save_hf_model
from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.model_dir import load_model
from avspec.tools.train.tiny.bpe import save_tokenizer, train_split_tokenizer
from avspec.tools.train.tiny.corpus import corpus_files, encode_files, split_files
from avspec.tools.train.tiny.evaluate import report, token_byte_lengths
from avspec.tools.train.tiny.model_card import model_card
from avspec.tools.train.tiny.train import (
    DRAFT_CONFIG,
    MAX_LENGTH,
    TARGET_CONFIG,
    TrainSettings,
    train_model,
)

SAVE_DTYPE = torch.bfloat16  # halves the committed weights; the runtime loads them as fp32
PHASES = ("target", "draft", "report")


def settings_for(name: str, args: argparse.Namespace) -> tuple:
    """(config, settings, seed) of one model of the pair."""
    return {
        "target": (TARGET_CONFIG, TrainSettings(args.target_steps, batch=8, seq=512), args.seed),
        "draft": (
            DRAFT_CONFIG,
            TrainSettings(
                args.draft_steps, batch=8, seq=512, lr=3e-3, distill_weight=args.distill_weight
            ),
            args.seed + 100,
        ),
    }[name]


def train_and_save(name: str, args: argparse.Namespace, corpus: dict, tokenizer_dir: Path) -> None:
    """Train one model of the pair and write `out/<name>` plus its `training.json` log; the
    draft is distilled from the saved target."""
    config, settings, seed = settings_for(name, args)
    distil = name == "draft" and args.distill_weight > 0
    teacher = load_model(args.out / "target") if distil else None
    start = time.perf_counter()
    model, curve = train_model(
        config, settings, corpus["train_ids"], corpus["held_out_ids"], seed, name,
        teacher=teacher, byte_lengths=corpus["byte_lengths"],
    )  # fmt: skip
    save_hf_model(model, args.out / name, tokenizer_dir, dtype=SAVE_DTYPE)
    log = {
        "config": config.to_dict(),
        "settings": asdict(settings),
        "distilled_from": "target" if teacher is not None else None,
        "seed": seed,
        "threads": args.threads,
        "saved_dtype": str(SAVE_DTYPE).removeprefix("torch."),
        "parameters": model.num_parameters(),
        "train_seconds": time.perf_counter() - start,
        "curve": curve,
    }
    (args.out / name / "training.json").write_text(json.dumps(log, indent=2) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.train.tiny", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("models/tiny"), help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=600)
    parser.add_argument("--draft-steps", type=int, default=800)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch intra-op threads (the run is reproducible "
        "for one thread count)",
    )  # fmt: skip
    parser.add_argument(
        "--distill-weight", type=float, default=1.0,
        help="the draft's loss: this share KL to the target, the rest the text (0: text only)",
    )  # fmt: skip
    parser.add_argument("--only", choices=PHASES, help="run one phase (the target first)")
    return parser.parse_args(argv)


def write_report(out: Path, seed: int, train: list, held_out: list, corpus: dict) -> dict:
    """Evaluate both saved models; write `training_log.json` and `MODEL_CARD.md`; return the log."""
    draft, target = load_model(out / "draft"), load_model(out / "target")
    tokenizer = HFTokenizer.from_directory(out / "target")
    log = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "corpus": {
            "train_files": len(train),
            "held_out_files": len(held_out),
            "train_bytes": sum(len(t.encode("utf-8")) for _, t in train),
            "held_out_bytes": sum(len(t.encode("utf-8")) for _, t in held_out),
            "train_tokens": len(corpus["train_ids"]),
            "held_out_tokens": len(corpus["held_out_ids"]),
            "vocab_size": tokenizer.vocab_size,
        },
        "models": {
            name: json.loads((out / name / "training.json").read_text())
            for name in ("target", "draft")
        },
        "report": report(draft, target, held_out, seed, tokenizer),
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(out, log))
    return log


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    train, held_out = split_files(corpus_files())
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = save_tokenizer(train_split_tokenizer(train), scratch, MAX_LENGTH)
        tokenizer = HFTokenizer.from_directory(tokenizer_dir)
        corpus = {
            "train_ids": encode_files(train, tokenizer),
            "held_out_ids": encode_files(held_out, tokenizer),
            "byte_lengths": token_byte_lengths(tokenizer),
        }
        for name in ("target", "draft"):
            if args.only in (None, name):
                train_and_save(name, args, corpus, tokenizer_dir)
    if args.only in (None, "report"):
        log = write_report(args.out, args.seed, train, held_out, corpus)
        print(json.dumps(log["report"], indent=2))


if __name__ == "__main__":
    main()
