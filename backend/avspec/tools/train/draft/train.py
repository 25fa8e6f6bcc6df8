"""Distil the draft from the target's saved top-64 logits (KL at temperature 1), resumably.

Data: the chunk files of `avspec.tools.train.draft.generate` under `<work>/train`, re-listed every
pass, so training can start while the target is still answering and uses each chunk as it
lands. A sequence is prompt + answer; the draft runs over all of it but is scored only on
answer positions, where it will draft when served. Loss per answer position: the teacher's
top-64 logits renormalised to p (temperature 1), KL(p || q) = sum_top p (log p - log q) with
q the draft's full softmax; only the output matrix rows of answer positions are computed, the
head being most of the draft's cost at this vocabulary. With a reduced draft vocabulary
(`avspec.engine.draft_vocab`, the served default) q is the softmax over the kept ids alone, as
the draft stage serves it, only those rows of the output matrix are computed (6x fewer at
8,192 of 49,152), and the teacher's top-64 is renormalised over its kept ids (the target's mass
outside the map, about 1 %, is what the draft can never propose).
With `tv_weight` the loss adds that many times `top_tv`, one minus the acceptance of the two
distributions warped as served (temperature 0.7, top-p 0.95): measured against KL alone in
docs/smollm2.md.

The draft's shape (`avspec.tools.train.draft.model`) is chosen at the first step and kept in the
checkpoint; parameters with `requires_grad` False (a target-layers draft's embedding) are not
trained.

Sequences are batched by length (about `tokens_per_batch` tokens, right-padded: causal
attention never sees the padding). AdamW, warmup then cosine decay over the wall-time budget
(`minutes`), so a resumed run continues the same schedule. Every `checkpoint_minutes` the
model, optimiser, clock and progress go to `<work>/checkpoint.pt` (written then renamed), with
the held-out approximate acceptance (`avspec.tools.train.draft.evaluate.approx_acceptance`) logged
to `<work>/train_log.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from avspec.engine.draft_vocab import DraftVocab
from avspec.engine.top_p import top_p_filter
from avspec.runtime.model_dir import load_model
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.evaluate import (
    TEMPERATURE,
    TOP_P,
    approx_acceptance,
    load_chunks,
    served_draft,
)
from avspec.tools.train.draft.model import DEFAULT_SHAPE, new_draft, skeleton

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"


def lr_at(fraction: float, peak: float, warmup: float = 0.03) -> float:
    """Linear warmup over the first `warmup` of the budget, then cosine to 10 % of `peak`."""
    if fraction < warmup:
        return peak * max(fraction, 1e-3) / warmup
    progress = min(1.0, (fraction - warmup) / (1 - warmup))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def batches(sequences: list[dict], tokens_per_batch: int, rng: random.Random) -> Iterator[list]:
    """Shuffled batches of sequences of similar length, about `tokens_per_batch` tokens each."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["ids"]))
    groups: list[list[dict]] = []
    current: list[dict] = []
    longest = 0
    for i in order:
        longest = max(longest, len(sequences[i]["ids"]))
        if current and longest * (len(current) + 1) > tokens_per_batch:
            groups.append(current)
            current, longest = [], len(sequences[i]["ids"])
        current.append(sequences[i])
    if current:
        groups.append(current)
    rng.shuffle(groups)
    yield from groups


def answer_logits(
    model: Transformer, batch: list[dict], rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft logits at every answer position [positions, vocab or kept], position mask): the
    draft run over prompt + answer, right-padded, its head applied to answer rows only (and to
    the output-matrix rows `rows` only, when given: the kept ids of a draft vocabulary)."""
    width = max(len(s["ids"]) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, s in enumerate(batch):
        ids[row, : len(s["ids"])] = s["ids"]
        start = s["prompt_length"] - 1
        mask[row, start : start + s["answer_length"]] = True
    x = model.embed(ids)
    for block in model.blocks:
        x = block(x, model.rotary)
    if rows is None:
        return model.logits(x[mask]), mask
    return model.subset_logits(x[mask], model.embed.weight[rows]), mask


def _scored(
    draft_logits: torch.Tensor, top_ids: torch.Tensor, top_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft_logits, top_ids, top_logits, keep) at the positions with a kept teacher id;
    `keep` [positions, k] marks the teacher entries whose id is not -1."""
    keep = top_ids >= 0
    scored = keep.any(-1)
    if bool(scored.all()):
        return draft_logits, top_ids, top_logits, keep
    return draft_logits[scored], top_ids[scored], top_logits[scored], keep[scored]


