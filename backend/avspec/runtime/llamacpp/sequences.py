"""The KV pool of one llama.cpp context, seen through the stages' cache interface.

One `llama_memory` holds the keys and values of every sequence (llama.cpp's unified KV cache):
`pool_tokens` cells shared by all of them, so a long request and many short ones draw on the
same memory, and a sequence may grow to `max_length` (the model's own context) while the pool
has room. A request's sequence id (any int) is mapped to one of llama.cpp's `max_sequences`
sequence ids while it lives. Lengths are host bookkeeping, as in `avspec.runtime.kv_cache`:
`rollback` drops positions past a length with `llama_memory_seq_rm`, `free` drops them all.

Appending past `max_length` or past the pool's free cells raises `CacheLimitError` before
anything runs: llama.cpp is never asked for a slot it does not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from avspec.runtime.kv_cache import CacheLimitError


class SequencePool:
    """`max_sequences` llama.cpp sequences over one pool of `pool_tokens` KV cells."""

    def __init__(
        self, memory: Any, binding: Any, max_sequences: int, pool_tokens: int, max_length: int
    ) -> None:
        if min(max_sequences, pool_tokens, max_length) < 1:
            raise ValueError(
                f"max_sequences, pool_tokens and max_length must be >= 1, got {max_sequences}, "
                f"{pool_tokens}, {max_length}"
            )
        self.memory = memory
        self.binding = binding
        self.max_sequences = max_sequences
        self.pool_tokens = pool_tokens
        self.max_length = min(max_length, pool_tokens)
        self._llama_id: dict[int, int] = {}
        self._lengths: dict[int, int] = {}
        self._free_ids = list(range(max_sequences - 1, -1, -1))  # pop() hands out 0 first

    @property
    def num_live(self) -> int:
        return len(self._llama_id)

    @property
    def used_tokens(self) -> int:
        """Cells the live sequences hold."""
        return sum(self._lengths.values())

    def live_ids(self) -> list[int]:
        return sorted(self._llama_id)

    def has(self, seq_id: int) -> bool:
        return int(seq_id) in self._llama_id

    def allocate(self, seq_id: int) -> None:
        """Give `seq_id` an empty llama.cpp sequence; CacheLimitError if none is left."""
        seq_id = int(seq_id)
        if seq_id in self._llama_id:
            raise ValueError(f"sequence {seq_id} is already allocated in the KV pool")
        if not self._free_ids:
            raise CacheLimitError(
                f"KV pool is full: {self.max_sequences} sequences (max_sequences) are live"
            )
        self._llama_id[seq_id] = self._free_ids.pop()
        self._lengths[seq_id] = 0

    def free(self, seq_id: int) -> None:
        """Drop every position of `seq_id` and release its llama.cpp sequence."""
        llama_id = self.llama_id(seq_id)
        self.binding.llama_memory_seq_rm(self.memory, llama_id, -1, -1)
        del self._llama_id[int(seq_id)], self._lengths[int(seq_id)]
        self._free_ids.append(llama_id)

    def llama_id(self, seq_id: int) -> int:
        """llama.cpp's sequence id of `seq_id`; ValueError naming the id if it holds none."""
        try:
            return self._llama_id[int(seq_id)]
        except KeyError:
            raise ValueError(f"sequence {seq_id} is not allocated in the KV pool") from None

    def length(self, seq_id: int) -> int:
        self.llama_id(seq_id)
        return self._lengths[int(seq_id)]

    def rollback(self, seq_id: int, length: int) -> None:
        """Keep only the first `length` positions of `seq_id` (0 <= length <= its length)."""
        llama_id, held = self.llama_id(seq_id), self._lengths[int(seq_id)]
        if not 0 <= length <= held:
            raise ValueError(
                f"cannot roll sequence {seq_id} back to length {length}: it holds {held} positions"
            )
        if length < held and not self.binding.llama_memory_seq_rm(
            self.memory, llama_id, int(length), -1
        ):
            raise RuntimeError(f"llama.cpp could not remove positions {length}.. of {seq_id}")
        self._lengths[int(seq_id)] = int(length)

    def reserve(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
        """(llama id, first position) of each sequence about to take `lengths[i]` more tokens;
        CacheLimitError if one would pass `max_length` or the pool has too few free cells.
        Changes nothing: `advance` commits the append once llama.cpp has run it."""
        if len(set(map(int, seq_ids))) != len(seq_ids):
            raise ValueError(f"seq_ids repeat within one batch: {list(seq_ids)}")
        places = [(self.llama_id(s), self._lengths[int(s)]) for s in seq_ids]
        for seq_id, (_, start), n in zip(seq_ids, places, lengths, strict=True):
            if start + n > self.max_length:
                raise CacheLimitError(
                    f"sequence {seq_id} would reach {start + n} positions, past the KV pool's "
                    f"max_length {self.max_length}"
                )
        wanted = self.used_tokens + sum(lengths)
        if wanted > self.pool_tokens:
            raise CacheLimitError(
                f"KV pool is full: {wanted} positions wanted, {self.pool_tokens} cells "
                "(pool_tokens) shared by all sequences"
            )
        return places

    def advance(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        for seq_id, n in zip(seq_ids, lengths, strict=True):
            self._lengths[int(seq_id)] += int(n)
