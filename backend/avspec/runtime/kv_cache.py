"""Per-sequence key/value cache: preallocated slots, append, rollback, free, hard limits.

Buffers `k` and `v` are [layers, max_sequences, heads, max_length, head_dim], allocated once.
A sequence id owns one slot from `allocate` to `free`; its length is host-side bookkeeping, so
rollback (dropping rejected drafts) is O(1) and stale keys past the length are simply
overwritten by the next append. Exceeding a limit raises `CacheLimitError`: the cache never
truncates silently. Sizes are plain numbers (a model builds its cache with
`Transformer.new_cache`, which checks them against its config).

Memory is reserved up front and stays flat under load: `torch.zeros` writes every page of `k`
and `v`, so they are resident from construction on; on the CPU, `read` gathers a batch's keys and
values into two preallocated workspaces (one layer's worth each) instead of fresh tensors, the
largest per-step temporaries, whose size changes every step (why: docs/reliability.md, "Memory
under load"). The CUDA caching allocator needs no workspace. `nbytes` is what the cache
reserves, logged at construction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class CacheLimitError(ValueError):
    """Allocating past max_sequences or appending past max_length."""


class KVCache:
    """Fixed-size key/value store for up to `max_sequences` sequences of `max_length` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        max_sequences: int,
        max_length: int,
        device: str | torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if min(num_layers, num_heads, head_dim) < 1:
            raise ValueError(
                f"num_layers, num_heads and head_dim must be >= 1, got {num_layers}, "
                f"{num_heads}, {head_dim}"
            )
        if max_sequences < 1 or max_length < 1:
            raise ValueError(
                f"max_sequences and max_length must be >= 1, got {max_sequences}, {max_length}"
            )
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.max_sequences = max_sequences
        self.max_length = max_length
        shape = (num_layers, max_sequences, num_heads, max_length, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # read()'s (keys, values) workspaces, flat: a batch's gather is a contiguous view of
        # their first elements
        self._workspace: tuple[Tensor, Tensor] | None = None
        if self.k.device.type == "cpu":
            size = max_sequences * num_heads * max_length * head_dim
            self._workspace = (torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype))
        logger.info(
            "KV cache: %d layers x %d sequences x %d positions x %d heads x %d on %s, %s: "
            "%.1f MiB reserved (read workspaces included)",
            num_layers, max_sequences, max_length, num_heads, head_dim, self.k.device, dtype,
            self.nbytes / 2**20,
        )  # fmt: skip
        self._slot_of: dict[int, int] = {}
        self._lengths = [0] * max_sequences
        self._free_slots = list(range(max_sequences - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def nbytes(self) -> int:
        """Bytes reserved at construction: the k and v buffers and the read workspaces."""
        buffers = (self.k, self.v, *(self._workspace or ()))
        return sum(t.numel() * t.element_size() for t in buffers)

    @property
    def attention_shape(self) -> tuple[int, int, int]:
        """(layers, heads, head_dim): what a model must have to use this cache."""
        return (self.num_layers, self.num_heads, self.head_dim)

    @property
    def num_live(self) -> int:
        return len(self._slot_of)

    def live_ids(self) -> list[int]:
        return sorted(self._slot_of)

    def has(self, seq_id: int) -> bool:
        return int(seq_id) in self._slot_of

    def allocate(self, seq_id: int) -> None:
        """Give `seq_id` an empty slot; ValueError if it has one, CacheLimitError if none left."""
        seq_id = int(seq_id)
        if seq_id in self._slot_of:
            raise ValueError(f"sequence {seq_id} is already allocated in the KV cache")
        if not self._free_slots:
            raise CacheLimitError(
                f"KV cache is full: {self.max_sequences} sequences (max_sequences) are live"
            )
        slot = self._free_slots.pop()
        self._slot_of[seq_id] = slot
        self._lengths[slot] = 0

    def free(self, seq_id: int) -> None:
        """Release the slot of `seq_id` for reuse."""
        slot = self.slot(seq_id)
        del self._slot_of[int(seq_id)]
        self._lengths[slot] = 0
        self._free_slots.append(slot)

    def slot(self, seq_id: int) -> int:
        """Slot index of `seq_id`; ValueError naming the id if it is not allocated."""
        try:
            return self._slot_of[int(seq_id)]
        except KeyError:
            raise ValueError(f"sequence {seq_id} is not allocated in the KV cache") from None

    def length(self, seq_id: int) -> int:
        """Number of cached positions of `seq_id`."""
        return self._lengths[self.slot(seq_id)]

    def rollback(self, seq_id: int, length: int) -> None:
        """Keep only the first `length` positions of `seq_id` (0 <= length <= current length)."""
        slot = self.slot(seq_id)
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(
                f"cannot roll sequence {seq_id} back to length {length}: it holds "
                f"{self._lengths[slot]} positions"
            )
        self._lengths[slot] = int(length)

    def reserve(
        self, seq_ids: Sequence[int], lengths: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Check that each sequence can take `lengths[i]` more positions; return (slots, starts).

        Changes nothing: `write` then `advance` commit the append.
        """
        if len(set(map(int, seq_ids))) != len(seq_ids):
            raise ValueError(f"seq_ids repeat within one batch: {list(seq_ids)}")
        slots = [self.slot(s) for s in seq_ids]
        starts = [self._lengths[slot] for slot in slots]
        for seq_id, start, n in zip(seq_ids, starts, lengths, strict=True):
            if start + n > self.max_length:
                raise CacheLimitError(
                    f"sequence {seq_id} would reach {start + n} positions, past the KV cache "
                    f"max_length {self.max_length}"
                )
        return slots, starts

    def write(
        self, layer: int, token_slots: Tensor, positions: Tensor, keys: Tensor, values: Tensor
    ) -> None:
        """Store keys/values [tokens, heads, head_dim] at (token_slots[i], positions[i])."""
        self.k[layer, token_slots, :, positions] = keys.to(self.k.dtype)
        self.v[layer, token_slots, :, positions] = values.to(self.v.dtype)

    def read(self, layer: int, slots: Tensor, key_length: int) -> tuple[Tensor, Tensor]:
        """Keys and values of `slots` [batch], each [batch, heads, key_length, head_dim].

        On the CPU both are views of the read workspaces, overwritten by the next `read`: use
        them before reading again (forward_cached reads once per layer). Elsewhere, or while
        the buffers take part in autograd (out= ops refuse that), they are fresh gathers.
        """
        k, v = self.k[layer, :, :, :key_length], self.v[layer, :, :, :key_length]
        if self._workspace is None or k.requires_grad or v.requires_grad:
            return k[slots], v[slots]
        shape = (slots.shape[0], self.num_heads, key_length, self.head_dim)
        count = shape[0] * shape[1] * shape[2] * shape[3]
        keys, values = (w[:count].view(shape) for w in self._workspace)
        torch.index_select(k, 0, slots, out=keys)
        torch.index_select(v, 0, slots, out=values)
        return keys, values

    def advance(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        """Commit an append reserved by `reserve`: sequence i grows by lengths[i] positions."""
        for seq_id, n in zip(seq_ids, lengths, strict=True):
            self._lengths[self.slot(seq_id)] += int(n)
