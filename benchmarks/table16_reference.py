"""The version-2 knot placement written the plain way: the reference the vectorised build
(``backends.common.lut_segmented``) is compared with, code by code (tests/nn/test_table16_build.py),
and timed against (benchmarks/table16_grid_cache.py).

It is the rule of docs/semantics.md "Table lookup" spelled out directly: the clamped ideal
``g = clamp(f(q s_in) / s_out)`` at the codes -32768 .. 32768, each aligned power-of-two interval's
bound ``w**2 / 8 * max|D2 g|`` computed level by level, the threshold the ``budget - 1``-th largest
bound (numpy's partition), the intervals above it split, the knot values ``floor(g + 1/2)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from qir.ir.numerics import qdtype, round_half_up

__all__ = ["reference_knots", "reference_table16"]

_QMIN = -32768
_CODES = 1 << 16
_LEVELS = 16


def reference_knots(g: torch.Tensor, budget: int) -> torch.Tensor:
    """The knot codes for ``g`` (65,537 values at the codes -32768 .. 32768) within ``budget`` intervals."""
    d2 = (g[2:] - 2 * g[1:-1] + g[:-2]).abs()
    slots = torch.cat([d2, d2.new_zeros(1)])
    bounds = []
    for level in range(1, _LEVELS + 1):
        slots = slots.view(-1, 2).amax(1)
        w = 1 << level
        bounds.append(slots * (w * w / 8))
    every = torch.cat(bounds)
    k = budget - 1
    n = every.numel()
    if k == 0:
        split = torch.zeros(n, dtype=torch.bool)
    elif k < n:
        threshold = float(np.partition(every.numpy(), n - k)[n - k])
        split = every > threshold
    else:
        split = every > 0
    mids = []
    offset = 0
    for level in range(1, _LEVELS + 1):
        w = 1 << level
        count = _CODES // w
        b = split[offset : offset + count].nonzero().reshape(-1)
        mids.append(_QMIN + b * w + w // 2)
        offset += count
    ends = torch.tensor([_QMIN, _QMIN + _CODES], dtype=torch.int64)
    return torch.cat([ends, *mids]).sort().values


def reference_table16(
    fn: Callable[[torch.Tensor], torch.Tensor], in_scale: float, out_scale: float, out_dtype: str, budget: int
) -> torch.Tensor:
    """The ``(2, n)`` int32 knots (codes, values) of ``fn``'s version-2 table at these scales."""
    lo, hi = qdtype(out_dtype).qrange
    s_in = float(torch.tensor(float(in_scale), dtype=torch.float32))
    s_out = float(torch.tensor(float(out_scale), dtype=torch.float32))
    codes = torch.arange(_QMIN, -_QMIN + 1, dtype=torch.int64)
    g = (fn(codes.to(torch.float64) * s_in).to(torch.float64) / s_out).clamp(lo, hi)
    knots = reference_knots(g, budget)
    return torch.stack([knots, round_half_up(g[knots - _QMIN])]).to(torch.int32)
