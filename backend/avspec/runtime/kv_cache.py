"""Keys and values of every sequence in one pool of cells, handed out in blocks.

Buffers `k` and `v` are [layers, kv_heads, cells, head_dim], allocated once. The cells are cut
into blocks of `BLOCK_SIZE` positions, and a sequence holds the blocks its length needs (its
row of a block table), so long and short sequences draw on one pool: a request may use the
model's whole context while others use little. The pool holds `pool_tokens` cells (default
max_sequences x max_length, what a fixed slot per sequence would reserve) plus one block per
sequence, so any set of sequences whose lengths add up to `pool_tokens` fits, however their
ends fall on blocks.

A sequence id owns a slot (its table row) from `allocate` to `free`; its length is host-side
bookkeeping, so rollback (dropping rejected drafts) is O(1): blocks past the kept length go
back to the pool, stale keys in a kept block are overwritten by the next append. Exceeding a
limit raises `CacheLimitError`: the cache never truncates silently.

A step maps its new tokens to cells once (`cells`), and each attention tile's rows to the cells
of their keys once (`key_cells`); per layer, `write` stores and `read` gathers keys and values
head-major, [kv_heads, rows, key_length, head_dim], the layout `grouped_attention` takes, so the
gather is the only copy. Memory is reserved up front and stays flat under load: `torch.zeros`
writes every page, and on the CPU `read` gathers into two preallocated workspaces of
`read_cells` cells (a tile never gathers more: `avspec.runtime.ragged` splits it), the largest
per-step temporaries (why: docs/reliability.md, "Memory under load"). The CUDA caching allocator
needs no workspace. `nbytes` is what the cache reserves, logged at construction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16  # positions per block of cells


class CacheLimitError(ValueError):
    """Allocating past max_sequences, appending past max_length or past the pool's cells."""


