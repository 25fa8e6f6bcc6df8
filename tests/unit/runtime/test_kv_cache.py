"""KV pool bookkeeping: slots, blocks, rollback and limits; reads and writes through the
block table; reserved memory and the read workspace."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest
import torch

from avspec.runtime.kv_cache import BLOCK_SIZE, CacheLimitError, KVCache

SIZES = (2, 2, 8)  # layers, heads, head_dim
B = BLOCK_SIZE


def make_cache(max_sequences: int = 2, max_length: int = 8, pool_tokens: int = 0) -> KVCache:
    return KVCache(*SIZES, max_sequences, max_length, "cpu", pool_tokens=pool_tokens)


def append(cache: KVCache, seq_id: int, n: int, layer: int = 0, value: float | None = None):
    """Reserve, write (keys = `value`, else the position) and advance n positions of seq_id."""
    slots, starts = cache.reserve([seq_id], [n])
    positions = torch.arange(starts[0], starts[0] + n)
    cells = cache.cells(torch.full((n,), slots[0]), positions)
    keys = positions.float() if value is None else torch.full((n,), value)
    keys = keys[:, None, None].expand(n, SIZES[1], SIZES[2])
    cache.write(layer, cells, keys, -keys)
    cache.advance([seq_id], [n])


def keys_of(cache: KVCache, seq_id: int, layer: int = 0) -> torch.Tensor:
    """The first-channel key of each cached position of seq_id, head 0."""
    slot = torch.tensor([cache.slot(seq_id)])
    k, _ = cache.read(layer, cache.key_cells(slot, cache.length(seq_id)))
    return k[0, 0, :, 0].clone()


def test_buffers_are_preallocated_with_the_documented_shape():
    cache = make_cache(3, 8)
    cells = (-(-3 * 8 // B) + 3) * B  # the pool's blocks plus one per sequence
    assert cache.k.shape == (2, 2, cells, 8) and cache.v.shape == (2, 2, cells, 8)
    assert cache.read_cells == cells and cache.pool_tokens == 24
    assert cache.k.dtype == torch.float32
    assert KVCache(*SIZES, 1, 4, "cpu", torch.float64).v.dtype == torch.float64
    assert cache.attention_shape == SIZES


def test_allocate_free_and_slot_reuse():
    cache = make_cache()
    cache.allocate(10)
    cache.allocate(20)
    assert cache.live_ids() == [10, 20] and cache.num_live == 2
    assert cache.has(10) and not cache.has(30)
    with pytest.raises(CacheLimitError, match="2 sequences"):
        cache.allocate(30)
    with pytest.raises(ValueError, match="already allocated"):
        cache.allocate(20)
    slot, free = cache.slot(10), cache.free_blocks
    append(cache, 10, 5)
    assert cache.free_blocks == free - 1
    cache.free(10)
    assert not cache.has(10) and cache.num_live == 1 and cache.free_blocks == free
    cache.allocate(30)  # the freed slot is reused, empty
    assert cache.slot(30) == slot and cache.length(30) == 0


def test_unknown_sequence_ids_raise():
    cache = make_cache()
    for call in (cache.free, cache.length, cache.slot, lambda s: cache.rollback(s, 0)):
        with pytest.raises(ValueError, match="sequence 7 is not allocated"):
            call(7)
    with pytest.raises(ValueError, match="not allocated"):
        cache.reserve([7], [1])


def test_rollback_only_shrinks_and_gives_blocks_back():
    cache = make_cache(2, 3 * B)
    cache.allocate(1)
    free = cache.free_blocks
    append(cache, 1, 2 * B + 3)
    assert cache.free_blocks == free - 3
    cache.rollback(1, 2 * B + 3)
    cache.rollback(1, B + 1)  # keeps 2 blocks
    assert cache.length(1) == B + 1 and cache.free_blocks == free - 2
    assert keys_of(cache, 1).tolist() == list(range(B + 1))  # the kept prefix is intact
    with pytest.raises(ValueError, match=f"holds {B + 1} positions"):
        cache.rollback(1, B + 2)
    with pytest.raises(ValueError, match=f"holds {B + 1} positions"):
        cache.rollback(1, -1)


def test_reserve_checks_limits_without_taking_anything():
    cache = make_cache(2, 8)
    cache.allocate(1)
    cache.allocate(2)
    assert cache.reserve([2, 1], [8, 3]) == ([1, 0], [0, 0])
    cache.advance([1], [5])
    free = cache.free_blocks
    with pytest.raises(CacheLimitError, match="sequence 1 would reach 9 positions.*max_length 8"):
        cache.reserve([2, 1], [1, 4])
    assert cache.length(1) == 5 and cache.length(2) == 0 and cache.free_blocks == free
    with pytest.raises(ValueError, match="repeat"):
        cache.reserve([1, 1], [1, 1])


def test_advance_past_the_reserved_blocks_is_refused():
    """Positions without blocks would be written over block 0, another sequence's keys."""
    cache = make_cache(2, 4 * B)
    cache.allocate(1)
    cache.reserve([1], [B])
    with pytest.raises(ValueError, match="past the blocks it reserved"):
        cache.advance([1], [B + 1])
    cache.advance([1], [B])


def test_one_long_sequence_and_short_ones_share_the_pool():
    """pool_tokens is shared: one sequence may take most of it while others take the rest,
    whatever their ends on blocks; one position more than the pool holds is refused."""
    cache = make_cache(4, 8 * B, pool_tokens=8 * B)
    for seq_id in range(4):
        cache.allocate(seq_id)
    append(cache, 0, 5 * B + 1, value=100.0)  # 6 blocks
    for seq_id in (1, 2, 3):
        append(cache, seq_id, B - 1, value=float(seq_id))  # 1 block each, 3 cells short
    append(cache, 1, 2, value=1.0)  # 128 positions in all: pool_tokens, which always fits
    with pytest.raises(CacheLimitError, match="KV pool is full"):
        cache.reserve([2], [4 * B])
    assert keys_of(cache, 0).eq(100.0).all() and keys_of(cache, 2).eq(2.0).all()
    cache.free(0)
    append(cache, 1, 6 * B, value=1.0)  # the long one's blocks, to another
    assert keys_of(cache, 1).eq(1.0).all() and keys_of(cache, 3).eq(3.0).all()


