"""Per-sequence state both stages keep: a KV cache slot, a torch.Generator, a last-seen time.

`SequenceSlots` applies the cache rule of the step contract (docs/architecture.md): release the
step's `release_seq_ids`, free sequences idle past `idle_timeout_s`, then for each sequence keep
`min(cached_length, start + reusable)` cached positions (allocating new ones) and report which
`input_ids` still have to run through the model.

A stage may defer a sequence's inputs (`defer`): they are held, not run, and count as cached for
the cache rule, so the next `prepare` asks only for what came after them; `take_deferred` hands
them back to run in front of that step's inputs. The draft stage defers a step in which no row
drafts (avspec.engine.draft_stage), so that step costs it nothing.

Generators are seeded from `random_seed ^ salt` whenever a sequence takes its first step
(start == 0), so a replayed first step draws the same numbers and each stage (draft, target) owns
a separate stream. A sequence's draws never depend on which other sequences share its batch.

`ModelStage` is the state both stage classes build the same way (model, K, slots, and the
optional `vocab_limit`: a model whose embedding has rows past its tokenizer's tokens, e.g.
Qwen's padded vocabularies, gets the logits of those ids set to -inf before warping, so they
are never drafted or sampled; `avspec.runtime.pair.PairInfo.num_tokens` gives the limit). With a
limit, the vocabulary dimension of the step contract (`draft_probs`, the p the target verifies
against) is `vocab_limit` wide, not the model's row count, so a draft and a target with different
numbers of padded rows still pair; `vocab_width` is that width.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, TypeAlias, cast

import torch

from avspec.contract import HostStep
from avspec.runtime.kv_cache import KVCache
from avspec.runtime.transformer import Transformer

if TYPE_CHECKING:  # llama.cpp's engine needs the `gguf` package: not imported where unused (GPU)
    from avspec.runtime.llamacpp.model import GGUFModel
    from avspec.runtime.llamacpp.sequences import SequencePool

# What a stage runs: the torch runtime's model and cache, or llama.cpp's (avspec.runtime.llamacpp)
StageModel: TypeAlias = "Transformer | GGUFModel"
StageCache: TypeAlias = "KVCache | SequencePool"

DRAFT_SALT = 0
TARGET_SALT = 0x5DEECE66D_2545F491
_SEED_MASK = (1 << 63) - 1


class SequenceSlots:
    """KV cache slots, generators and idle sweep for the sequences one stage has seen."""

    def __init__(
        self,
        cache: StageCache,
        device: torch.device | str,
        salt: int,
        idle_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive or None, got {idle_timeout_s}")
        self.cache = cache
        self.device = torch.device(device)
        self.salt = salt
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._generators: dict[int, torch.Generator] = {}
        self._last_seen: dict[int, float] = {}
        self._deferred: dict[int, list[int]] = {}  # input ids held, not yet run

    def release(self, seq_ids: Sequence[int]) -> None:
        """Free the cache slot and generator of each id; unknown ids are ignored."""
        for seq_id in seq_ids:
            if self.cache.has(seq_id):
                self.cache.free(seq_id)
            self._generators.pop(seq_id, None)
            self._last_seen.pop(seq_id, None)
            self._deferred.pop(seq_id, None)

    def sweep_idle(self, keep: Collection[int] = ()) -> list[int]:
        """Free sequences not seen for `idle_timeout_s`, except `keep`; return their ids."""
        if self.idle_timeout_s is None:
            return []
        now = self.clock()
        stale = [
            s for s, t in self._last_seen.items() if now - t > self.idle_timeout_s and s not in keep
        ]
        self.release(stale)
        return stale

    def prepare(self, step: HostStep) -> list[int]:
        """Apply the cache rule to every sequence; return the offset of its first input to run.

        Row r must then run input_ids[r, offset[r]:input_lengths[r]] through the model.
        Raises ValueError for a continuing sequence (start > 0) this stage does not hold, e.g.
        one released or freed by the idle sweep.
        """
        self.admit(step)
        offsets = []
        for seq_id, start, reusable in zip(
            step.seq_ids, step.start_positions, step.reusable, strict=True
        ):
            keep = min(self.held(seq_id), start + reusable)
            if keep < start:
                raise ValueError(
                    f"sequence {seq_id}: cache holds {keep} positions, fewer than start {start}"
                )
            self._keep(seq_id, keep)
            offsets.append(keep - start)
        return offsets

    def held(self, seq_id: int) -> int:
        """Positions the sequence holds here: its cache and its deferred inputs."""
        return self.cache.length(seq_id) + len(self._deferred.get(seq_id, ()))

    def defer(self, seq_id: int, tokens: torch.Tensor) -> None:
        """Hold `tokens` [n] (the inputs `prepare` asked to run) instead of running them."""
        if tokens.numel():
            self._deferred.setdefault(seq_id, []).extend(tokens.reshape(-1).tolist())

    def take_deferred(self, seq_id: int) -> torch.Tensor | None:
        """The sequence's deferred inputs [n] int32 in order (None: none), no longer held."""
        held = self._deferred.pop(seq_id, None)
        return torch.tensor(held, dtype=torch.int32) if held else None

    def _keep(self, seq_id: int, keep: int) -> None:
        """Hold the first `keep` positions: roll the cache back, or trim the deferred inputs."""
        cached = self.cache.length(seq_id)
        if keep <= cached:
            self._deferred.pop(seq_id, None)
            self.cache.rollback(seq_id, keep)
        elif seq_id in self._deferred:
            del self._deferred[seq_id][keep - cached :]

    def admit(self, step: HostStep) -> None:
        """Release `step.release_seq_ids`, sweep idle sequences, and give each new sequence
        (start 0) its generator and a cache slot; the cache rule is `prepare`'s (a draft head,
        whose cache holds other positions, applies its own). Raises ValueError for a continuing
        sequence (start > 0) this stage does not hold, e.g. one released or freed by the sweep."""
        self.release(step.release_seq_ids)
        self.sweep_idle(keep=set(step.seq_ids))
        now = self.clock()
        for seq_id, start, seed in zip(
            step.seq_ids, step.start_positions, step.random_seed, strict=True
        ):
            if start == 0:
                self._seed(seq_id, seed)
                if not self.cache.has(seq_id):
                    self.cache.allocate(seq_id)
            elif not self.cache.has(seq_id) or seq_id not in self._generators:
                raise ValueError(
                    f"sequence {seq_id} continues at position {start} but holds no cache here "
                    "(released, timed out or never started)"
                )
            self._last_seen[seq_id] = now

    def generators(self, seq_ids: Sequence[int]) -> list[torch.Generator]:
        """The generators of `seq_ids`, in order (each sequence must have been prepared)."""
        return [self._generators[s] for s in seq_ids]

    def _seed(self, seq_id: int, seed: int) -> None:
        generator = torch.Generator(device=self.device)
        generator.manual_seed((seed ^ self.salt) & _SEED_MASK)
        self._generators[seq_id] = generator


