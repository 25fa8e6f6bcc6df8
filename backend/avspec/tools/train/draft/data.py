"""The draft's data phase: held-out prompts answered by the target, then (optionally) raw
completion prompts it continues, then the train chat prompts, then (optionally) user messages the
target writes itself, answered the same way (every part resumable).

`data_process` is the same, as the target of a second process (`python -m avspec.tools.train.draft`
without `--only` trains beside it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from avspec.tools.train.draft.generate import AnswerSettings, generate_chunks
from avspec.tools.train.draft.prompts import build_prompts, build_raw_prompts
from avspec.tools.train.tiny.corpus import corpus_files, split_files

SELF_PREFIX = "chunk_self_"  # `evaluate.load_chunks` reads chunk_*.pt
SELF_SEED = 50_000  # the self prompts' answers draw apart from the corpus chunks' seeds
RAW_PREFIX = "chunk_raw_"
RAW_SEED = 70_000  # and the raw prompts' continuations apart from both
RAW_HELDOUT = "heldout_raw"  # held-out raw prompts, continued (the report measures them apart)


def make_data(args: argparse.Namespace) -> None:
    """Answer the held-out prompts, the raw prompts (`--raw-prompts`, from the train split, into
    `<work>/train/chunk_raw_*.pt`, and as many held-out ones as chat ones into
    `<work>/heldout_raw`), then the train prompts (each resumable). The raw ones come
    before the chat ones so that a draft trained beside this phase sees both early."""
    train, held_out = split_files(corpus_files())
    settings = AnswerSettings(
        args.batch, args.max_new_tokens, features=getattr(args, "features", False)
    )
    heldout = build_prompts(held_out, args.heldout_prompts, args.seed + 1)
    generate_chunks(args.target, heldout, args.work / "heldout", settings, seed=10_000)
    if getattr(args, "raw_prompts", 0) > 0:  # and as many held out as chat ones
        raw_heldout = build_raw_prompts(held_out, args.heldout_prompts)
        generate_chunks(args.target, raw_heldout, args.work / RAW_HELDOUT, settings, RAW_SEED)
        raw = build_raw_prompts(train, args.raw_prompts)
        generate_chunks(args.target, raw, args.work / "train", settings,
                        seed=args.seed + RAW_SEED, prefix=RAW_PREFIX)  # fmt: skip
    if args.self_prompts > 0:  # general chat before the corpus: a drafter trained beside sees it
        make_self_data(args.target, args.work, args.self_prompts, args.seed, settings)
    prompts = build_prompts(train, args.train_prompts, args.seed)
    generate_chunks(args.target, prompts, args.work / "train", settings, seed=args.seed)


def make_self_data(
    target: Path, work: Path, count: int, seed: int, settings: AnswerSettings
) -> list[Path]:
    """`count` self prompts (sampled once, cached in `<work>/self_prompts.json`) answered into
    `<work>/train/chunk_self_*.pt` (resumable); returns the chunk files."""
    from avspec.tools.train.draft.self_prompts import cached_self_prompts

    prompts = cached_self_prompts(target, count, work / "self_prompts.json", seed, settings.batch)
    return generate_chunks(
        target, prompts, work / "train", settings, seed=seed + SELF_SEED, prefix=SELF_PREFIX
    )


def data_process(args: argparse.Namespace) -> None:
    """`make_data` with `args.threads` torch threads (a spawned process starts with the default)."""
    torch.set_num_threads(args.threads)
    make_data(args)
