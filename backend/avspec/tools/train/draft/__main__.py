"""Train a draft for a Hugging Face target: data, then distillation, then a held-out report.

    python -m avspec.tools.train.draft --target models/target --work build/draft-smollm2 \\
        --out models/draft

Phases (`--only` runs one; without it all four run, training beside the data: `data` goes on in
a second process while `train` starts on the first chunk and re-lists the chunks every pass,
which is how the committed draft was made and keeps `make draft` inside two hours on two cores:
when training's `--minutes` are spent, a data phase still answering is stopped, its finished
chunks kept):
`data` (held-out then train prompts answered by the target, chunk files under `<work>/heldout`
and `<work>/train`, with `--raw-prompts N` also N raw code and prose prefixes continued without
the chat template (`chunk_raw_*.pt`); then, with `--self-prompts N`, N user messages the target
writes itself (`avspec.tools.train.draft.self_prompts`, kept in `<work>/self_prompts.json`)
answered into `<work>/train/chunk_self_*.pt`, apart from the corpus chunks; resumable), `train`
(top-64 KL distillation on whatever chunks exist, checkpointed to `<work>/checkpoint.pt`;
resumable; `--init-from DIR` starts a new run from a draft directory's weights: a
fine-tune), `report` (held-out acceptance at position 1 and AUC, written to
`<work>/report.json`, and the draft saved as a Hugging Face directory in `--out`), `card` (the
pair's model card, measured on the target and the draft in `--out`:
`avspec.tools.train.draft.model_card`; written to `--card`, by default
`<out>/MODEL_CARD.md`; `--cost-tables` adds the cost ratio). One torch thread by default: the
machine is shared.

    python -m avspec.tools.train.draft --only card --target models/target \
        --out models/draft --card models/MODEL_CARD.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from avspec.engine.draft_vocab import DRAFT_VOCAB_FILE, DraftVocab, load_draft_vocab
from avspec.runtime.hf_config import read_hf_config
from avspec.tools.train.draft.data import data_process, make_data

PHASES = ("data", "train", "report", "card")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.train.draft", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--target", type=Path, default=Path("models/target"))
    parser.add_argument("--work", type=Path, default=Path("build/draft-smollm2"))
    parser.add_argument("--out", type=Path, default=Path("models/draft"))
    parser.add_argument("--train-prompts", type=int, default=2560)
    parser.add_argument("--heldout-prompts", type=int, default=96)
    parser.add_argument(
        "--self-prompts", type=int, default=0, help="target-written user messages (Magpie)"
    )
    parser.add_argument(
        "--raw-prompts", type=int, default=0,
        help="raw code / prose prefixes the target continues without the chat template",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=64, help="target rows decoding together")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--features", action="store_true",
        help="keep the target's last hidden states in the chunks too (a head's training data)",
    )  # fmt: skip
    parser.add_argument("--minutes", type=float, default=60.0, help="training wall time")
    parser.add_argument(
        "--target-layers", default="0,1,2",
        help="a new draft: these target blocks over the target's frozen embedding (comma list)",
    )  # fmt: skip
    parser.add_argument(
        "--draft-vocab", type=Path,
        help="train q over this map's kept ids, as served (default <out>/draft_vocab.json if any)",
    )  # fmt: skip
    parser.add_argument(
        "--init-from", type=Path, metavar="DIR",
        help="a new run starts from this draft directory's weights (same shape), not the target's",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument(
        "--tv-weight", type=float, default=0.0,
        help="add this times 1 - acceptance at the served warp (temperature 0.7, top-p 0.95)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=PHASES)
    parser.add_argument("--card", type=Path, help="model card path (default <out>/MODEL_CARD.md)")
    parser.add_argument("--no-card", action="store_true", help="all phases but the card")
    parser.add_argument("--card-contexts", type=int, default=256, help="held-out chat contexts")
    parser.add_argument(
        "--card-head", type=Path, default=None,
        help="a draft head directory to set beside the draft on the card (its cost file: "
        "<dir>/cost_tables.json)",
    )  # fmt: skip
    parser.add_argument("--cost-tables", type=Path, help="cost file of this pair, for the card")
    return parser.parse_args(argv)


def _wait_for_chunk(train_dir: Path, data: multiprocessing.process.BaseProcess) -> None:
    """Block until a train chunk exists (training needs one) or the data process ended."""
    while not any(train_dir.glob("chunk_*.pt")):
        if not data.is_alive():
            raise SystemExit(f"the data phase ended without a chunk in {train_dir}")
        time.sleep(10)


def _end_data_phase(data: multiprocessing.process.BaseProcess) -> None:
    """After training: a data phase still answering is stopped, since nothing would train on
    what it writes next (its finished chunks stay; `--only data` resumes at the first missing
    one), so training's wall time bounds the run on a slow host; one that ended by itself
    must have succeeded."""
    if data.is_alive():
        print("training is done: stopping the data phase (`--only data` resumes it)",
              file=sys.stderr)  # fmt: skip
        data.terminate()
        data.join()
        return
    data.join()
    if data.exitcode != 0:
        raise SystemExit(f"the data phase failed (exit code {data.exitcode})")


def training_vocab(path: Path | None, out: Path, target: Path) -> DraftVocab | None:
    """The map the draft trains over: `path`, else `<out>/draft_vocab.json` when it exists."""
    path = path if path is not None else out / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    return load_draft_vocab(path, read_hf_config(target).config.vocab_size)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = None
    if args.only == "data":
        make_data(args)
    elif args.only is None:
        # daemon: a failed training step ends the data phase with it
        spawn = multiprocessing.get_context("spawn")
        data = spawn.Process(target=data_process, args=(args,), daemon=True)
        data.start()
        _wait_for_chunk(args.work / "train", data)
    if args.only in (None, "train"):
        from avspec.tools.train.draft.train import DraftTraining, train_draft

        shape = {"target_layers": [int(i) for i in args.target_layers.split(",")]}
        training = DraftTraining(args.minutes, args.seed, lr=args.lr, tv_weight=args.tv_weight)
        vocab = training_vocab(args.draft_vocab, args.out, args.target)
        train_draft(args.target, args.work, training, shape, vocab, args.init_from)
    if data is not None:
        _end_data_phase(data)
    if args.only in (None, "report"):
        from avspec.tools.train.draft.report import write_report

        report = write_report(args.target, args.work, args.out)
        print(json.dumps(report, indent=2), file=sys.stderr)
    if args.only == "card" or (args.only is None and not args.no_card):
        from avspec.tools.train.draft.model_card import write_card

        card = args.card if args.card is not None else args.out / "MODEL_CARD.md"
        write_card(
            args.target, args.out, card, args.card_contexts, args.seed, args.cost_tables,
            args.threads, args.card_head,
        )  # fmt: skip
        print(f"wrote {card}", file=sys.stderr)


if __name__ == "__main__":
    main()
