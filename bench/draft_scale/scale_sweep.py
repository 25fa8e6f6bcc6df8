"""Acceptance at position 1 of the shipped draft with its logits scaled by alpha before the served
warp (temperature 0.7, top-p 0.95): how much acceptance the draft's sharpness costs.

    .venv/bin/python bench/draft_scale/scale_sweep.py --heldout build/draft-tv/heldout

p from the saved top-64 teacher logits of the held-out chunks (`evaluate.approx_acceptance`).
Any fixed alpha keeps speculative sampling exact (q is whatever the draft samples from).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from avspec.engine.draft_vocab import load_draft_vocab
from avspec.runtime.model_dir import load_model
from avspec.tools.train.draft.evaluate import approx_acceptance, load_chunks, served_draft


class Scaled(nn.Module):
    def __init__(self, draft: nn.Module, alpha: float) -> None:
        super().__init__()
        self.draft, self.alpha = draft, alpha

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.draft(ids) * self.alpha


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--heldout", default="build/draft-tv/heldout")
    parser.add_argument("--alphas", default="0.6,0.7,0.8,0.9,1.0,1.1")
    parser.add_argument("--limit", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    draft = load_model(args.draft)
    vocab = load_draft_vocab(f"{args.draft}/draft_vocab.json", draft.config.vocab_size)
    served = served_draft(draft, vocab)
    heldout = load_chunks(args.heldout)
    for alpha in (float(a) for a in args.alphas.split(",")):
        result = approx_acceptance(Scaled(served, alpha), heldout, limit=args.limit)
        print(json.dumps({"alpha": alpha, **result}), flush=True)


if __name__ == "__main__":
    main()
