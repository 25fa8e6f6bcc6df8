"""Evaluation of the pair: held-out bits/byte, distillation KL, acceptance by position, samples.

Acceptance at a draft position is the expected acceptance of speculative sampling,
sum_v min(p(v), q(v)) (Leviathan et al. 2023), with p and q warped exactly as the serving stages
warp them (`avspec.engine.sampling.warp_probs`). `report` gathers all three for the model card.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from avspec.engine.sampling import warp_probs
from avspec.runtime.tokenizer import ByteTokenizer, Tokenizer
from avspec.runtime.transformer import Transformer
from avspec.tools.train.tiny.corpus import encode_files, heldout_prompts

if TYPE_CHECKING:
    from avspec.runtime.hf_tokenizer import HFTokenizer

SAMPLE_PROMPTS = {"python": "def parse_args(argv):\n", "english": "The with statement is used to "}
SAMPLE_TOKENS = 48
# The example prompts of README.md and docs/serving.md, continued greedily (the byte-level pair
# continued "import os\n" with a run of spaces).
GREEDY_PROMPTS = ("def parse_args(argv):\n", "import os\n", "def ")
GREEDY_TOKENS = 32


def eval_windows(ids: torch.Tensor, seq: int, max_windows: int) -> torch.Tensor:
    """Evenly spaced non-overlapping windows [count, seq + 1] of ids [tokens]."""
    count = min(max_windows, (len(ids) - 1) // seq)
    stride = (len(ids) - 1) // count
    return torch.stack([ids[i * stride : i * stride + seq + 1] for i in range(count)])


@torch.no_grad()
def bits_per_byte(
    model: Transformer,
    ids: torch.Tensor,
    seq: int,
    max_windows: int = 256,
    byte_lengths: torch.Tensor | None = None,
) -> float:
    """Next-token loss in bits per byte over evenly spaced non-overlapping windows of ids
    [tokens]: the bits summed over the predicted tokens, divided by the UTF-8 bytes they spell
    (`byte_lengths` [vocab], `token_byte_lengths`; None: one byte per token)."""
    windows = eval_windows(ids, seq, max_windows)
    bits, num_bytes = 0.0, 0
    for chunk in windows.split(32):  # (rows, seq + 1)
        logits = model(chunk[:, :-1])
        predicted = chunk[:, 1:].flatten()
        bits += F.cross_entropy(logits.flatten(0, 1), predicted, reduction="sum").item()
        if byte_lengths is None:
            num_bytes += predicted.numel()
        else:
            num_bytes += int(byte_lengths[predicted].sum())
    return bits / num_bytes / math.log(2)


def token_byte_lengths(tokenizer: ByteTokenizer | HFTokenizer) -> torch.Tensor:
    """UTF-8 bytes each token id spells [vocab] int64: an end-of-text token counts one byte
    (as in the byte-level pair, where EOS is one symbol)."""
    if isinstance(tokenizer, ByteTokenizer):
        return torch.ones(tokenizer.vocab_size, dtype=torch.int64)
    lengths = []
    for i in range(tokenizer.vocab_size):
        if i in tokenizer.eos_ids:
            lengths.append(1)
            continue
        piece = tokenizer.token(i)
        # A byte-level BPE piece spells one byte per character (pre_tokenizers.ByteLevel).
        lengths.append(len(piece) if piece is not None else 0)
    return torch.tensor(lengths, dtype=torch.int64)


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_teacher || q_student) in nats, both at temperature 1.

    Logits: [..., vocab], equal shapes; the result is a scalar (differentiable in the student).
    """
    student = F.log_softmax(student_logits.flatten(0, -2).float(), dim=-1)
    teacher = F.log_softmax(teacher_logits.flatten(0, -2).float(), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


@torch.no_grad()
def held_out_kl(
    student: Transformer, teacher: Transformer, ids: torch.Tensor, seq: int, max_windows: int = 256
) -> float:
    """`distillation_kl` of student to teacher in nats per token over `eval_windows` of ids."""
    total, count = 0.0, 0
    for chunk in eval_windows(ids, seq, max_windows).split(32):  # (rows, seq + 1)
        inputs = chunk[:, :-1]
        total += distillation_kl(student(inputs), teacher(inputs)).item() * inputs.numel()
        count += inputs.numel()
    return total / count


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """`avspec.engine.sampling.warp_probs`, one setting for all rows.

    logits: [batch, (position,) vocab].
    """
    rows = logits if logits.dim() == 3 else logits[:, None]  # [batch, position, vocab]
    n = rows.shape[0]
    settings: dict[str, Any] = {"device": logits.device, "dtype": torch.float32}
    probs = warp_probs(
        rows.float(), torch.full((n,), temperature, **settings), torch.full((n,), top_p, **settings)
    )
    return probs if logits.dim() == 3 else probs[:, 0]


@torch.no_grad()
def acceptance_by_position(
    draft: Transformer,
    target: Transformer,
    prompts: torch.Tensor,
    num_positions: int = 8,
    temperature: float = 1.0,
    top_p: float = 0.95,
    generator: torch.Generator | None = None,
) -> list[float]:
    """Mean over prompts of sum_v min(p(v), q(v)) at each draft position.

    prompts: [batch, seq] int64 (equal-length prompts). The draft samples `num_positions` tokens
    autoregressively from its warped distribution q; the target's warped p is taken at the same
    contexts. Returns one mean per position (position 0 first).
    """
    context = prompts
    draft_probs = []
    for _ in range(num_positions):
        q = warp(draft(context)[:, -1], temperature, top_p)  # (batch, vocab)
        token = torch.multinomial(q, 1, generator=generator)  # (batch, 1)
        draft_probs.append(q)
        context = torch.cat([context, token], dim=1)
    target_logits = target(context[:, :-1])[:, prompts.shape[1] - 1 :]  # (batch, position, vocab)
    p = warp(target_logits, temperature, top_p)
    q = torch.stack(draft_probs, dim=1)  # (batch, position, vocab)
    return torch.minimum(p, q).sum(-1).mean(0).tolist()


@torch.no_grad()
def sample(
    model: Transformer,
    prompt: str,
    num_tokens: int,
    generator: torch.Generator | None,
    tokenizer: Tokenizer | None = None,
    temperature: float = 1.0,
) -> str:
    """Prompt plus up to `num_tokens` continuation tokens at `temperature` (0: greedy), top-p
    0.95 (full recompute); stops at an EOS. The tokenizer defaults to the byte tokenizer."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    ids = torch.tensor([tokenizer.encode(prompt)])
    for _ in range(num_tokens):
        probs = warp(model(ids[:, -model.config.max_length :])[:, -1], temperature, 0.95)
        token = torch.multinomial(probs, 1, generator=generator)
        if int(token) in tokenizer.eos_ids:
            break
        ids = torch.cat([ids, token], dim=1)
    return tokenizer.decode(ids[0].tolist())


def report(
    draft: Transformer,
    target: Transformer,
    held_out: Sequence[tuple[str, str]],
    seed: int,
    tokenizer: ByteTokenizer | HFTokenizer,
    prompt_tokens: int = 40,
) -> dict:
    """Held-out bits/byte, acceptance curves (code, prose; prompts of `prompt_tokens`), sampled
    and greedy continuations of both models."""
    held_out_ids = encode_files(held_out, tokenizer)
    lengths = token_byte_lengths(tokenizer)
    result: dict[str, Any] = {
        "held_out_bpb": {
            name: bits_per_byte(model, held_out_ids, 256, byte_lengths=lengths)
            for name, model in (("target", target), ("draft", draft))
        },
        "acceptance_by_position": {},
        "samples": {},
        "greedy": {},
    }
    for kind, prose in (("code", False), ("prose", True)):
        prompts = heldout_prompts(held_out, 200, prompt_tokens, prose, tokenizer)
        gen = torch.Generator().manual_seed(seed)
        result["acceptance_by_position"][kind] = acceptance_by_position(
            draft, target, prompts, generator=gen
        )
    for name, model in (("target", target), ("draft", draft)):
        gen = torch.Generator().manual_seed(seed)
        result["samples"][name] = {
            k: sample(model, p, SAMPLE_TOKENS, gen, tokenizer) for k, p in SAMPLE_PROMPTS.items()
        }
        result["greedy"][name] = {
            p: sample(model, p, GREEDY_TOKENS, None, tokenizer, temperature=0.0)
            for p in GREEDY_PROMPTS
        }
    return result
