"""Segmented lookup tables for qint16 inputs: 8 dense segments of 64 intervals, interpolated.

A qint16 input has 65,536 codes, too many for one table. The function is tabulated at 513
knots ``k_j = -32768 + 128 j`` (8 segments of 64 intervals of 128 codes, covering the whole
qint16 range, so no linear ends are needed) and interpolated linearly between knots, in
integer arithmetic (docs/semantics.md, "Table lookup"):

    d = q + 32768,  j = d >> 7,  r = d & 127
    y = saturate(T[j] + (((T[j+1] - T[j]) * r + 64) >> 7))

with ``>>`` the arithmetic (floor) shift, so the interpolation rounds half up, and knot
entries ``T[j] = clamp(floor(f(k_j * s_in) / s_out + 1/2), -2**24, 2**24)`` as int32 (``f`` in
float64; the last knot, code 32768, lies just past the range and is evaluated like the
others). Knots are not saturated to the output range: an interval that crosses the
saturation point interpolates toward the true value and saturates after. The error
against ``f(q * s_in) / s_out`` is at most 1 LSB (the rounding of the knots and of the
interpolation) plus the interpolation error of ``f`` over 128 codes,
``(128 s_in)**2 / 8 * max|f''| / s_out``; :func:`lut_int16` measures it over all 65,536
codes and keeps it in the table (``max_error_lsb``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from qir.ir.numerics import DTypeLike, qdtype, round_half_up
from qir.ir.types import DType

__all__ = [
    "KNOTS",
    "KNOT_LIMIT",
    "SEGMENTS",
    "SEGMENT_ENTRIES",
    "SHIFT",
    "SegmentedTable",
    "lut_int16",
    "lut_int16_apply",
]

SEGMENTS = 8
SEGMENT_ENTRIES = 64
#: log2 of the input codes per interval: 8 * 64 intervals of 2**7 codes cover 2**16 codes
SHIFT = 7
KNOTS = SEGMENTS * SEGMENT_ENTRIES + 1
#: knot entries are clamped to +-2**24: (T[j+1] - T[j]) * r stays far inside int64
KNOT_LIMIT = 1 << 24
_QMIN = -32768


class SegmentedTable(NamedTuple):
    """The 513 knot entries (int32) of a qint16-input table, its output dtype and its measured error."""

    entries: torch.Tensor
    out_dtype: DType
    max_error_lsb: float


def _ideal(fn: Callable[[torch.Tensor], torch.Tensor], s_in: float, s_out: float, codes: torch.Tensor) -> torch.Tensor:
    y = fn(codes.to(torch.float64) * s_in).to(torch.float64)
    if y.shape != codes.shape:
        raise ValueError(
            f"LUT function must be elementwise; got output shape {tuple(y.shape)} for {tuple(codes.shape)}"
        )
    if bool(torch.isnan(y).any()):
        raise ValueError("LUT function returned NaN on the qint16 input range; restrict its domain first")
    return y / s_out


def _evaluate(entries: torch.Tensor, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    t = entries.to(torch.int64)
    d = q.to(torch.int64) - _QMIN
    j = d >> SHIFT
    r = d & ((1 << SHIFT) - 1)
    return (t[j] + (((t[j + 1] - t[j]) * r + (1 << (SHIFT - 1))) >> SHIFT)).clamp(lo, hi)


def lut_int16(
    fn: Callable[[torch.Tensor], torch.Tensor],
    in_scale: float,
    out_scale: float,
    out_dtype: DTypeLike = "qint8",
    measure: bool = True,
) -> SegmentedTable:
    """The segmented table of ``fn`` for qint16 input at ``in_scale``, output at ``out_scale`` in ``out_dtype``;
    ``measure=False`` skips the error measurement over all 65,536 codes (``max_error_lsb`` is NaN)."""
    qd = qdtype(out_dtype)
    if qd not in (DType.qint8, DType.qint16):
        raise ValueError(f"LUT output dtype must be qint8 or qint16, got {qd.name}")
    lo, hi = qd.qrange
    s_in = float(torch.tensor(float(in_scale), dtype=torch.float32))
    s_out = float(torch.tensor(float(out_scale), dtype=torch.float32))
    knots = _QMIN + (torch.arange(KNOTS, dtype=torch.int64) << SHIFT)
    entries = round_half_up(_ideal(fn, s_in, s_out, knots)).clamp(-KNOT_LIMIT, KNOT_LIMIT).to(torch.int32)
    if not measure:
        return SegmentedTable(entries, qd, math.nan)
    codes = torch.arange(_QMIN, -_QMIN, dtype=torch.int64)
    ideal = _ideal(fn, s_in, s_out, codes).clamp(lo, hi)
    err = float((_evaluate(entries, codes, lo, hi).to(torch.float64) - ideal).abs().max())
    return SegmentedTable(entries, qd, err)


def lut_int16_apply(entries: torch.Tensor, q: torch.Tensor, out_dtype: DTypeLike) -> torch.Tensor:
    """Look up qint16 codes ``q`` in the knot ``entries`` of a :func:`lut_int16` table."""
    if entries.numel() != KNOTS:
        raise ValueError(f"a qint16 segmented table has {KNOTS} knot entries, got {entries.numel()}")
    qd = qdtype(out_dtype)
    lo, hi = qd.qrange
    return _evaluate(entries, q, lo, hi).to(qd.to_torch())
