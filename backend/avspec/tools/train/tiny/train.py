"""The training loop of one model: AdamW, linear warmup then cosine decay, random windows.

The default pair's shapes are TARGET_CONFIG and DRAFT_CONFIG. A run is fixed by its
`TrainSettings` and seed (never wall time): the seed initialises the weights and seed + 1 draws
the training windows. Every 250 steps, and at the last, the held-out bits/byte is logged (bits
over the UTF-8 bytes the predicted tokens spell, so byte and BPE models compare).

Distillation: given a `teacher` (the target), `train_model` trains on the teacher's
distribution, the practice for speculative drafters: the loss is
`distill_weight` x KL(p_teacher || q_model) at temperature 1 over the vocabulary (nats per
token, `evaluate.distillation_kl`) plus (1 - `distill_weight`) x the text's cross-entropy. The
teacher's logits are computed on the fly on the same windows, in eval mode with no gradient;
the windows drawn are the same as without a teacher, so the two runs differ only in the loss.
The log then also holds the training and held-out KL.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.train.tiny.evaluate import bits_per_byte, distillation_kl, held_out_kl

VOCAB_SIZE = 4096  # the byte-level BPE of `avspec.tools.train.tiny.bpe`
MAX_LENGTH = 512  # max_position_embeddings: the entry's default max_context
_LLAMA: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "max_length": MAX_LENGTH,
    "mlp": "swiglu",
    "norm_eps": 1e-5,
}
# Standard LlamaForCausalLM shapes (SwiGLU, RMSNorm, RoPE, tied embeddings, grouped-query
# attention with one key/value head). The target is sized for a verify cost per token several
# times the draft's per row (docs/benchmarks.md has the measured ratio).
TARGET_CONFIG = TransformerConfig(
    num_layers=6, width=320, num_heads=5, num_kv_heads=1, intermediate_size=864, **_LLAMA
)
DRAFT_CONFIG = TransformerConfig(
    num_layers=1, width=64, num_heads=2, num_kv_heads=1, intermediate_size=172, **_LLAMA
)


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings of one model; `steps` fixes the run (never wall time)."""

    steps: int
    batch: int = 16
    seq: int = 256
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    distill_weight: float = 1.0  # with a teacher: the KL's share of the loss, the text's 1 - it

    def __post_init__(self) -> None:
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}")


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup then cosine decay to 10 % of the peak."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def training_loss(
    model: Transformer, window: torch.Tensor, teacher: Transformer | None, distill_weight: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss on window [batch, seq + 1] (inputs the first seq, targets the last seq) and its
    parts for the log: `text` (cross-entropy, nats) and, with a teacher, `kl` (nats)."""
    logits = model(window[:, :-1])  # (batch, seq, vocab)
    text = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
    if teacher is None:
        return text, {"text": text.item()}
    with torch.no_grad():
        teacher_logits = teacher(window[:, :-1])
    kl = distillation_kl(logits, teacher_logits)
    loss = distill_weight * kl + (1.0 - distill_weight) * text
    return loss, {"text": text.item(), "kl": kl.item()}


def check_teacher(config: TransformerConfig, teacher: Transformer | None) -> None:
    """A teacher must score the same vocabulary; it is put in eval mode without gradients."""
    if teacher is None:
        return
    if teacher.config.vocab_size != config.vocab_size:
        raise ValueError(
            f"teacher vocab_size {teacher.config.vocab_size} != model vocab_size "
            f"{config.vocab_size}"
        )
    teacher.eval().requires_grad_(False)


def train_model(
    config: TransformerConfig,
    settings: TrainSettings,
    train_ids: torch.Tensor,
    eval_ids: torch.Tensor,
    seed: int,
    label: str,
    teacher: Transformer | None = None,
    byte_lengths: torch.Tensor | None = None,
) -> tuple[Transformer, list[dict]]:
    """Train from scratch on random windows of `train_ids` [tokens]; return model and log.

    With `teacher`, distil from it (see the module docstring). `byte_lengths` [vocab]: UTF-8
    bytes per token id, for the held-out bits/byte (None: one byte per token).
    """
    check_teacher(config, teacher)
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
        loss, parts = training_loss(model, window, teacher, settings.distill_weight)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(bits_per_token=f"{parts['text'] / math.log(2):.3f}", refresh=False)
        if (step + 1) % 250 == 0 or step + 1 == settings.steps:
            log.append(
                log_entry(model, step + 1, parts, eval_ids, settings.seq, teacher, byte_lengths)
            )
            tqdm.write(
                f"{label} step {step + 1}: held-out {log[-1]['held_out_bpb']:.3f} bits/byte",
                file=sys.stderr,
            )
    return model.eval(), log


def log_entry(
    model: Transformer,
    step: int,
    parts: dict[str, float],
    eval_ids: torch.Tensor,
    seq: int,
    teacher: Transformer | None,
    byte_lengths: torch.Tensor | None = None,
) -> dict:
    """One log line: training bits/token, held-out bits/byte, and with a teacher the KL to it
    (nats per token)."""
    entry = {
        "step": step,
        "train_bits_per_token": parts["text"] / math.log(2),
        "held_out_bpb": bits_per_byte(model, eval_ids, seq, 32, byte_lengths),
    }
    if teacher is not None:
        entry["train_kl"] = parts["kl"]
        entry["held_out_kl"] = held_out_kl(model, teacher, eval_ids, seq, max_windows=32)
    return entry
