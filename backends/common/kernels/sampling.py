"""Grid-sample kernel on codes: fixed-point source coordinates from the grid codes, integer
bilinear (or nearest) taps, exact int64 sum, one requantization.

Coordinate parameters (multiplier, shift, offset per axis) are computed at lowering for the
compiled input size; the module library's rule is ``qir.nn.quantized._sampling_rules``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel, requant_i64, sat_to
from backends.common.program import Instruction


def _coords(g: torch.Tensor, m: int, s: int, off: int) -> torch.Tensor:
    """``round(g * m / 2**s) + off`` (half up), int64."""
    v = g.to(torch.int64) * m
    return (torch.bitwise_right_shift(v + (1 << s >> 1), s) if s else v) + off


def _axis(
    fx: torch.Tensor, size: int, bits: int, nearest: bool, border: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per tap: clamped index and weight (0 where the tap falls off the input)."""
    if border:
        fx = torch.clamp(fx, min=0, max=(size - 1) * (1 << bits))
    if nearest:
        idx = torch.div(fx + (1 << (bits - 1)), 1 << bits, rounding_mode="floor")
        inside = (idx >= 0) & (idx <= size - 1)
        return [(idx.clamp(0, size - 1), inside.long())]
    lo = torch.div(fx, 1 << bits, rounding_mode="floor")
    frac = fx - lo * (1 << bits)
    taps = []
    for idx, wt in ((lo, (1 << bits) - frac), (lo + 1, frac)):
        inside = (idx >= 0) & (idx <= size - 1)
        taps.append((idx.clamp(0, size - 1), wt * inside.long()))
    return taps


@register_kernel("grid_sample")
def grid_sample(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    x, grid = args
    a = inst.attrs
    h, w = (int(v) for v in a["in_size"])
    if (int(x.shape[-2]), int(x.shape[-1])) != (h, w):
        raise ValueError(
            f"grid_sample ({inst.source}): compiled for input size {h}x{w}, got {x.shape[-2]}x{x.shape[-1]}"
        )
    bits, nearest, border = int(a["bits"]), a["mode"] == "nearest", a["padding_mode"] == "border"
    mx, sx, ox = (int(v) for v in a["coord_x"])
    my, sy, oy = (int(v) for v in a["coord_y"])
    tx = _axis(_coords(grid[..., 0], mx, sx, ox), w, bits, nearest, border)
    ty = _axis(_coords(grid[..., 1], my, sy, oy), h, bits, nearest, border)
    n, c = int(x.shape[0]), int(x.shape[1])
    q = x.to(torch.int64)
    batch = torch.arange(n).reshape(n, 1, 1)
    acc = torch.zeros(n, c, int(grid.shape[1]), int(grid.shape[2]), dtype=torch.int64)
    for iy, wy in ty:
        for ix, wx in tx:
            # advanced indexing: (N, Ho, Wo) picks, channels last -> (N, C, Ho, Wo)
            picked = q.permute(0, 2, 3, 1)[batch, iy, ix].permute(0, 3, 1, 2)
            acc += picked * (wy * wx).unsqueeze(1)
    dt = str(a["out_dtype"])
    if nearest:
        return [sat_to(acc, dt)]
    out = requant_i64(acc, torch.tensor(int(a["multiplier"])), torch.tensor(int(a["shift"])), None)
    lo, hi = qbounds(dt)
    return [sat_to(out.clamp_(lo, hi), dt)]
