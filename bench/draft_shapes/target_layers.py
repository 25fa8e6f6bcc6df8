"""Drafts made of the target's own blocks, untrained and after a short trial (docs/smollm2.md).

    python bench/draft_shapes/target_layers.py zero-shot            # acceptance, untrained
    python bench/draft_shapes/target_layers.py trial --layers 0,1,2 --minutes 12

`zero-shot`: for each choice of blocks, `avspec.tools.train.draft.model.target_layers_draft` as it
is (the target's blocks, final norm and embedding) and its approximate held-out acceptance at
position 1 (`approx_acceptance`, 12 held-out answers of build/draft-smollm2/heldout).
`trial`: `avspec.tools.train.draft.train.train_draft` from a fresh draft of `--layers` (embedding
frozen, q over the kept ids of models/draft/draft_vocab.json, `--lr`, warmup then cosine over
`--minutes` of step time) on whatever chunks are in build/draft-smollm2/train, one thread, in a
scratch work directory; prints its log, the approximate acceptance on 24 held-out answers every
3 minutes (one JSON line each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from avspec.engine.draft_vocab import load_draft_vocab
from avspec.runtime.hf_config import read_hf_config
from avspec.runtime.model_dir import load_model
from avspec.tools.train.draft.evaluate import approx_acceptance, load_chunks
from avspec.tools.train.draft.model import target_layers_draft
from avspec.tools.train.draft.train import LOG, train_draft

DATA = Path("build/draft-smollm2")  # the draft's data phase: heldout/ and train/ chunks

CHOICES = ([0, 1, 2], [0, 1, 2, 29], [0, 1, 28, 29], [0, 1, 2, 3, 28, 29], [0, 29],
           [0, 1, 2, 27, 28, 29])  # fmt: skip


def zero_shot(target, heldout) -> None:
    full = list(range(target.config.num_layers))
    for layers in (full, *CHOICES):
        result = approx_acceptance(target_layers_draft(target, layers).eval(), heldout, limit=12)
        print(json.dumps({"layers": layers, **result}), flush=True)


def trial(layers: list[int], minutes: float, lr: float) -> None:
    """`train_draft` itself, from a fresh draft of `layers`, in a scratch work directory that
    links the real chunks; prints its held-out log (every 3 minutes)."""
    width = read_hf_config("models/target").config.vocab_size
    vocab = load_draft_vocab("models/draft/draft_vocab.json", width)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for part in ("heldout", "train"):
            (work / part).symlink_to(DATA.resolve() / part)
        train_draft("models/target", work, minutes, shape={"target_layers": layers}, vocab=vocab,
                    lr=lr, checkpoint_minutes=3.0)  # fmt: skip
        print((work / LOG).read_text(), end="")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("zero-shot", "trial"))
    parser.add_argument("--layers", default="0,1,2")
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode == "zero-shot":
        target = load_model("models/target", max_length=1024)
        zero_shot(target, load_chunks(DATA / "heldout"))
    else:
        trial([int(i) for i in args.layers.split(",")], args.minutes, args.lr)


if __name__ == "__main__":
    main()
