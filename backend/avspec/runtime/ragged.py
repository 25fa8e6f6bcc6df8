"""A packed ragged batch and the attention tiles its rows are grouped into.

`forward_cached` runs every projection on the packed tokens (sequence after sequence, no
padding) and attention on padded tiles [rows, query_length, key_length]. One tile for the whole
batch pads every row to the longest row's tokens: a step that prefills one 120-token prompt
beside 15 decoding rows then computes 16 x 120 query rows of attention instead of 135, and took
747 ms where the two parts alone take 74 + 222 ms (bf16, 1 thread, SmolLM2-135M). `tile_groups`
therefore groups the rows: longest first, a row joins the current tile while the tile's padded
query rows stay within `MAX_PADDING` times its real tokens or `PAD_SLACK` rows above them, else
it opens the next. Measured on the target stage (bf16, 1 thread, 384 cached tokens a row,
interleaved rounds, against the earlier single bound of 2.0x): 64 rows of which 6 verify one
draft, 390 -> 364 ms (no drafts: 346 and 341); 16 of 64, 410 -> 389; 32 of 64 verifying 2,
502 -> 483; every row verifying alike, unchanged. At 4 rows a tile of its own costs more than
the padding it saves (one row of 2 tokens beside three of 1: 60 ms as one tile, 64 as two),
hence the slack, which keeps such batches one tile as before. A batch
whose rows all bring the same number of tokens (decoding, or verifying one draft length) is one
tile, and its packed tokens already are that tile row after row: `pad` and `unpad` reshape
instead of scattering into zeros and gathering back.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from avspec.runtime.attention import mask_bias

MAX_PADDING = 1.25  # a tile's padded query rows at most this many times its real tokens ...
PAD_SLACK = 8  # ... or at most this many more: a tile of its own costs about as much


def tile_groups(
    lengths: Sequence[int],
    max_padding: float | None = None,
    key_lengths: Sequence[int] | None = None,
    max_cells: int | None = None,
) -> list[list[int]]:
    """The batch's rows grouped into attention tiles (row indices, longest first).

    `max_padding` defaults to MAX_PADDING; it and PAD_SLACK are read at each call (a benchmark
    compares tile rules by patching them).

    With `key_lengths` (each row's keys: cached + new) and `max_cells`, a tile's rows x its
    longest key length also stays within `max_cells` (the KV cache's read workspace), rows of
    similar key length together.
    """
    max_padding = MAX_PADDING if max_padding is None else max_padding
    keys = key_lengths if key_lengths is not None else [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda b: (-lengths[b], -keys[b]))
    groups: list[list[int]] = []
    real = longest = 0  # the current tile's real tokens and longest keys
    for b in order:
        if groups:
            group = groups[-1]
            width, key_width = lengths[group[0]], max(longest, keys[b])
            fits = max_cells is None or (len(group) + 1) * key_width <= max_cells
            padded, joined = (len(group) + 1) * width, real + lengths[b]
            if fits and padded <= max(max_padding * joined, joined + PAD_SLACK):
                group.append(b)
                real, longest = real + lengths[b], key_width
                continue
        groups.append([b])
        real, longest = lengths[b], keys[b]
    return groups


class AttentionTile:
    """One tile's index tensors: `rows` of the batch, padded to their longest row's tokens.

    `token_index` [tile tokens] int64: where the tile's tokens sit in the packed batch (None
    when the tile is the whole batch in packed order).
    """

    def __init__(
        self,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        token_index: Tensor | None,
        device: torch.device,
    ) -> None:
        self.batch = len(lengths)
        self.uniform = min(lengths) == max(lengths)
        self.token_index = token_index
        rows = [b for b, n in enumerate(lengths) for _ in range(n)]
        cols = [j for n in lengths for j in range(n)]
        self.query_length = max(lengths)
        self.key_length = max(s + n for s, n in zip(starts, lengths, strict=True))

        def as_tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.token_rows = as_tensor(rows)  # (tile tokens,)
        self.token_cols = as_tensor(cols)  # (tile tokens,)
        self.slots = as_tensor(slots)  # (rows,)
        # A query at column j of sequence b sees keys 0..starts[b] + j; padded columns see
        # the same prefix plus stale keys (finite, never NaN) and are dropped afterwards.
        query_pos = as_tensor(starts)[:, None] + torch.arange(self.query_length, device=device)
        key_pos = torch.arange(self.key_length, device=device)
        # (rows, 1, 1, query_length, key_length): broadcast over heads
        self.bias = mask_bias(key_pos[None, None, :] <= query_pos[:, :, None])

    def pad(self, packed: Tensor) -> Tensor:
        """[tile tokens, ...] -> [rows, query_length, ...], padding columns zero."""
        if self.uniform:
            return packed.view(self.batch, self.query_length, *packed.shape[1:])
        tile = packed.new_zeros(self.batch, self.query_length, *packed.shape[1:])
        tile[self.token_rows, self.token_cols] = packed
        return tile

    def unpad(self, tile: Tensor) -> Tensor:
        """[rows, query_length, ...] -> [tile tokens, ...], the inverse of `pad`."""
        if self.uniform:
            return tile.reshape(-1, *tile.shape[2:])
        return tile[self.token_rows, self.token_cols]


class RaggedIndex:
    """Host-built index tensors of a packed ragged batch: each token's position and cache slot,
    and the `tiles` attention runs on (`tile_groups`)."""

    def __init__(
        self,
        slots: Sequence[int],
        starts: Sequence[int],
        lengths: Sequence[int],
        device: torch.device,
        max_padding: float | None = None,
        max_cells: int | None = None,
    ) -> None:
        positions = [starts[b] + j for b, n in enumerate(lengths) for j in range(n)]
        self.positions = torch.tensor(positions, dtype=torch.int64, device=device)  # (tokens,)
        counts = torch.tensor(list(lengths), dtype=torch.int64, device=device)
        slot_of = torch.tensor(list(slots), dtype=torch.int64, device=device)
        self.token_slots = slot_of.repeat_interleave(counts)  # (tokens,)
        key_lengths = [s + n for s, n in zip(starts, lengths, strict=True)]
        groups = tile_groups(lengths, max_padding, key_lengths, max_cells)
        if len(groups) == 1:
            self.tiles = [AttentionTile(list(slots), list(starts), list(lengths), None, device)]
            return
        offsets = [0, *itertools.accumulate(lengths)]
        self.tiles = []
        for group in groups:
            group = sorted(group)  # packed order within the tile
            index = [t for b in group for t in range(offsets[b], offsets[b + 1])]
            self.tiles.append(
                AttentionTile(
                    [slots[b] for b in group],
                    [starts[b] for b in group],
                    [lengths[b] for b in group],
                    torch.tensor(index, dtype=torch.int64, device=device),
                    device,
                )
            )
