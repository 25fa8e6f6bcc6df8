"""The training loop of one model: AdamW, linear warmup then cosine decay, random windows.

The default pair's shapes are TARGET_CONFIG and DRAFT_CONFIG. A run is fixed by its
`TrainSettings` and seed (never wall time): the seed initialises the weights and seed + 1 draws
the training windows. Every 250 steps, and at the last, the held-out bits/byte is logged.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.training.evaluate import bits_per_byte

TARGET_CONFIG = TransformerConfig(num_layers=4, width=256, num_heads=4)
DRAFT_CONFIG = TransformerConfig(num_layers=1, width=96, num_heads=2)


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings of one model; `steps` fixes the run (never wall time)."""

    steps: int
    batch: int = 16
    seq: int = 256
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup then cosine decay to 10 % of the peak."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def train_model(
    config: TransformerConfig,
    settings: TrainSettings,
    train_ids: torch.Tensor,
    eval_ids: torch.Tensor,
    seed: int,
    label: str,
) -> tuple[Transformer, list[dict]]:
    """Train from scratch on random windows of `train_ids` [tokens]; return model and log."""
    init_gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    model = Transformer(config)
    init_weights(model, init_gen)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    log = []
    bar = tqdm(range(settings.steps), desc=label, mininterval=10.0, file=sys.stderr)
    for step in bar:
        starts = torch.randint(
            0, len(train_ids) - settings.seq - 1, (settings.batch,), generator=data_gen
        )
        window = torch.stack([train_ids[s : s + settings.seq + 1] for s in starts.tolist()])
        # window: (batch, seq + 1); inputs are the first seq, targets the last seq
        logits = model(window[:, :-1])  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(bits_per_byte=f"{loss.item() / math.log(2):.3f}", refresh=False)
        if (step + 1) % 250 == 0 or step + 1 == settings.steps:
            held_out = bits_per_byte(model, eval_ids, settings.seq, max_windows=32)
            log.append(
                {"step": step + 1, "train_bpb": loss.item() / math.log(2), "held_out_bpb": held_out}
            )
            tqdm.write(
                f"{label} step {step + 1}: held-out {held_out:.3f} bits/byte", file=sys.stderr
            )
    return model.eval(), log
