"""Cost-table measurement (spec section 4): time the real stages, not a model of them.

- Verify cost: the target stage on `batch` decoding sequences, each with one pending token and
  n verified drafts (n = 0..K); size = total target tokens batch * (1 + n).
- Draft cost: the draft stage drafting K tokens (one pending pass + K - 1 decode passes) for a
  ladder of batch sizes; size = batch size.

Every sequence first gets `context_length` prompt tokens; each timed call then starts from the
same cached context (the cache rule rolls back whatever the previous call appended), so repeats
are identical. The median of `repeats` timed calls after `warmup` untimed ones is reported;
CUDA is synchronised around each call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from avspec.av.cost_table import CostTable
from avspec.contract import StepInputs
from avspec.engine.draft_stage import DraftStage
from avspec.engine.target_stage import TargetStage
from avspec.runtime.kv_cache import KVCache
from avspec.runtime.transformer import Transformer

OnPoint = Callable[[int, float], None]


@dataclass
class CostPoints:
    """Measured (size, median ms) points, ready for CostTable."""

    sizes: list[int]
    millis: list[float]

    def table(self, name: str) -> CostTable:
        return CostTable(self.sizes, self.millis, name=name)

    def to_dict(self) -> dict[str, list]:
        return {"sizes": list(self.sizes), "millis": list(self.millis)}


def profile_verify_cost(
    model: Transformer,
    max_draft_tokens: int,
    batch_sizes: Sequence[int],
    context_length: int = 64,
    repeats: int = 10,
    warmup: int = 3,
    on_point: OnPoint | None = None,
) -> CostPoints:
    """Median target-stage ms at sizes batch * (1 + n) for each batch and n = 0..K.

    A size reached by several (batch, n) pairs keeps the median of their medians.
    """
    _check_ladder(batch_sizes, context_length, repeats, warmup)
    stage = TargetStage(model, _cache(model, max(batch_sizes), context_length, max_draft_tokens),
                        max_draft_tokens, check_values=False)  # fmt: skip
    device, vocab = stage.device, model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    measured: dict[int, list[float]] = {}
    for batch in batch_sizes:
        _prefill(stage, batch, context_length, max_draft_tokens, gen)
        inputs = _decode_inputs(batch, context_length, max_draft_tokens, gen)
        drafts = torch.randint(0, vocab, (batch, max_draft_tokens), generator=gen).to(device)
        probs = torch.full((batch, max_draft_tokens, vocab), 1.0 / vocab, device=device)
        for n in range(max_draft_tokens + 1):
            verify = torch.full((batch,), n, dtype=torch.int32, device=device)
            ms = median_ms(partial(stage, inputs, drafts, probs, verify), repeats, warmup, device)
            size = batch * (1 + n)
            measured.setdefault(size, []).append(ms)
            if on_point is not None:
                on_point(size, ms)
        stage.slots.release(list(range(1, batch + 1)))
    sizes = sorted(measured)
    return CostPoints(sizes, [statistics.median(measured[s]) for s in sizes])


def profile_draft_cost(
    model: Transformer,
    max_draft_tokens: int,
    batch_sizes: Sequence[int],
    context_length: int = 64,
    repeats: int = 10,
    warmup: int = 3,
    on_point: OnPoint | None = None,
) -> CostPoints:
    """Median draft-stage ms (K drafts per sequence) at each batch size."""
    _check_ladder(batch_sizes, context_length, repeats, warmup)
    stage = DraftStage(model, _cache(model, max(batch_sizes), context_length, max_draft_tokens),
                       max_draft_tokens, check_values=False)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    millis = []
    for batch in sorted(set(batch_sizes)):
        _prefill(stage, batch, context_length, max_draft_tokens, gen)
        inputs = _decode_inputs(batch, context_length, max_draft_tokens, gen)
        ms = median_ms(partial(stage, inputs), repeats, warmup, stage.device)
        millis.append(ms)
        if on_point is not None:
            on_point(batch, ms)
        stage.slots.release(list(range(1, batch + 1)))
    return CostPoints(sorted(set(batch_sizes)), millis)


def _check_ladder(batch_sizes: Sequence[int], context_length: int, repeats: int, warmup: int):
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be a non-empty list of sizes >= 1, got {batch_sizes}")
    if context_length < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need context_length >= 1, repeats >= 1, warmup >= 0; got {context_length}, "
            f"{repeats}, {warmup}"
        )


def _cache(model: Transformer, sequences: int, context: int, k: int) -> KVCache:
    return model.new_cache(sequences, context + k + 2)


def _inputs(seq_tokens: torch.Tensor, start: int, k: int) -> StepInputs:
    """StepInputs for sequences 1..batch, all with input_ids seq_tokens [batch, seq]."""
    batch, length = seq_tokens.shape

    def fill(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((batch,), value, dtype=dtype)

    return StepInputs(
        seq_ids=torch.arange(1, batch + 1, dtype=torch.int64),
        input_ids=seq_tokens.int(),
        input_lengths=fill(length, torch.int32),
        start_positions=fill(start, torch.int32),
        reusable=fill(0, torch.int32),
        num_draft_tokens=fill(k, torch.int32),
        adaptive=fill(False, torch.bool),
        temperature=fill(1.0, torch.float32),
        top_p=fill(1.0, torch.float32),
        random_seed=torch.arange(batch, dtype=torch.int64),
        prev_num_accepted=torch.zeros(0, dtype=torch.int32),
        release_seq_ids=torch.zeros(0, dtype=torch.int64),
    )


def _prefill(stage: DraftStage | TargetStage, batch: int, context: int, k: int, gen) -> None:
    """Give sequences 1..batch `context` cached tokens (the target verifies nothing)."""
    inputs = _inputs(torch.randint(0, 256, (batch, context), generator=gen), 0, k)
    if isinstance(stage, DraftStage):
        stage(inputs)
        return
    vocab, device = stage.model.config.vocab_size, stage.device
    drafts = torch.zeros(batch, k, dtype=torch.int32, device=device)
    probs = torch.full((batch, k, vocab), 1.0 / vocab, device=device)
    stage(inputs, drafts, probs, torch.zeros(batch, dtype=torch.int32, device=device))


def _decode_inputs(batch: int, context: int, k: int, gen: torch.Generator) -> StepInputs:
    return _inputs(torch.randint(0, 256, (batch, 1), generator=gen), context, k)


def median_ms(
    call: Callable[[], object], repeats: int, warmup: int, device: torch.device | str
) -> float:
    """Median wall milliseconds of `call` after `warmup` untimed calls (CUDA synchronised)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        synchronize(device)
        begin = time.perf_counter()
        call()
        synchronize(device)
        times.append((time.perf_counter() - begin) * 1000.0)
    return statistics.median(times)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued CUDA work on `device`; a no-op elsewhere."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
