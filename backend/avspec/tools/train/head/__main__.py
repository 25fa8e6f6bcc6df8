"""Train the draft head for a target (`make draft-head`; `python -m avspec.tools.train.head -h`).

Phases (each resumable, `--only` runs one):

- `data`: the draft pipeline's data phase with the target's features kept
  (`avspec.tools.train.draft.data.make_data` with `features`): held-out corpus prompts, raw
  prefixes, user messages the target writes itself (Magpie) and corpus prompts, answered by the
  target at temperature 0.7 / top-p 0.95, into `<work>`; then the hand-written general
  questions (`avspec.tools.bench.general_chat`, never trained on) into `<work>/heldout_general`;
- `train`: `train.train_head` for `--minutes`, beside the data phase when both run (it trains on
  the chunks that have landed);
- `save`: the head into `--out` (`head.safetensors`, `head.json`, the draft vocabulary, the
  target's tokenizer files and its config with one layer, so the launcher's pair check reads the
  directory like a checkpoint), then `embed`;
- `embed`: the target's embedding copied into `--out` (`embedding.safetensors`, not kept in git:
  `make models` writes it on a fresh checkout).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from avspec.engine.draft_vocab import load_draft_vocab
from avspec.runtime.head import HeadSpec, head_config, save_head, write_embedding
from avspec.runtime.model_dir import load_model
from avspec.tools.train.draft.generate import AnswerSettings, generate_chunks
from avspec.tools.train.draft.prompts import ChatPrompt
from avspec.tools.train.head.train import HeadTraining, train_head

PHASES = ("data", "train", "save", "embed")
TARGET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json")  # fmt: skip
GENERAL_SEED = 90_000


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.train.head", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--target", type=Path, default=Path("models/target"))
    parser.add_argument("--work", type=Path, default=Path("build/drafter-data"))
    parser.add_argument("--out", type=Path, default=Path("models/head"))
    parser.add_argument("--draft-vocab", type=Path, default=Path("models/draft/draft_vocab.json"))
    parser.add_argument("--train-prompts", type=int, default=1536)
    parser.add_argument("--self-prompts", type=int, default=2048)
    parser.add_argument("--raw-prompts", type=int, default=512)
    parser.add_argument("--heldout-prompts", type=int, default=96)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--depth", type=int, default=3, help="training-time test depth")
    parser.add_argument("--feature-weight", type=float, default=0.1)
    parser.add_argument("--init-layer", type=int, default=0, help="target block to start from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=PHASES)
    return parser.parse_args(argv)


def make_head_data(args: argparse.Namespace) -> None:
    """The draft pipeline's data with features, then the general held-out questions."""
    from avspec.tools.bench.general_chat import GENERAL_CHAT
    from avspec.tools.train.draft.data import make_data

    torch.set_num_threads(args.threads)
    make_data(argparse.Namespace(**vars(args), features=True))
    general = [ChatPrompt(kind, "general", text) for kind, text in GENERAL_CHAT]
    settings = AnswerSettings(args.batch, args.max_new_tokens, features=True)
    generate_chunks(args.target, general, args.work / "heldout_general", settings, GENERAL_SEED)


def save(args: argparse.Namespace, head: torch.nn.Module | None = None) -> None:
    """Write the trained head (from the checkpoint unless given) into `--out`."""
    from avspec.runtime.head import DraftHead
    from avspec.tools.train.head.train import CHECKPOINT

    target = load_model(args.target, max_length=1024)
    if head is None:
        state = torch.load(args.work / CHECKPOINT, weights_only=False)
        head = DraftHead(head_config(target.config))
        head.load_state_dict(state["model"] | {"layers.embed.weight": target.embed.weight})
    assert isinstance(head, DraftHead)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.draft_vocab, args.out / "draft_vocab.json")
    for name in TARGET_FILES:
        if (args.target / name).is_file():
            shutil.copyfile(args.target / name, args.out / name)
    config = json.loads((args.target / "config.json").read_text())
    (args.out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}, indent=2))
    spec = HeadSpec(head_config(target.config), args.init_layer, "draft_vocab.json")
    save_head(head, spec, args.out)
    write_embedding(target, args.out)
    print(f"head: {args.out}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    phases = [args.only] if args.only else ["data", "train", "save"]
    data = None
    if "data" in phases and len(phases) > 1:
        data = multiprocessing.get_context("spawn").Process(target=make_head_data, args=(args,))
        data.start()
        while data.is_alive() and not any((args.work / "train").glob("chunk_*.pt")):
            time.sleep(10)
    elif "data" in phases:
        make_head_data(args)
    head = None
    if "train" in phases:
        vocab = load_draft_vocab(args.draft_vocab, load_model(args.target).config.vocab_size)
        settings = HeadTraining(
            minutes=args.minutes, lr=args.lr, depth=args.depth,
            feature_weight=args.feature_weight, init_layer=args.init_layer, seed=args.seed,
        )  # fmt: skip
        head = train_head(args.target, args.work, vocab, settings)
    if data is not None:
        data.terminate()  # a data phase still answering stops with the training minutes
        data.join()
    if "save" in phases:
        save(args, head)
    elif "embed" in phases:
        write_embedding(load_model(args.target), args.out)


if __name__ == "__main__":
    main()