class KVCache:
    """Up to `max_sequences` sequences of up to `max_length` positions in one pool of cells."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        max_sequences: int,
        max_length: int,
        device: str | torch.device,
        dtype: torch.dtype = torch.float32,
        pool_tokens: int = 0,
    ) -> None:
        if min(num_layers, num_heads, head_dim) < 1:
            raise ValueError(
                f"num_layers, num_heads and head_dim must be >= 1, got {num_layers}, "
                f"{num_heads}, {head_dim}"
            )
        if max_sequences < 1 or max_length < 1 or pool_tokens < 0:
            raise ValueError(
                f"max_sequences and max_length must be >= 1 and pool_tokens >= 0, got "
                f"{max_sequences}, {max_length}, {pool_tokens}"
            )
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.max_sequences = max_sequences
        self.max_length = max_length
        self.pool_tokens = pool_tokens or max_sequences * max_length
        num_blocks = -(-self.pool_tokens // BLOCK_SIZE) + max_sequences
        self.read_cells = num_blocks * BLOCK_SIZE
        shape = (num_layers, num_heads, self.read_cells, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._workspace: tuple[Tensor, Tensor] | None = None
        if self.k.device.type == "cpu":
            size = num_heads * self.read_cells * head_dim
            self._workspace = (torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype))
        # row s: the blocks of the sequence in slot s, in order (unused entries: block 0)
        table_width = -(-max_length // BLOCK_SIZE)
        self._table = torch.zeros(max_sequences, table_width, dtype=torch.int64, device=device)
        self._blocks: list[list[int]] = [[] for _ in range(max_sequences)]
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._offsets = torch.arange(BLOCK_SIZE, device=device)
        logger.info(
            "KV pool: %d cells (%d positions shared by up to %d sequences of up to %d, plus a "
            "block of %d per sequence) x %d layers x %d heads x %d on %s, %s: %.1f MiB reserved "
            "(read workspaces included)",
            self.read_cells, self.pool_tokens, max_sequences, max_length, BLOCK_SIZE,
            num_layers, num_heads, head_dim, self.k.device, dtype, self.nbytes / 2**20,
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

    @property
    def free_blocks(self) -> int:
        """Blocks of `BLOCK_SIZE` cells that no sequence holds."""
        return len(self._free_blocks)

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
        """Release the slot of `seq_id` and its blocks for reuse."""
        slot = self.slot(seq_id)
        del self._slot_of[int(seq_id)]
        self._keep_blocks(slot, 0)
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
        """Keep only the first `length` positions of `seq_id` (0 <= length <= current length);
        the blocks past them go back to the pool."""
        slot = self.slot(seq_id)
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(
                f"cannot roll sequence {seq_id} back to length {length}: it holds "
                f"{self._lengths[slot]} positions"
            )
        self._lengths[slot] = int(length)
        self._keep_blocks(slot, -(-int(length) // BLOCK_SIZE))

    def _keep_blocks(self, slot: int, count: int) -> None:
        blocks = self._blocks[slot]
        while len(blocks) > count:
            self._free_blocks.append(blocks.pop())

    def reserve(
        self, seq_ids: Sequence[int], lengths: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Give each sequence the blocks for `lengths[i]` more positions; return (slots, starts).

        CacheLimitError (and nothing taken) past a sequence's max_length or the pool's free
        blocks. Lengths do not change: `write` then `advance` commit the append (a sequence
        keeps blocks a failed step took, for its next positions, until `rollback` or `free`).
        """
        if len(set(map(int, seq_ids))) != len(seq_ids):
            raise ValueError(f"seq_ids repeat within one batch: {list(seq_ids)}")
        slots = [self.slot(s) for s in seq_ids]
        starts = [self._lengths[slot] for slot in slots]
        wanted = []
        for seq_id, slot, start, n in zip(seq_ids, slots, starts, lengths, strict=True):
            if start + n > self.max_length:
                raise CacheLimitError(
                    f"sequence {seq_id} would reach {start + n} positions, past the KV cache "
                    f"max_length {self.max_length}"
                )
            wanted.append(max(0, -(-(start + n) // BLOCK_SIZE) - len(self._blocks[slot])))
        if sum(wanted) > len(self._free_blocks):
            raise CacheLimitError(
                f"KV pool is full: {sum(wanted) * BLOCK_SIZE} more cells wanted, "
                f"{len(self._free_blocks) * BLOCK_SIZE} free of {self.read_cells} shared by all "
                "sequences (pool_tokens)"
            )
        for slot, count in zip(slots, wanted, strict=True):
            blocks = self._blocks[slot]
            if count:
                taken = [self._free_blocks.pop() for _ in range(count)]
                first = len(blocks)
                blocks.extend(taken)
                self._table[slot, first : first + count] = torch.tensor(taken)
        return slots, starts

    def cells(self, token_slots: Tensor, positions: Tensor) -> Tensor:
        """The pool cells [tokens] of (token_slots[i], positions[i]), reserved before."""
        block = self._table[token_slots, torch.div(positions, BLOCK_SIZE, rounding_mode="floor")]
        return block * BLOCK_SIZE + positions % BLOCK_SIZE

    def key_cells(self, slots: Tensor, key_length: int) -> Tensor:
        """The cells [rows, key_length] of the first `key_length` positions of `slots` [rows]
        (past a row's blocks: cells of block 0, stale keys a mask must hide)."""
        blocks = -(-key_length // BLOCK_SIZE)
        cells = self._table[slots, :blocks, None] * BLOCK_SIZE + self._offsets
        return cells.flatten(1)[:, :key_length]

    def write(self, layer: int, cells: Tensor, keys: Tensor, values: Tensor) -> None:
        """Store keys/values [tokens, heads, head_dim] at `cells` [tokens] (from `cells`)."""
        self.k[layer].index_copy_(1, cells, keys.transpose(0, 1).to(self.k.dtype))
        self.v[layer].index_copy_(1, cells, values.transpose(0, 1).to(self.v.dtype))

    def read(self, layer: int, key_cells: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values at `key_cells` [rows, key_length] (from `key_cells`), each
        [heads, rows, key_length, head_dim].

        On the CPU both are views of the read workspaces, overwritten by the next `read`: use
        them before reading again (forward_cached reads once per layer and tile). Elsewhere, or
        while the buffers take part in autograd (out= ops refuse that), they are fresh gathers.
        """
        rows, key_length = key_cells.shape
        index = key_cells.reshape(-1)
        k, v = self.k[layer], self.v[layer]
        shape = (self.num_heads, rows, key_length, self.head_dim)
        if self._workspace is None or k.requires_grad or v.requires_grad:
            return k.index_select(1, index).view(shape), v.index_select(1, index).view(shape)
        count = self.num_heads * index.numel() * self.head_dim
        if count > self._workspace[0].numel():
            raise CacheLimitError(
                f"a read of {rows} x {key_length} cells exceeds the read workspace of "
                f"{self.read_cells} cells (split the tile)"
            )
        flat = (self.num_heads, index.numel(), self.head_dim)
        keys, values = (w[:count].view(flat) for w in self._workspace)
        torch.index_select(k, 1, index, out=keys)
        torch.index_select(v, 1, index, out=values)
        return keys.view(shape), values.view(shape)

    def advance(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        """Commit an append reserved by `reserve`: sequence i grows by lengths[i] positions."""
        slots = [self.slot(s) for s in seq_ids]
        for seq_id, slot, n in zip(seq_ids, slots, lengths, strict=True):
            if self._lengths[slot] + n > len(self._blocks[slot]) * BLOCK_SIZE:
                raise ValueError(f"sequence {seq_id} advanced past the blocks it reserved")
        for slot, n in zip(slots, lengths, strict=True):
            self._lengths[slot] += int(n)
