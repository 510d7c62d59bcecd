"""Block-by-block evaluation of the elementwise chains of fake quantization and requantization.

A tensor of tens of MB is a fresh ``mmap`` on every allocation (glibc serves blocks above
32 MiB that way) and pays a page fault per 4 KiB it touches, several times the cost of the
arithmetic on it. The chains (divide, round, clamp, compare, scale; float64 for the exact
requantization) therefore run on blocks of :data:`BLOCK` elements: only their results are
allocated at full size, the temporaries stay small, reused from the heap and in cache.
Elementwise results do not depend on the blocking.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["BLOCK", "blocks", "part"]

#: elements per block (float64 temporaries of 2 MiB)
BLOCK = 1 << 18


def blocks(shape: torch.Size | tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Index tuples cutting a tensor of ``shape`` into blocks of at most about :data:`BLOCK`
    elements along its first two dimensions (the batch, then the channels); ``[()]`` when it is small."""
    n = math.prod(shape)
    if n <= BLOCK or len(shape) < 2:
        return [()]
    inner = math.prod(shape[2:])
    row = shape[1] * inner
    if row <= BLOCK:
        k = BLOCK // row
        return [(slice(i, i + k),) for i in range(0, shape[0], k)]
    c = max(1, BLOCK // inner)
    return [(slice(i, i + 1), slice(j, j + c)) for i in range(shape[0]) for j in range(0, shape[1], c)]


def part(t: Any, idx: tuple[slice, ...], ndim: int) -> Any:
    """The block ``idx`` of ``t``, a tensor that broadcasts against a rank-``ndim`` tensor
    (a 0-d tensor, a number, or a dimension of size 1 is shared by every block)."""
    if not isinstance(t, torch.Tensor) or not idx or t.dim() == 0:
        return t
    lead = ndim - t.dim()  # broadcasting aligns trailing dimensions
    sel = tuple(idx[d + lead] if 0 <= d + lead < len(idx) and t.shape[d] > 1 else slice(None) for d in range(t.dim()))
    return t[sel]