def top_kl(
    draft_logits: torch.Tensor, top_ids: torch.Tensor, top_logits: torch.Tensor
) -> torch.Tensor:
    """Mean over positions of KL(p_top || q): p the teacher's top-k logits renormalised, q the
    draft's softmax (nats). Teacher entries with id -1 (outside a reduced vocabulary, see
    `kept_slots`) are dropped before renormalising; a position with none left is dropped before
    anything is computed on it (its p would be 0/0, and NaN reaches the gradient even through
    a `where` that discards it)."""
    draft_logits, top_ids, top_logits, keep = _scored(draft_logits, top_ids, top_logits)
    log_p = F.log_softmax(top_logits.float().masked_fill(~keep, float("-inf")), dim=-1)
    log_q = F.log_softmax(draft_logits, dim=-1).gather(-1, top_ids.clamp(min=0).long())
    # p = 0 at a dropped entry; its log p is set to 0 so that 0 * (log p - log q) stays 0
    return (log_p.exp() * (log_p.masked_fill(~keep, 0.0) - log_q)).sum(-1).mean()


def top_tv(
    draft_logits: torch.Tensor,
    top_ids: torch.Tensor,
    top_logits: torch.Tensor,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
) -> torch.Tensor:
    """Mean over positions of 1 - sum_v min(p(v), q(v)): one minus the acceptance of speculative
    sampling, with p the teacher's top-k and q the draft's distribution both warped as served
    (`temperature`, then the `top_p` nucleus, renormalised). q's nucleus is chosen without
    gradient (`top_p_filter`'s rule); its kept probabilities carry the gradient. Teacher ids -1
    and positions with none kept are dropped as in `top_kl`; q's mass at ids outside the
    teacher's top-k is never accepted (p is taken as 0 there)."""
    draft_logits, top_ids, top_logits, keep = _scored(draft_logits, top_ids, top_logits)
    one = torch.full((len(top_logits), 1, 1), top_p)
    teacher = torch.softmax(top_logits.float().masked_fill(~keep, float("-inf")) / temperature, -1)
    p = top_p_filter(teacher[:, None], one)[:, 0]
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    with torch.no_grad():
        nucleus = top_p_filter(q.detach()[:, None], one)[:, 0] > 0
    q = q * nucleus
    q = q / q.sum(-1, keepdim=True)
    q_top = q.gather(-1, top_ids.clamp(min=0).long()).masked_fill(~keep, 0.0)
    return 1.0 - torch.minimum(p, q_top).sum(-1).mean()