def test_write_and_read_round_trip_head_major():
    cache = make_cache(2, 2 * B)
    keys = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    cache.allocate(0)
    cache.allocate(1)
    slots, _ = cache.reserve([1, 0], [2, 1])
    cells = cache.cells(torch.tensor([1, 1, 0]), torch.tensor([0, 1, 0]))
    cache.write(1, cells, keys, -keys)
    k, v = cache.read(1, cache.key_cells(torch.tensor([1, 0]), 2))
    assert k.shape == (2, 2, 2, 8)  # (heads, rows, key_length, head_dim)
    torch.testing.assert_close(k[:, 0].transpose(0, 1), keys[:2])
    torch.testing.assert_close(v[:, 1, 0], -keys[2])
    assert cache.k[0].abs().sum() == 0  # other layers untouched


def test_read_gathers_into_one_reused_workspace():
    """CPU reads land in the preallocated workspaces whatever the rows and key_length: no
    per-step temporaries of varying size for malloc to fragment its heap with."""
    cache = make_cache(3, 2 * B)
    for seq_id in range(3):
        cache.allocate(seq_id)
        append(cache, seq_id, 2 * B, layer=1)
    k, v = cache.read(1, cache.key_cells(torch.tensor([2, 0]), 5))
    assert k.is_contiguous() and v.is_contiguous() and k.shape == (2, 2, 5, 8)
    assert k[0, :, :, 0].tolist() == [list(map(float, range(5)))] * 2
    pointers = (k.data_ptr(), v.data_ptr())
    k, v = cache.read(0, cache.key_cells(torch.tensor([1, 2, 0]), 2 * B))  # the same memory
    assert (k.data_ptr(), v.data_ptr()) == pointers
    with pytest.raises(CacheLimitError, match="read workspace"):
        cache.read(0, torch.zeros(4, cache.read_cells // 2, dtype=torch.int64))


def test_read_under_autograd_returns_fresh_gathers():
    """Keys written with grad make the buffers part of the graph: out= gathers would raise."""
    cache = make_cache(2, 8)
    cache.allocate(0)
    cache.allocate(1)
    cache.reserve([0, 1], [1, 1])
    keys = torch.randn(2, 2, 8, requires_grad=True)
    cells = cache.cells(torch.tensor([0, 1]), torch.tensor([0, 0]))
    cache.write(0, cells, keys, keys * 2)
    k, v = cache.read(0, cache.key_cells(torch.tensor([1]), 1))
    (k.sum() + v.sum()).backward()
    # slot 1 was read: its key counts once through k and twice through v = 2 * key
    torch.testing.assert_close(keys.grad, torch.stack([torch.zeros(2, 8), torch.full((2, 8), 3.0)]))


def test_nbytes_counts_buffers_and_workspaces():
    cache = make_cache(3, 8)
    cells = cache.read_cells
    buffer = 2 * 2 * cells * 8 * 4  # layers, heads, cells, head_dim, float32
    workspace = 2 * cells * 8 * 4  # one layer's worth, for keys and for values
    assert cache.nbytes == 2 * buffer + 2 * workspace
    assert KVCache(*SIZES, 3, 8, "meta").nbytes == 2 * buffer  # no workspace off the CPU


def resident_fraction(tensor: torch.Tensor) -> float:
    """Share of the memory pages under `tensor` that are in RAM now (mincore(2) on its own
    pages): unlike the process's RSS, it does not move with what other memory does meanwhile
    (pages of shared libraries dropped under pressure, the heap giving pages back)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = -(-(end - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    if libc.mincore(start, end - start, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vector) / pages


@pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) on Linux")
def test_reserved_memory_is_resident_from_construction():
    """The cache commits what it reserves up front, so serving does not grow into it later:
    every page of its buffers and read workspaces is in RAM right after construction.

    The control shows the check can fail: a fresh anonymous mapping of 64 MiB, never written,
    has none of its pages resident. (It was `torch.empty` of 64 MiB, which one full-suite run
    found wholly resident while it passed alone: the allocator's memory is not guaranteed fresh.)
    """
    cache = KVCache(1, 4, 64, 64, 1024, "cpu")  # 64 x 1024 cells + a block per sequence
    buffers = (cache.k, cache.v, *cache._workspace)
    cells = 64 * 1024 + 64 * B
    assert sum(t.numel() * t.element_size() for t in buffers) == cache.nbytes == 4 * cells * 1024
    for buffer in buffers:
        assert resident_fraction(buffer) == 1.0
    mapping = mmap.mmap(-1, 64 * 2**20)  # anonymous, private, never written
    untouched = torch.frombuffer(mapping, dtype=torch.float32)
    assert resident_fraction(untouched) < 0.01
    del untouched
    mapping.close()


def test_constructor_validation():
    with pytest.raises(ValueError, match="max_sequences and max_length must be >= 1"):
        KVCache(*SIZES, 0, 8, "cpu")
    with pytest.raises(ValueError, match="pool_tokens >= 0"):
        KVCache(*SIZES, 1, 8, "cpu", pool_tokens=-1)
    with pytest.raises(ValueError, match="num_layers, num_heads and head_dim must be >= 1"):
        KVCache(2, 0, 8, 1, 8, "cpu")
