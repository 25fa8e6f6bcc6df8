"""Drafts made of the target's own blocks, untrained and after a short trial (docs/smollm2.md).

    python bench/draft_shapes/target_layers.py zero-shot            # acceptance, untrained
    python bench/draft_shapes/target_layers.py trial --layers 0,1,2 --minutes 12

`zero-shot`: for each choice of blocks, `avspec.tools.draft.model.target_layers_draft` as it is
(the target's blocks, final norm and embedding) and its approximate held-out acceptance at
position 1 (`approx_acceptance`, 12 held-out answers of build/draft-smollm2/heldout).
`trial`: the training step of `avspec.tools.draft.train` (embedding frozen, q over the kept ids
of models/draft/draft_vocab.json, AdamW, warmup then cosine over `--minutes` of step time) on
whatever chunks are in build/draft-smollm2/train, one thread, logging the approximate
acceptance on 24 held-out answers every 3 minutes (one JSON line each).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from avspec.engine.draft_vocab import load_draft_vocab
from avspec.runtime.model_dir import load_model
from avspec.tools.draft.evaluate import approx_acceptance, load_chunks, served_draft
from avspec.tools.draft.model import target_layers_draft
from avspec.tools.draft.train import answer_logits, batches, kept_slots, lr_at, top_kl

CHOICES = ([0, 1, 2], [0, 1, 2, 29], [0, 1, 28, 29], [0, 1, 2, 3, 28, 29], [0, 29],
           [0, 1, 2, 27, 28, 29])  # fmt: skip


def zero_shot(target, heldout) -> None:
    full = list(range(target.config.num_layers))
    for layers in (full, *CHOICES):
        result = approx_acceptance(target_layers_draft(target, layers).eval(), heldout, limit=12)
        print(json.dumps({"layers": layers, **result}), flush=True)


def trial(target, heldout, layers: list[int], minutes: float, lr: float) -> None:
    vocab = load_draft_vocab("models/draft/draft_vocab.json", target.config.vocab_size)
    kept = torch.tensor(vocab.token_ids)
    slots = kept_slots(kept, target.config.vocab_size)
    draft = target_layers_draft(target, layers)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng, budget = random.Random(0), minutes * 60
    elapsed, seen, steps, logged = 0.0, 0, 0, 0.0
    while elapsed < budget:
        for batch in batches(load_chunks("build/draft-smollm2/train"), 4096, rng):
            tick = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(elapsed / budget, lr)
            logits, _ = answer_logits(draft, batch, kept)
            top_ids = slots[torch.cat([s["top_ids"] for s in batch]).long()]
            loss = top_kl(logits, top_ids, torch.cat([s["top_logits"] for s in batch]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            elapsed += time.perf_counter() - tick
            steps, seen = steps + 1, seen + len(top_ids)
            if elapsed - logged > 180 or elapsed >= budget:
                logged = elapsed
                measured = approx_acceptance(served_draft(draft.eval(), vocab), heldout)
                draft.train()
                print(json.dumps({"minutes": round(elapsed / 60, 1), "steps": steps,
                                  "positions": seen, "train_kl": round(loss.item(), 3),
                                  "s_per_step": round(elapsed / steps, 2), **measured}),
                      flush=True)  # fmt: skip
            if elapsed >= budget:
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("zero-shot", "trial"))
    parser.add_argument("--layers", default="0,1,2")
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("models/target", max_length=1024)
    heldout = load_chunks("build/draft-smollm2/heldout")
    if args.mode == "zero-shot":
        zero_shot(target, heldout)
    else:
        trial(target, heldout, [int(i) for i in args.layers.split(",")], args.minutes, args.lr)


if __name__ == "__main__":
    main()
