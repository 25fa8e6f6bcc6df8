"""How float weights round to int8 and int4 values: the grids the quantized layers store.

int8 is symmetric per output channel (scale = max |w| / 127); int4 is asymmetric per group of
`group_size` inputs (scale = (max - min) / 15, the group's min maps to q = 0), the scheme of
GGUF's Q4_1 blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(q int8 [out, in], scales float32 [out]) with weight ~ q * scales[:, None]."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q uint8 [out, in] in 0..15, scales, zeros float32 [out, in / group_size]) with
    weight ~ (q - 8) * scale + zero within each group of `group_size` inputs."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"int4: {cols} inputs are not a multiple of the group size {group_size}")
    groups = weight.detach().float().view(rows, cols // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).view(rows, cols), scales, low + 8.0 * scales
