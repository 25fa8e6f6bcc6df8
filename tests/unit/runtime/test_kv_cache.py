"""KV cache slot bookkeeping, rollback and limits; reserved memory and the read workspace."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from avspec.runtime.kv_cache import CacheLimitError, KVCache

SIZES = (2, 2, 8)  # layers, heads, head_dim


def make_cache(max_sequences: int = 2, max_length: int = 8) -> KVCache:
    return KVCache(*SIZES, max_sequences, max_length, "cpu")


def test_buffers_are_preallocated_with_the_documented_shape():
    cache = make_cache(3, 8)
    assert cache.k.shape == (2, 3, 2, 8, 8) and cache.v.shape == (2, 3, 2, 8, 8)
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
    slot = cache.slot(10)
    cache.reserve([10], [5])
    cache.advance([10], [5])
    cache.free(10)
    assert not cache.has(10) and cache.num_live == 1
    cache.allocate(30)  # the freed slot is reused, empty
    assert cache.slot(30) == slot and cache.length(30) == 0


def test_unknown_sequence_ids_raise():
    cache = make_cache()
    for call in (cache.free, cache.length, cache.slot, lambda s: cache.rollback(s, 0)):
        with pytest.raises(ValueError, match="sequence 7 is not allocated"):
            call(7)
    with pytest.raises(ValueError, match="not allocated"):
        cache.reserve([7], [1])


def test_rollback_only_shrinks():
    cache = make_cache()
    cache.allocate(1)
    cache.advance([1], [6])
    cache.rollback(1, 6)
    cache.rollback(1, 2)
    assert cache.length(1) == 2
    with pytest.raises(ValueError, match="holds 2 positions"):
        cache.rollback(1, 3)
    with pytest.raises(ValueError, match="holds 2 positions"):
        cache.rollback(1, -1)


def test_reserve_checks_max_length_without_changing_state():
    cache = make_cache(2, 8)
    cache.allocate(1)
    cache.allocate(2)
    assert cache.reserve([2, 1], [8, 3]) == ([1, 0], [0, 0])
    cache.advance([1], [5])
    with pytest.raises(CacheLimitError, match="sequence 1 would reach 9 positions.*max_length 8"):
        cache.reserve([2, 1], [1, 4])
    assert cache.length(1) == 5 and cache.length(2) == 0
    with pytest.raises(ValueError, match="repeat"):
        cache.reserve([1, 1], [1, 1])


def test_write_and_read_round_trip():
    cache = make_cache(2, 8)
    keys = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    slots, positions = torch.tensor([1, 1, 0]), torch.tensor([0, 1, 0])
    cache.write(1, slots, positions, keys, -keys)
    k, v = cache.read(1, torch.tensor([1, 0]), 2)  # (batch, heads, key_length, head_dim)
    assert k.shape == (2, 2, 2, 8)
    torch.testing.assert_close(k[0].transpose(0, 1), keys[:2])
    torch.testing.assert_close(v[1, :, 0], -keys[2])
    assert cache.k[0].abs().sum() == 0  # other layers untouched


def test_read_gathers_into_one_reused_workspace():
    """CPU reads land in the preallocated workspaces whatever the batch and key_length: no
    per-step temporaries of varying size for malloc to fragment its heap with."""
    cache = make_cache(3, 8)
    generator = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    k, v = cache.read(1, torch.tensor([2, 0]), 5)
    torch.testing.assert_close(k, cache.k[1, [2, 0], :, :5])
    torch.testing.assert_close(v, cache.v[1, [2, 0], :, :5])
    assert k.is_contiguous() and v.is_contiguous()
    pointers = (k.data_ptr(), v.data_ptr())
    k, v = cache.read(0, torch.tensor([1, 2, 0]), 8)  # another shape: the same memory
    assert (k.data_ptr(), v.data_ptr()) == pointers
    torch.testing.assert_close(k, cache.k[0, [1, 2, 0]])
    torch.testing.assert_close(v, cache.v[0, [1, 2, 0]])


def test_read_under_autograd_returns_fresh_gathers():
    """Keys written with grad make the buffers part of the graph: out= gathers would raise."""
    cache = make_cache(2, 8)
    keys = torch.randn(2, 2, 8, requires_grad=True)
    cache.write(0, torch.tensor([0, 1]), torch.tensor([0, 0]), keys, keys * 2)
    k, v = cache.read(0, torch.tensor([1]), 1)
    (k.sum() + v.sum()).backward()
    # slot 1 was read: its key counts once through k and twice through v = 2 * key
    torch.testing.assert_close(keys.grad, torch.stack([torch.zeros(2, 8), torch.full((2, 8), 3.0)]))


def test_nbytes_counts_buffers_and_workspaces():
    cache = make_cache(3, 8)
    buffer = 2 * 3 * 2 * 8 * 8 * 4  # layers, sequences, heads, positions, head_dim, float32
    workspace = 3 * 2 * 8 * 8 * 4  # one layer's worth, for keys and for values
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

    64 MiB buffers are fresh mmaps (past glibc's largest dynamic mmap threshold): an untouched
    one, `torch.empty`, has none of its pages resident, which shows the check can fail.
    """
    cache = KVCache(1, 4, 64, 64, 1024, "cpu")
    buffers = (cache.k, cache.v, *cache._workspace)
    assert sum(t.numel() * t.element_size() for t in buffers) == cache.nbytes == 4 * 64 * 2**20
    for buffer in buffers:
        assert resident_fraction(buffer) == 1.0
    untouched = torch.empty(16 * 2**20)  # 64 MiB of float32, never written
    assert resident_fraction(untouched) < 0.01


def test_constructor_validation():
    with pytest.raises(ValueError, match="max_sequences and max_length must be >= 1"):
        KVCache(*SIZES, 0, 8, "cpu")
    with pytest.raises(ValueError, match="num_layers, num_heads and head_dim must be >= 1"):
        KVCache(2, 0, 8, 1, 8, "cpu")