def kept_slots(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: each id's index among the kept `token_ids`, -1 for the rest."""
    slots = torch.full((vocab_size,), -1, dtype=torch.long)
    slots[token_ids] = torch.arange(len(token_ids))
    return slots


@dataclass(frozen=True)
class DraftTraining:
    """How long and how a draft trains: `minutes` of wall time in all (a resumed run counts what
    it already spent), the AdamW learning rate (`lr`, warm-up then cosine: lr_at), tokens per
    batch, minutes between checkpoints, and `tv_weight` > 0 adds `tv_weight * top_tv` to the KL
    (the acceptance at the served sampling setting, optimised directly)."""

    minutes: float
    seed: int = 0
    lr: float = 1e-3
    tokens_per_batch: int = 4096
    checkpoint_minutes: float = 4.0
    tv_weight: float = 0.0


def train_draft(
    target_dir: Path | str,
    work: Path | str,
    training: DraftTraining,
    shape: dict | None = None,
    vocab: DraftVocab | None = None,
    init_from: Path | str | None = None,
) -> Transformer:
    """Train (or resume) the draft as `training` says; returns it in eval mode.

    A new run takes `shape` (default `DEFAULT_SHAPE`) and `vocab` (None: the whole vocabulary);
    a resumed one keeps its checkpoint's, and refuses a different `vocab`. `init_from`: a new
    run starts from that draft directory's weights (a fine-tune; they must load into `shape`)."""
    minutes, seed, lr = training.minutes, training.seed, training.lr
    tokens_per_batch, tv_weight = training.tokens_per_batch, training.tv_weight
    checkpoint_minutes = training.checkpoint_minutes
    work = Path(work)
    path = work / CHECKPOINT
    target = load_model(target_dir, max_length=1024)
    kept = None if vocab is None else torch.tensor(vocab.token_ids)
    if path.is_file():
        state = torch.load(path, weights_only=False)
        draft = skeleton(target.config, state["shape"])
        draft.load_state_dict(state["model"])
        saved = state.get("kept_ids")
        if (saved is None) != (kept is None) or (kept is not None and not torch.equal(saved, kept)):
            raise ValueError(f"{path}: trained with another draft vocabulary than the one given")
    else:
        shape = dict(DEFAULT_SHAPE if shape is None else shape)
        state = {"elapsed": 0.0, "step": 0, "shape": shape, "seen": 0, "kept_ids": kept}
        draft = new_draft(target, shape, seed=seed)
        if init_from is not None:
            draft.load_state_dict(initial_weights(init_from, draft))
            state["init_from"] = str(init_from)
    slots = None if kept is None else kept_slots(kept, target.config.vocab_size)
    del target
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    heldout = load_chunks(work / "heldout")
    rng = random.Random(seed + state["step"])
    budget = minutes * 60.0
    bar = tqdm(total=int(budget), initial=int(state["elapsed"]), desc="draft (s)", file=sys.stderr,
               mininterval=10.0)  # fmt: skip
    last_save = time.perf_counter()
    draft.train()
    while state["elapsed"] < budget:
        sequences = load_chunks(work / "train")
        if not sequences:
            raise RuntimeError(f"no training chunks under {work / 'train'}")
        for batch in batches(sequences, tokens_per_batch, rng):
            tick = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(state["elapsed"] / budget, lr)
            logits, _ = answer_logits(draft, batch, kept)
            top_ids = torch.cat([s["top_ids"] for s in batch]).long()
            if slots is not None:
                top_ids = slots[top_ids]
            top_logits = torch.cat([s["top_logits"] for s in batch])
            loss = top_kl(logits, top_ids, top_logits)
            if tv_weight > 0:
                loss = loss + tv_weight * top_tv(logits, top_ids, top_logits)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            spent = time.perf_counter() - tick
            state["elapsed"] += spent
            state["step"] += 1
            state["seen"] += len(top_ids)
            bar.update(int(state["elapsed"]) - bar.n)
            bar.set_postfix(kl=f"{loss.item():.3f}", positions=state["seen"], refresh=False)
            done = state["elapsed"] >= budget
            if done or time.perf_counter() - last_save > checkpoint_minutes * 60:
                save_checkpoint(draft, optimizer, state, path, heldout, loss.item(), vocab)
                last_save = time.perf_counter()
                draft.train()
            if done:
                break
    bar.close()
    return draft.eval()


def initial_weights(draft_dir: Path | str, draft: Transformer) -> dict[str, torch.Tensor]:
    """The float32 weights of the draft in `draft_dir` (assembled), checked against `draft`'s
    shape: ValueError naming the first difference."""
    loaded = load_model(draft_dir, dtype=torch.float32).state_dict()
    want = draft.state_dict()
    for name, tensor in want.items():
        if name not in loaded or loaded[name].shape != tensor.shape:
            got = tuple(loaded[name].shape) if name in loaded else "nothing"
            raise ValueError(f"{draft_dir}: {name} is {got}, the draft's shape needs "
                             f"{tuple(tensor.shape)}")  # fmt: skip
    return {name: loaded[name] for name in want}


def save_checkpoint(
    draft: Transformer, optimizer: torch.optim.Optimizer, state: dict, path: Path, heldout: list,
    train_kl: float, vocab: DraftVocab | None = None,
) -> None:  # fmt: skip
    """Write the checkpoint (temporary name, then rename) and one held-out log line (the draft's
    q as served: over `vocab`'s kept ids when given)."""
    draft.eval()
    entry = {
        "step": state["step"],
        "elapsed_s": round(state["elapsed"], 1),
        "positions_seen": state["seen"],
        "train_kl": train_kl,
        **approx_acceptance(served_draft(draft, vocab), heldout),
    }
    with open(path.parent / LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")
    tqdm.write(f"checkpoint: {entry}", file=sys.stderr)
    partial = path.with_suffix(".partial")
    torch.save({**state, "model": draft.state_dict(), "optimizer": optimizer.state_dict()}, partial)
    os.replace(partial, path)
