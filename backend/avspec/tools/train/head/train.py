"""Train the draft head on the target's features and answers, resumably.

Data: the draft pipeline's chunks with features (`make draft-head`'s data phase:
`python -m avspec.tools.train.draft --only data --features`), re-listed every pass like the
draft's, so training can start while the target still answers. Per batch (`head_batch`) the
head is unrolled `depth` steps (`unroll`, training-time test) and the loss sums over depths,
depth d weighted DEPTH_DECAY ** (d - 1):

- token: KL(p_top || q), p the target's top-64 logits renormalised over the kept ids of the
  draft vocabulary, q the head's softmax over the kept ids (`draft.train.top_kl`), at the
  answer positions;
- feature: `feature_weight` times the smooth-L1 distance of the guessed feature to the target's
  next feature, per channel, at every position (EAGLE's regression; it keeps the guesses usable
  as the next depth's input).

AdamW over the head's own tensors (fc, block, final norm; the embedding is the target's, frozen),
warmup then cosine over the wall-time budget (`draft.train.lr_at`). Every `checkpoint_minutes`
the head, optimiser, clock and progress go to `<work>/head_checkpoint.pt`, with the held-out
teacher-forced acceptance by depth (`evaluate.head_acceptance`) logged to
`<work>/head_log.jsonl`.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from avspec.engine.draft_vocab import DraftVocab
from avspec.runtime.head import DraftHead, head_config, new_head
from avspec.runtime.model_dir import load_model
from avspec.tools.train.draft.evaluate import load_chunks
from avspec.tools.train.draft.train import batches, kept_slots, lr_at, top_kl
from avspec.tools.train.head.batch import HeadBatch, head_batch
from avspec.tools.train.head.evaluate import head_acceptance
from avspec.tools.train.head.unroll import unroll, valid_from

CHECKPOINT = "head_checkpoint.pt"
LOG = "head_log.jsonl"
DEPTH_DECAY = 0.8


@dataclass(frozen=True)
class HeadTraining:
    """How the head trains: wall-time `minutes`, peak `lr`, `depth` of the unroll, the feature
    loss's weight, batch size in tokens, the target block its block starts from."""

    minutes: float = 60.0
    lr: float = 1e-3
    depth: int = 3
    feature_weight: float = 0.1
    tokens_per_batch: int = 2048
    init_layer: int = 0
    checkpoint_minutes: float = 4.0
    seed: int = 0


