"""Cost-table measurement (spec section 4): time the real stages, not a model of them.

- Verify cost: the target stage on `batch` decoding sequences, each with one pending token and
  n verified drafts (n = 0..K); size = total target tokens batch * (1 + n). On text the drafts
  are the text's next tokens with q one-hot on them, so each is accepted with probability p(x)
  (what the stage's CPU work past the blocks depends on: avspec.engine.target_stage).
- Draft pass cost: one draft forward (plus its sampling) as a function of the rows in it. The
  draft stage is timed on `rows` decoding sequences drafting 1 token (one pass) and drafting
  `passes` tokens (that many passes), interleaved repeat by repeat; a pass costs
  (t_passes - t_1) / (passes - 1) and the stage's own per-call cost is t_1 - pass (reported, not
  in the table: a step pays it once, whatever it drafts).

Every sequence first gets `context_length` prompt tokens (each batch of the ladder its own
sequences): slices of real text when `text` is given (token ids of the pair's tokenizer; the
verified drafts are then the text's next tokens, as accepted drafts mostly are), else random ids
below 256. What a stage costs depends on the text: its top-p nucleus is a few tokens long on real
text and thousands on random ids, and the warp's work grows with it (avspec.engine.sampling).
Each timed call then starts from the same cached context (the cache rule rolls back whatever the
previous call appended), so repeats are identical. The points are timed round-robin
(`interleaved_ms`: `warmup` untimed rounds, then `repeats` rounds each timing every point once),
so load from elsewhere spreads over all points instead of lifting the few it coincides with.
Each point keeps its samples; its cost is their median and its weight in the isotonic fit
(CostTable) the number of samples. CUDA is synchronised around each call.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from avspec.av.cost_table import CostTable
from avspec.contract import StepInputs
from avspec.engine.draft_stage import DraftStage
from avspec.engine.draft_vocab import DraftVocab
from avspec.engine.target_stage import TargetStage
from avspec.runtime.kv_cache import KVCache
from avspec.runtime.model_dir import load_tokenizer
from avspec.runtime.transformer import Transformer

OnPoint = Callable[[int, float], None]


@dataclass(frozen=True)
class LadderSettings:
    """How every point of a ladder is measured (see the module doc): `context_length` prompt
    tokens a sequence, cut from `text` (None: random ids below 256), `warmup` untimed rounds,
    then `repeats` timed ones."""

    context_length: int = 64
    repeats: int = 10
    warmup: int = 3
    text: torch.Tensor | None = None


DEFAULT_LADDER = LadderSettings()


@dataclass
class CostPoints:
    """Measured points: per size the median ms, the samples behind it, and the raw samples."""

    sizes: list[int]
    millis: list[float]  # medians
    repeats: list[int] | None = None  # samples behind each median (None: one each)
    samples: list[list[float]] | None = None  # the raw samples of each size
    extra: dict = field(default_factory=dict)  # per-shape details, plain data

    def table(self, name: str) -> CostTable:
        """The isotonic fit of the medians, each weighted by its number of samples."""
        return CostTable(self.sizes, self.millis, name=name, weights=self.repeats)

    def to_dict(self) -> dict[str, list]:
        """sizes and medians; with repeats and raw samples when measured (for `measured`)."""
        out: dict = {"sizes": list(self.sizes), "millis": list(self.millis)}
        if self.repeats is not None:
            out["repeats"] = list(self.repeats)
        if self.samples is not None:
            out["samples"] = [list(s) for s in self.samples]
        return out | self.extra

    @classmethod
    def from_samples(cls, samples: dict[int, list[float]], extra: dict | None = None) -> CostPoints:
        """Points from {size: raw samples}: median and count of each size, sizes sorted."""
        sizes = sorted(samples)
        return cls(
            sizes,
            [statistics.median(samples[s]) for s in sizes],
            [len(samples[s]) for s in sizes],
            [list(samples[s]) for s in sizes],
            dict(extra or {}),
        )


def profile_verify_cost(
    model: Transformer,
    max_draft_tokens: int,
    batch_sizes: Sequence[int],
    settings: LadderSettings = DEFAULT_LADDER,
    on_point: OnPoint | None = None,
) -> CostPoints:
    """Target-stage ms at sizes batch * (1 + n) for each batch and n = 0..K (`settings`: the
    context, its text and the rounds, see the module doc).

    A size reached by several (batch, n) pairs pools their samples (median of all, weight = all
    of them); extra["shapes"] lists each pair's median. on_point(size, median ms) per pair.
    """
    _check_ladder(batch_sizes, settings)
    context_length, text = settings.context_length, settings.text
    batches = sorted(set(batch_sizes))
    stage = TargetStage(model, _cache(model, sum(batches), context_length, max_draft_tokens),
                        max_draft_tokens, check_values=False)  # fmt: skip
    device, vocab = stage.device, model.vocab_size
    gen = torch.Generator().manual_seed(0)
    calls: list[tuple[Callable[[], object]]] = []
    shapes: list[dict[str, Any]] = []
    for batch, first in zip(batches, _first_ids(batches), strict=True):
        tokens = _sequences(text, batch, context_length + 1 + max_draft_tokens, first, gen)
        _prefill(stage, tokens[:, :context_length], max_draft_tokens, first)
        inputs = _decode_inputs(tokens[:, context_length : context_length + 1], context_length,
                                max_draft_tokens, first)  # fmt: skip
        if text is None:
            drafts = torch.randint(0, vocab, (batch, max_draft_tokens), generator=gen)
        else:
            drafts = tokens[:, context_length + 1 :]
        drafts = drafts.to(device)
        probs = _draft_probs(drafts, vocab, text is not None)
        for n in range(max_draft_tokens + 1):
            verify = torch.full((batch,), n, dtype=torch.int32, device=device)
            calls.append((partial(stage, inputs, drafts, probs, verify),))
            shapes.append({"batch": batch, "drafts": n, "size": batch * (1 + n)})

    def done(index: int, times: list[list[float]]) -> None:
        shapes[index]["median_ms"] = statistics.median(times[0])
        if on_point is not None:
            on_point(shapes[index]["size"], shapes[index]["median_ms"])

    timed = interleaved_ms(calls, settings.repeats, settings.warmup, device, on_done=done)
    samples = [times for (times,) in timed]
    return verify_points(shapes, samples, per_row_ms=0.0)


def _draft_probs(drafts: torch.Tensor, vocab: int, one_hot: bool) -> torch.Tensor:
    """The q the target ladder verifies: one-hot at each draft on text (a draft is accepted with
    probability p(x), the rate the target gives the text itself: on the CPU the stage's output layer
    and warp run only where the scan of the accept tests reaches), uniform on random ids."""
    if one_hot:
        shape = (*drafts.shape, vocab)
        return torch.zeros(shape, device=drafts.device).scatter_(-1, drafts[..., None].long(), 1.0)
    return torch.full((*drafts.shape, vocab), 1.0 / vocab, device=drafts.device)


def verify_points(
    shapes: Sequence[dict], samples: Sequence[Sequence[float]], per_row_ms: float
) -> CostPoints:
    """The verify table's points by tokens, net of `per_row_ms` * batch of each shape.

    shapes[i] ("batch", "size", ...) and samples[i] (its timed ms) as profile_verify_cost
    records them; a size reached by several shapes pools their samples. extra keeps the shapes
    and the samples, so the table can be rebuilt net of a fitted per-row cost.
    """
    measured: dict[int, list[float]] = {}
    for shape, times in zip(shapes, samples, strict=True):
        # a sample faster than the fitted row cost (noise, or a fit the shapes pull past one
        # shape's own time) nets to 0, not below: a cost table is never negative
        net = [max(t - per_row_ms * shape["batch"], 0.0) for t in times]
        measured.setdefault(shape["size"], []).extend(net)
    extra = {"shapes": list(shapes), "samples": [list(t) for t in samples]}
    return CostPoints.from_samples(measured, extra)


def profile_draft_pass(
    model: Transformer,
    rows: Sequence[int],
    passes: int = 8,
    settings: LadderSettings = DEFAULT_LADDER,
    on_point: OnPoint | None = None,
    top_k: int = 0,
    draft_vocab: DraftVocab | None = None,
) -> CostPoints:
    """ms of one draft pass by the rows in it (the draft stage's `top_k` and `draft_vocab`;
    `settings`: the context, its text and the rounds, see the module doc).

    Per rows count, `repeats` pairs (one-pass call, `passes`-pass call) give `repeats` samples
    (t_passes - t_1) / (passes - 1). extra: "one_pass_ms" and "all_passes_ms" (the medians of
    the two calls, by rows), "stage_fixed_ms" (median t_1 - pass), "passes". on_point(rows,
    median pass ms) per rows count.
    """
    _check_ladder(rows, settings)
    context_length, text = settings.context_length, settings.text
    if passes < 2:
        raise ValueError(f"passes must be >= 2 (a pass is timed as a difference), got {passes}")
    ladder = sorted(set(rows))
    stage = DraftStage(model, _cache(model, sum(ladder), context_length, passes), passes,
                       check_values=False, top_k=top_k, draft_vocab=draft_vocab)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    calls = []
    for batch, first in zip(ladder, _first_ids(ladder), strict=True):
        tokens = _sequences(text, batch, context_length + 1, first, gen)
        _prefill(stage, tokens[:, :context_length], passes, first)
        inputs = _decode_inputs(tokens[:, context_length:], context_length, passes, first)
        short = replace(inputs, num_draft_tokens=torch.ones_like(inputs.num_draft_tokens))
        calls.append((partial(stage, short), partial(stage, inputs)))

    def pass_samples(pair: list[list[float]]) -> list[float]:
        return [(b - a) / (passes - 1) for a, b in zip(pair[0], pair[1], strict=True)]

    def done(index: int, pair: list[list[float]]) -> None:
        if on_point is not None:
            on_point(ladder[index], statistics.median(pass_samples(pair)))

    timed = interleaved_ms(calls, settings.repeats, settings.warmup, stage.device, on_done=done)
    measured = {batch: pass_samples(pair) for batch, pair in zip(ladder, timed, strict=True)}
    one_pass = [statistics.median(pair[0]) for pair in timed]
    all_passes = [statistics.median(pair[1]) for pair in timed]
    fixed = [t - statistics.median(measured[b]) for t, b in zip(one_pass, ladder, strict=True)]
    extra = {"passes": passes, "one_pass_ms": one_pass, "all_passes_ms": all_passes,
             "stage_fixed_ms": fixed}  # fmt: skip
    points = CostPoints.from_samples(measured, extra)
    # A difference of two noisy times can dip below 0 for a tiny model: a pass is never free.
    points.millis = [max(m, 0.0) for m in points.millis]
    return points


def interleaved_ms(
    calls: Sequence[tuple[Callable[[], object], ...]],
    repeats: int,
    warmup: int,
    device: torch.device | str,
    on_done: Callable[[int, list[list[float]]], None] | None = None,
) -> list[list[list[float]]]:
    """Samples of every call of every point, round-robin: a round times each point once (its
    calls back to back), so a burst of load from elsewhere lands on all points alike instead
    of on the few measured during it. `warmup` untimed rounds first. Returns, per point, per
    call, `repeats` ms; on_done(point index, its samples) after the last round, in order."""
    for _ in range(warmup):
        for group in calls:
            for call in group:
                call()
    timed: list[list[list[float]]] = [[[] for _ in group] for group in calls]
    for _ in range(repeats):
        for group, samples in zip(calls, timed, strict=True):
            for call, out in zip(group, samples, strict=True):
                out.append(_time_ms(call, device))
    if on_done is not None:
        for index, samples in enumerate(timed):
            on_done(index, samples)
    return timed


def _first_ids(batches: Sequence[int]) -> list[int]:
    """First sequence id of each batch: disjoint ranges 1.., so every batch keeps its cache."""
    firsts, next_id = [], 1
    for batch in batches:
        firsts.append(next_id)
        next_id += batch
    return firsts


def fit_tokens_and_rows(shapes: Sequence[dict]) -> dict[str, float]:
    """Least squares ms ~ fixed + per_token * size + per_row * batch over `shapes` (dicts with
    "batch", "size", "median_ms", as profile_verify_cost's extra["shapes"]).

    A diagnostic of how much the target's cost depends on rows besides tokens (per-row sampling
    and attention over each row's cached context), which a table by tokens alone cannot hold.
    "max_rel_error_tokens_only" / "max_rel_error_with_rows": the largest relative error over the
    shapes of the fit without and with the rows term. Needs 3 shapes with distinct
    (size, batch); otherwise per_row_ms is 0 and the fit is by tokens alone.
    """
    ms = torch.tensor([float(s["median_ms"]) for s in shapes], dtype=torch.float64)
    size = torch.tensor([float(s["size"]) for s in shapes], dtype=torch.float64)
    rows = torch.tensor([float(s["batch"]) for s in shapes], dtype=torch.float64)
    ones = torch.ones_like(ms)
    tokens_only = torch.stack([ones, size], 1)
    with_rows = torch.stack([ones, size, rows], 1)
    out: dict[str, float] = {}
    coef_t = torch.linalg.lstsq(tokens_only, ms[:, None], driver="gelsd").solution[:, 0]
    distinct = len({(float(a), float(b)) for a, b in zip(size, rows, strict=True)})
    if distinct >= 3 and torch.linalg.matrix_rank(with_rows) == 3:
        coef = torch.linalg.lstsq(with_rows, ms[:, None], driver="gelsd").solution[:, 0]
    else:
        coef = torch.cat([coef_t, torch.zeros(1, dtype=torch.float64)])
    out["fixed_ms"], out["per_token_ms"], out["per_row_ms"] = (float(c) for c in coef)
    for name, pred in (("tokens_only", tokens_only @ coef_t), ("with_rows", with_rows @ coef)):
        out[f"max_rel_error_{name}"] = float(((pred - ms).abs() / ms).max())
    return out


def _check_ladder(batch_sizes: Sequence[int], settings: LadderSettings) -> None:
    context_length, repeats, warmup = settings.context_length, settings.repeats, settings.warmup
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be a non-empty list of sizes >= 1, got {batch_sizes}")
    if context_length < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need context_length >= 1, repeats >= 1, warmup >= 0; got {context_length}, "
            f"{repeats}, {warmup}"
        )


# The sampling settings the stages are timed with: the serving sweep's (client/bench_serving.py).
# top-p < 1 matters: the nucleus costs a CPU pass a third of its time over a 4,096-piece
# vocabulary, and top-p 1 skips it, so tables timed at 1 under-priced served draft passes 2-3x.
PROFILE_TEMPERATURE = 1.0
PROFILE_TOP_P = 0.95


def _cache(model: Transformer, sequences: int, context: int, k: int) -> KVCache:
    return model.new_cache(sequences, context + k + 2)


def step_inputs(
    seq_tokens: torch.Tensor,
    start: int,
    k: int,
    first: int = 1,
    temperature: float = PROFILE_TEMPERATURE,
    top_p: float = PROFILE_TOP_P,
) -> StepInputs:
    """StepInputs for sequences first..first+batch-1, all with input_ids seq_tokens [batch, seq]
    after `start` cached tokens, K = k, AV off, one temperature and top-p for every row."""
    batch, length = seq_tokens.shape

    def fill(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((batch,), value, dtype=dtype)

    return StepInputs(
        seq_ids=torch.arange(first, first + batch, dtype=torch.int64),
        input_ids=seq_tokens.int(),
        input_lengths=fill(length, torch.int32),
        start_positions=fill(start, torch.int32),
        reusable=fill(0, torch.int32),
        num_draft_tokens=fill(k, torch.int32),
        adaptive=fill(False, torch.bool),
        temperature=fill(temperature, torch.float32),
        top_p=fill(top_p, torch.float32),
        random_seed=torch.arange(batch, dtype=torch.int64),
        prev_num_accepted=torch.zeros(0, dtype=torch.int32),
        release_seq_ids=torch.zeros(0, dtype=torch.int64),
    )


WORKLOAD_FILES = ("workloads/chat.jsonl", "workloads/code.jsonl")  # the text the tables time


def workload_text(
    model_dir: Path | str, files: Sequence[Path | str] = WORKLOAD_FILES
) -> torch.Tensor:
    """Token ids [n] int64 of the prompts of `files` (JSON lines with a "prompt"), one after
    the other, tokenized by the tokenizer of `model_dir`: real text for `text`."""
    tokenizer = load_tokenizer(model_dir)
    ids: list[int] = []
    for name in files:
        for line in Path(name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                ids.extend(tokenizer.encode(json.loads(line)["prompt"]))
    if not ids:
        raise ValueError(f"no prompts in {', '.join(map(str, files))}")
    return torch.tensor(ids, dtype=torch.int64)


def _sequences(
    text: torch.Tensor | None, batch: int, length: int, first: int, gen: torch.Generator
) -> torch.Tensor:
    """[batch, length] token ids for sequences first..first+batch-1: slices of `text` [n]
    (sequence i from offset (i * 131) mod (n - length), so batches see different slices), or
    random ids below 256 without text."""
    if text is None:
        return torch.randint(0, 256, (batch, length), generator=gen)
    room = len(text) - length
    if room <= 0:
        raise ValueError(f"text has {len(text)} tokens, a sequence needs more than {length}")
    starts = [(seq_id * 131) % room for seq_id in range(first, first + batch)]
    return torch.stack([text[s : s + length] for s in starts]).long()


def _prefill(stage: DraftStage | TargetStage, tokens: torch.Tensor, k: int, first: int) -> None:
    """Give sequences first..first+batch-1 the cached tokens [batch, context] (the target
    verifies none)."""
    batch = tokens.shape[0]
    inputs = step_inputs(tokens, 0, k, first)
    if isinstance(stage, DraftStage):
        stage(inputs)
        return
    vocab, device = stage.model.vocab_size, stage.device
    drafts = torch.zeros(batch, k, dtype=torch.int32, device=device)
    probs = torch.full((batch, k, vocab), 1.0 / vocab, device=device)
    stage(inputs, drafts, probs, torch.zeros(batch, dtype=torch.int32, device=device))


def _decode_inputs(tokens: torch.Tensor, context: int, k: int, first: int) -> StepInputs:
    """One pending token per sequence (tokens [batch, 1]) after `context` cached ones."""
    return step_inputs(tokens, context, k, first)


def sample_ms(
    call: Callable[[], object], repeats: int, warmup: int, device: torch.device | str
) -> list[float]:
    """Wall milliseconds of `repeats` calls of `call` after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    return [_time_ms(call, device) for _ in range(repeats)]


def median_ms(
    call: Callable[[], object], repeats: int, warmup: int, device: torch.device | str
) -> float:
    """Median wall milliseconds of `call` after `warmup` untimed calls (CUDA synchronised)."""
    return statistics.median(sample_ms(call, repeats, warmup, device))


def _time_ms(call: Callable[[], object], device: torch.device | str) -> float:
    synchronize(device)
    begin = time.perf_counter()
    call()
    synchronize(device)
    return (time.perf_counter() - begin) * 1000.0


def synchronize(device: torch.device | str) -> None:
    """Wait for queued CUDA work on `device`; a no-op elsewhere."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