class ModelStage:
    """Base of the draft and target stages: a model, K, and its `SequenceSlots` salted by SALT.

    The step's inputs are checked once, where they enter the draft stage
    (`avspec.contract.read_step_inputs`); inside, the stages trust them and hand what they make
    on unchecked. `check_values=True` re-validates every call's arguments and values (shapes,
    ranges, NaN / inf: a host sync on CUDA), for tests and debugging.
    """

    SALT: int

    def __init__(
        self,
        model: StageModel,
        cache: StageCache,
        max_draft_tokens: int,
        idle_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        check_values: bool = False,
        vocab_limit: int | None = None,
    ) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        vocab = model.vocab_size
        if vocab_limit is not None and not 1 <= vocab_limit <= vocab:
            raise ValueError(
                f"vocab_limit must lie in 1..{vocab} (the model's rows), got {vocab_limit}"
            )
        self.vocab_limit = None if vocab_limit == vocab else vocab_limit
        self.model = model
        self.max_draft_tokens = max_draft_tokens
        self.device = model.device
        self.check_values = check_values
        self.slots = SequenceSlots(cache, self.device, self.SALT, idle_timeout_s, clock)

    @property
    def cache(self) -> StageCache:
        return self.slots.cache

    def forward_cached(
        self,
        seq_ids: Sequence[int],
        input_ids: torch.Tensor,
        lengths: Sequence[int],
        at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's `forward_cached(hidden=True)` on this stage's cache: the torch model runs
        on a `KVCache`, llama.cpp's on its `SequencePool` (each stage is built with its pair)."""
        if isinstance(self.model, Transformer):
            cache = cast(KVCache, self.cache)
            return self.model.forward_cached(cache, seq_ids, input_ids, lengths, hidden=True, at=at)
        pool = cast("SequencePool", self.cache)
        return self.model.forward_cached(pool, seq_ids, input_ids, lengths, hidden=True, at=at)

    @property
    def vocab_width(self) -> int:
        """The contract's vocabulary dimension: `vocab_limit`, else the model's rows."""
        return self.vocab_limit or self.model.vocab_size

    def mask_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Set logits [..., vocab] at ids >= vocab_limit to -inf (in place); return them."""
        if self.vocab_limit is not None:
            logits[..., self.vocab_limit :] = float("-inf")
        return logits