def head_loss(
    head: DraftHead, batch: HeadBatch, depth: int, kept: torch.Tensor, slots: torch.Tensor,
    feature_weight: float, inputs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """The summed loss of a batch over depths, and its parts per depth (for the log).
    `inputs`: the depth-1 input features in place of `batch.features` (e.g. several of the
    target's layers fused, EAGLE-3); the guesses are still scored on the target's next feature."""
    guesses = unroll(head, batch.features if inputs is None else inputs, batch.tokens, depth)
    rows = head.layers.embed.weight[kept]
    target = batch.next_features
    top_ids = slots[batch.top_ids]
    total = torch.zeros(())
    parts: dict[str, float] = {}
    for d, guess in enumerate(guesses, start=1):
        start = valid_from(d)
        token_mask = batch.token_mask.clone()
        token_mask[:, :start] = False
        keep = token_mask[batch.token_mask]  # which scored positions this depth reaches
        kl = top_kl(head.logits(guess[token_mask], rows), top_ids[keep], batch.top_logits[keep])
        feature_mask = batch.feature_mask.clone()
        feature_mask[:, :start] = False
        regression = F.smooth_l1_loss(guess[feature_mask], target[feature_mask])
        total = total + DEPTH_DECAY ** (d - 1) * (kl + feature_weight * regression)
        parts[f"kl_{d}"] = round(kl.item(), 4)
        parts[f"l1_{d}"] = round(regression.item(), 4)
    return total, parts


def train_head(
    target_dir: Path | str, work: Path | str, vocab: DraftVocab, settings: HeadTraining
) -> DraftHead:
    """Train (or resume) the head for `settings.minutes` of wall time in all; returns it in
    eval mode. A resumed run keeps its checkpoint's settings but the minutes."""
    work = Path(work)
    path = work / CHECKPOINT
    target = load_model(target_dir, max_length=1024)
    kept = torch.tensor(vocab.token_ids)
    if path.is_file():
        state = torch.load(path, weights_only=False)
        if not torch.equal(state["kept_ids"], kept):
            raise ValueError(f"{path}: trained with another draft vocabulary than the one given")
        settings = HeadTraining(**(state["settings"] | {"minutes": settings.minutes}))
        head = DraftHead(head_config(target.config))
        head.load_state_dict(state["model"] | {"layers.embed.weight": target.embed.weight})
        head.layers.embed.weight.requires_grad_(False)
    else:
        state = {"elapsed": 0.0, "step": 0, "seen": 0, "kept_ids": kept,
                 "settings": asdict(settings)}  # fmt: skip
        head = new_head(target, settings.init_layer)
    slots = kept_slots(kept, target.config.vocab_size)
    del target
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    heldout = {name: with_features(load_chunks(work / name)) for name in heldout_sets(work)}
    rng = random.Random(settings.seed + state["step"])
    budget = settings.minutes * 60.0
    bar = tqdm(total=int(budget), initial=int(state["elapsed"]), desc="head (s)", file=sys.stderr,
               mininterval=10.0)  # fmt: skip
    last_save = time.perf_counter()
    head.train()
    while state["elapsed"] < budget:
        sequences = with_features(load_chunks(work / "train"))
        if not sequences:
            raise RuntimeError(f"no training chunks with features under {work / 'train'}")
        for group in batches(sequences, settings.tokens_per_batch, rng):
            tick = time.perf_counter()
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr_at(state["elapsed"] / budget, settings.lr)
            batch = head_batch(group)
            loss, parts = head_loss(
                head, batch, settings.depth, kept, slots, settings.feature_weight
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            state["elapsed"] += time.perf_counter() - tick
            state["step"] += 1
            state["seen"] += int(batch.token_mask.sum())
            bar.update(int(state["elapsed"]) - bar.n)
            bar.set_postfix(loss=f"{loss.item():.3f}", positions=state["seen"], refresh=False)
            done = state["elapsed"] >= budget
            if done or time.perf_counter() - last_save > settings.checkpoint_minutes * 60:
                save_checkpoint(head, optimizer, state, path, heldout, parts | {"kept": kept})
                last_save = time.perf_counter()
                head.train()
            if done:
                break
    bar.close()
    return head.eval()


def with_features(sequences: list[dict]) -> list[dict]:
    """The sequences that carry the target's features (chunks written with `--features`)."""
    return [s for s in sequences if "features" in s]


def heldout_sets(work: Path) -> list[str]:
    """The held-out chunk directories under `work` (`heldout`, `heldout_raw`, ...)."""
    return sorted(p.name for p in work.glob("heldout*") if p.is_dir())


def save_checkpoint(
    head: DraftHead, optimizer: torch.optim.Optimizer, state: dict, path: Path,
    heldout: dict[str, list[dict]], log: dict,
) -> None:  # fmt: skip
    """Write the checkpoint (temporary name, then rename) and one held-out log line."""
    head.eval()
    kept = log.pop("kept")
    entry: dict = {"step": state["step"], "elapsed_s": round(state["elapsed"], 1),
                   "positions_seen": state["seen"], **log}  # fmt: skip
    for name, sequences in heldout.items():
        entry[name] = head_acceptance(head, sequences[:24], kept, depth=3)
    with open(path.parent / LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")
    tqdm.write(f"checkpoint: {json.dumps(entry)}", file=sys.stderr)
    model = {k: v for k, v in head.state_dict().items() if k != "layers.embed.weight"}
    partial = path.with_suffix(".partial")
    torch.save({**state, "model": model, "optimizer": optimizer.state_dict()}, partial)
    os.replace(partial, path)
