"""Integer rules of grid sampling (docs/semantics.md, "Grid sample").

Source coordinates are fixed point with ``B`` fraction bits (``B = 15``,
``GRID_COORD_BITS``): per axis of length ``L``,
``fx = ((g * M + 2**(k-1)) >> k) + (L - 1) * 2**(B-1)`` with ``(M, k)`` the 31-bit multiplier
of ``s_grid * span * 2**(B-1)`` (``span = L - 1`` with ``align_corners``, else ``L``): torch's
unnormalization ``((x + 1) * span - (span - L + 1)) / 2`` scaled by ``2**B``. Bilinear
weights are the fraction of ``fx``; the four taps' exact int64 sum is requantized once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from backends.common import numerics
from backends.common.integer_rules import f32

__all__ = ["GRID_COORD_BITS", "GridAxis", "grid_axis", "grid_sample_int", "source_fixed"]

#: fraction bits ``B`` of the fixed-point source coordinates and of the bilinear weights
#: (QAT's nearest mode rounds at the same point). 15 keeps the weight rounding of a qint16
#: output near 1 LSB, and every int64 product below 2**61 (docs/semantics.md, "Grid sample").
GRID_COORD_BITS = 15

#: bits of the coordinate multiplier (``|g * M| < 2**15 * 2**31``, exact in int64)
COORD_MULT_BITS = 31


class GridAxis(NamedTuple):
    """Fixed-point unnormalization of one grid axis: ``fx = round(g * M / 2**k) + offset``."""

    multiplier: int
    shift: int
    offset: int
    size: int


def grid_axis(size: int, grid_scale: float, align_corners: bool, bits: int) -> GridAxis:
    """The :class:`GridAxis` of an input axis of ``size`` for grid codes at ``grid_scale``."""
    span = size - 1 if align_corners else size
    ratio = f32(grid_scale) * span  # the float32 scale, widened exactly
    offset = (size - 1) << (bits - 1)
    if ratio == 0.0:  # a single sample with align_corners: every coordinate is 0
        return GridAxis(0, 0, offset, size)
    m, k = numerics.multiplier_shift(
        torch.tensor(ratio * 2.0 ** (bits - 1), dtype=torch.float64), (1 << COORD_MULT_BITS) - 1, 62
    )
    return GridAxis(int(m), int(k), offset, size)


def source_fixed(g: torch.Tensor, ax: GridAxis) -> torch.Tensor:
    """Source coordinate of grid codes ``g`` at ``2**-B`` (int64)."""
    v = g.to(torch.int64) * ax.multiplier
    if ax.shift:
        v = (v + (1 << (ax.shift - 1))) >> ax.shift
    return v + ax.offset


def _taps(
    fx: torch.Tensor, ax: GridAxis, mode: str, border: bool, bits: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(index, weight)`` per tap along one axis; indices clamped into range, weight 0 off the input."""
    one = 1 << bits
    if border:
        fx = fx.clamp(0, (ax.size - 1) << bits)
    if mode == "nearest":
        i = (fx + (one >> 1)) >> bits
        valid = (i >= 0) & (i < ax.size)
        return [(i.clamp(0, ax.size - 1), valid.to(torch.int64))]
    i0 = fx >> bits  # arithmetic shift: floor, also below 0
    w1 = fx - (i0 << bits)
    out = []
    for i, w in ((i0, one - w1), (i0 + 1, w1)):
        valid = (i >= 0) & (i < ax.size)
        out.append((i.clamp(0, ax.size - 1), torch.where(valid, w, 0)))
    return out


def grid_sample_int(
    q: torch.Tensor,
    grid: torch.Tensor,
    ax_x: GridAxis,
    ax_y: GridAxis,
    mode: str,
    padding_mode: str,
    bits: int,
) -> torch.Tensor:
    """Nearest: the selected codes (0 off the input, zeros padding), in ``q``'s dtype.
    Bilinear: the int64 accumulator ``sum w_y * w_x * q`` at ``s_in / 2**(2B)``."""
    n, c, h, w = q.shape
    if grid.dim() != 4 or grid.shape[0] != n or grid.shape[-1] != 2:
        raise ValueError(f"grid_sample: grid must be (N={n}, Ho, Wo, 2), got {tuple(grid.shape)}")
    ho, wo = int(grid.shape[1]), int(grid.shape[2])
    border = padding_mode == "border"
    tx = _taps(source_fixed(grid[..., 0], ax_x), ax_x, mode, border, bits)
    ty = _taps(source_fixed(grid[..., 1], ax_y), ax_y, mode, border, bits)
    flat = q.reshape(n, c, h * w).to(torch.int64)
    acc = torch.zeros(n, c, ho * wo, dtype=torch.int64)
    for iy, wy in ty:
        for ix, wx in tx:
            idx = (iy * w + ix).reshape(n, 1, ho * wo).expand(n, c, ho * wo)
            acc += torch.gather(flat, 2, idx) * (wy * wx).reshape(n, 1, ho * wo)
    acc = acc.reshape(n, c, ho, wo)
    return acc.to(q.dtype) if mode == "nearest" else acc
