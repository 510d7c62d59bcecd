"""Segmented lookup tables for qint16 inputs: knots chosen by an error bound, interpolated.

A qint16 input has 65,536 codes, too many for one table. The function is tabulated at knots
and interpolated linearly between them in integer arithmetic (docs/semantics.md "Table
lookup"; the formats and their rules are :mod:`qir.ir.table16`). For codes ``q`` in the
interval ``[k_j, k_{j+1})`` of width ``2**s``:

    r = q - k_j
    y = saturate(T[j] + (((T[j+1] - T[j]) * r + (2**s >> 1)) >> s))

with ``>>`` the arithmetic (floor) shift, so the interpolation rounds half up.

* **Version 2** (what :func:`lut_int16` builds): the knots are the cut of a binary tree of
  aligned power-of-two intervals over the codes -32768 .. 32768. An interval of ``w`` codes
  interpolates ``g = clamp(f(q s_in) / s_out, qmin, qmax)`` within ``w**2 / 8 * max|D2 g|``
  LSB (``D2`` the second difference over its codes, the discrete form of ``h**2/8 max|f''|``);
  the intervals with the largest bound are split first, until the :data:`KNOT_BUDGET` is
  spent, so the knots are dense where ``f`` curves and sparse where it is straight or
  saturated. Knot values ``T = floor(g + 1/2)`` lie in the output range.
* **Version 1** (the original, still read): 513 uniform knots ``k_j = -32768 + 128 j``,
  ``T[j] = clamp(floor(f(k_j s_in) / s_out + 1/2), -2**24, 2**24)``.

Both are within 1 LSB of rounding (knot and step) plus the interval's interpolation bound of
``f(q * s_in) / s_out``; :func:`lut_int16` measures the error over all 65,536 codes and keeps it
in the table (``max_error_lsb``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from qir.ir.numerics import DTypeLike, qdtype, round_half_up
from qir.ir.table16 import KNOTS_V1, LATEST, QMIN16, SHIFT_V1, VALUE_LIMIT_V1, table16_shape_problem
from qir.ir.types import DType

__all__ = [
    "KNOTS",
    "KNOT_BUDGET",
    "KNOT_LIMIT",
    "SEGMENTS",
    "SEGMENT_ENTRIES",
    "SHIFT",
    "SegmentedTable",
    "full_table16",
    "lut_int16",
    "lut_int16_apply",
    "method_table16",
]

SEGMENTS = 8
SEGMENT_ENTRIES = 64
#: version 1: log2 of the input codes per interval (8 * 64 intervals of 2**7 codes cover 2**16 codes)
SHIFT = SHIFT_V1
#: version 1: the number of knots
KNOTS = KNOTS_V1
#: version 1 knot entries are clamped to +-2**24: (T[j+1] - T[j]) * r stays far inside int64
KNOT_LIMIT = VALUE_LIMIT_V1
#: version 2: at most this many intervals (knots - 1): the 513 values of version 1, plus the knot codes
KNOT_BUDGET = 512
_QMIN = QMIN16
_CODES = 1 << 16
_LEVELS = 16  # intervals of 2**1 .. 2**16 codes can be split


class SegmentedTable(NamedTuple):
    """The knots of a qint16-input table (``entries``: int32; version 1 the 513 knot values,
    version 2 a ``(2, n)`` tensor of knot codes and values), its output dtype, its measured
    error in output LSBs and its format version."""

    entries: torch.Tensor
    out_dtype: DType
    max_error_lsb: float
    version: int = LATEST


def _ideal(fn: Callable[[torch.Tensor], torch.Tensor], s_in: float, s_out: float, codes: torch.Tensor) -> torch.Tensor:
    x = (_CODES_F64 if codes is _ALL_CODES else codes.to(torch.float64)) * s_in
    y = fn(x).to(torch.float64)
    if y.shape != codes.shape:
        raise ValueError(
            f"LUT function must be elementwise; got output shape {tuple(y.shape)} for {tuple(codes.shape)}"
        )
    if bool(torch.isnan(y).any()):
        raise ValueError("LUT function returned NaN on the qint16 input range; restrict its domain first")
    return y / s_out


def _evaluate_v1(entries: torch.Tensor, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    t = entries.to(torch.int64)
    d = q.to(torch.int64) - _QMIN
    j = d >> SHIFT
    r = d & ((1 << SHIFT) - 1)
    return (t[j] + (((t[j + 1] - t[j]) * r + (1 << (SHIFT - 1))) >> SHIFT)).clamp(lo, hi)


def _log2_widths(knots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The widths of the intervals between ``knots`` (powers of two) and their log2: frexp's
    exponent of ``2**s`` is ``s + 1`` exactly (no float log2 and rounding)."""
    widths = knots[1:] - knots[:-1]
    return widths, torch.frexp(widths.to(torch.float64)).exponent.to(torch.int64) - 1


def _evaluate_v2(entries: torch.Tensor, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    knots, t = entries.to(torch.int64).unbind(0)
    widths, shifts = _log2_widths(knots)
    q = q.to(torch.int64).contiguous()
    j = torch.searchsorted(knots, q, right=True) - 1
    r = q - knots[j]
    step = ((t[j + 1] - t[j]) * r + (widths[j] >> 1)) >> shifts[j]
    return (t[j] + step).clamp(lo, hi)


def _uniform_knots(fn: Callable[[torch.Tensor], torch.Tensor], s_in: float, s_out: float) -> torch.Tensor:
    knots = _QMIN + (torch.arange(KNOTS, dtype=torch.int64) << SHIFT)
    return round_half_up(_ideal(fn, s_in, s_out, knots)).clamp(-KNOT_LIMIT, KNOT_LIMIT).to(torch.int32)


def _level_constants() -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """Where each level's intervals sit in the flat array of every interval's bound (level 1's
    32,768 intervals of 2 codes first, level 16's one interval last), each entry's ``w**2 / 8``
    and the code of each interval's middle (the knot its split adds)."""
    spans, factors, mids = [], [], []
    offset = 0
    for level in range(1, _LEVELS + 1):
        w = 1 << level
        n = _CODES // w
        spans.append((offset, n))
        factors.append(torch.full((n,), w * w / 8, dtype=torch.float64))
        mids.append(_QMIN + torch.arange(n, dtype=torch.int64) * w + w // 2)
        offset += n
    return spans, torch.cat(factors), torch.cat(mids)


# the codes -32768 .. 32768 (the range and the code past it), as int64 and float64, and the
# per-level layout: built once, every table build reads them
_ALL_CODES = torch.arange(_QMIN, -_QMIN + 1, dtype=torch.int64)
_CODES_F64 = _ALL_CODES.to(torch.float64)
_SPANS, _FACTORS, _MIDS = _level_constants()


def _bounded_knots(g: torch.Tensor, budget: int) -> torch.Tensor:
    """Knot codes for ``g`` (the clamped ideal at the codes -32768 .. 32768): split the aligned
    power-of-two intervals with the largest interpolation bound ``w**2 / 8 * max|D2 g|``.

    One pass per level over halving arrays (65,535 maxima in all, no loop over intervals), the
    threshold by selection, the knots as the middles of the split intervals."""
    # slot i of an interval starting at code c is the code c + 1 + i: its inner codes and its end
    slots = g.new_zeros(_CODES)
    d2 = slots[:-1]  # at the codes -32767 .. 32767: |g[i+1] - 2 g[i] + g[i-1]|, evaluated in that order
    torch.mul(g[1:-1], 2, out=d2)
    torch.sub(g[2:], d2, out=d2)
    d2.add_(g[:-2]).abs_()
    maxima = g.new_empty(_CODES - 1)
    below = slots
    for offset, n in _SPANS:  # the max over each interval of 2**level codes, from its halves'
        level = maxima[offset : offset + n]
        torch.maximum(below[0::2], below[1::2], out=level)
        below = level
    every = maxima.mul_(_FACTORS)  # w**2 / 8 is a power of two: the products are exact
    # a parent's bound is >= 4x its children's: every bound above the threshold has its parent
    # above it too, so the split intervals form a tree (ties at the threshold are not split)
    k = budget - 1
    n = every.numel()
    if k == 0:  # one interval: no split
        split = torch.zeros_like(every, dtype=torch.bool)
    elif k < n:
        # the k-th largest bound, by selection (linear time, exact: an element of ``every``)
        threshold = float(torch.kthvalue(every, n - k + 1).values)
        split = every > threshold
    else:
        split = every > 0
    ends = torch.tensor([_QMIN, _QMIN + _CODES], dtype=torch.int64)
    return torch.cat([ends, _MIDS[split]]).sort().values


def lut_int16(
    fn: Callable[[torch.Tensor], torch.Tensor],
    in_scale: float,
    out_scale: float,
    out_dtype: DTypeLike = "qint8",
    measure: bool = True,
    version: int = LATEST,
    budget: int = KNOT_BUDGET,
) -> SegmentedTable:
    """The segmented table of ``fn`` for qint16 input at ``in_scale``, output at ``out_scale`` in
    ``out_dtype``, in format ``version`` (2: knots by the error bound, at most ``budget``
    intervals; 1: the 513 uniform knots); ``measure=False`` skips the error measurement over all
    65,536 codes (``max_error_lsb`` is NaN)."""
    qd = qdtype(out_dtype)
    if qd not in (DType.qint8, DType.qint16):
        raise ValueError(f"LUT output dtype must be qint8 or qint16, got {qd.name}")
    if version not in (1, 2):
        raise ValueError(f"table16 version must be 1 or 2, got {version!r}")
    if not 1 <= budget <= _CODES:
        raise ValueError(f"the knot budget is 1 to {_CODES} intervals, got {budget}")
    lo, hi = qd.qrange
    s_in = float(torch.tensor(float(in_scale), dtype=torch.float32))
    s_out = float(torch.tensor(float(out_scale), dtype=torch.float32))
    codes = _ALL_CODES
    if version == 1:
        entries = _uniform_knots(fn, s_in, s_out)
        if not measure:
            return SegmentedTable(entries, qd, math.nan, 1)
        ideal = _ideal(fn, s_in, s_out, codes[:-1]).clamp(lo, hi)
        got = _evaluate_v1(entries, codes[:-1], lo, hi)
    else:
        g = _ideal(fn, s_in, s_out, codes).clamp_(lo, hi)
        knots = _bounded_knots(g, budget)
        values = round_half_up(g[knots - _QMIN])
        entries = torch.stack([knots, values]).to(torch.int32)
        if not measure:
            return SegmentedTable(entries, qd, math.nan, 2)
        ideal = g[:-1]
        got = _evaluate_v2(entries, codes[:-1], lo, hi)
    err = float((got.to(torch.float64) - ideal).abs().max())
    return SegmentedTable(entries, qd, err, version)


#: FloatFunctional's table methods: exp is interpolated within :data:`KNOT_BUDGET` intervals; ceil /
#: floor are step functions, exact only when every jump is its own interval: no budget (a flat
#: stretch stays one interval, each jump costs about 16 knots)
_METHOD_BUDGETS = {"exp": KNOT_BUDGET, "ceil": _CODES, "floor": _CODES}


def method_table16(
    method: str,
    fn: Callable[[torch.Tensor], torch.Tensor],
    in_scale: float,
    out_scale: float,
    out_dtype: DTypeLike,
    version: int,
) -> torch.Tensor | None:
    """The knots of ``FloatFunctional.<method>``'s qint16-input table (``exp`` / ``ceil`` / ``floor``),
    or None when the method has none in format ``version`` (ceil / floor: version 1's uniform
    knots interpolate across the jumps). Version 2's ceil / floor tables are exact: every code's
    result is ``round(f(q * s_in) / s_out)``, as the 256-entry table of qint8 codes."""
    if method not in _METHOD_BUDGETS:
        raise ValueError(f"{method!r} has no table; the table methods are {', '.join(_METHOD_BUDGETS)}")
    if method != "exp" and version == 1:
        return None
    budget = _METHOD_BUDGETS[method]
    return lut_int16(fn, in_scale, out_scale, out_dtype, measure=False, version=version, budget=budget).entries


def full_table16(entries: torch.Tensor, out_dtype: DTypeLike, version: int = LATEST) -> torch.Tensor:
    """The output code of every qint16 code through the knots ``entries`` (format ``version``): index
    ``q + 32768`` holds exactly what :func:`lut_int16_apply` gives for ``q``. Version 2 walks the
    intervals (each code's interval by construction, no search; numpy's ``>>`` on int64 is the
    arithmetic shift, as torch's)."""
    problem = table16_shape_problem(tuple(entries.shape), version)
    if problem is not None or entries.numel() == 0:
        raise ValueError(problem or "the table16 is empty: there is no segmented table to evaluate")
    qd = qdtype(out_dtype)
    lo, hi = qd.qrange
    codes = torch.arange(_QMIN, -_QMIN, dtype=torch.int64)
    if version == 1:
        return _evaluate_v1(entries, codes, lo, hi).to(qd.to_torch())
    # numpy: repeating each interval's constants over its codes is a few times cheaper than torch's
    # gathers at this size (65,536 codes, a table built on every scale change of a training step)
    knots, values = entries.to(torch.int64).unbind(0)
    k, t = knots.numpy(), values.numpy()
    widths, shifts = (a.numpy() for a in _log2_widths(knots))

    def along(a: np.ndarray) -> np.ndarray:  # each interval's value at each of its codes
        return np.repeat(a, widths)

    step = (along(np.diff(t)) * (codes.numpy() - along(k[:-1])) + along(widths >> 1)) >> along(shifts)
    return torch.from_numpy(np.clip(along(t[:-1]) + step, lo, hi)).to(qd.to_torch())


def lut_int16_apply(
    entries: torch.Tensor, q: torch.Tensor, out_dtype: DTypeLike, version: int = LATEST
) -> torch.Tensor:
    """Look up qint16 codes ``q`` in the knots ``entries`` of a :func:`lut_int16` table of format ``version``."""
    problem = table16_shape_problem(tuple(entries.shape), version)
    if problem is not None or entries.numel() == 0:
        raise ValueError(problem or "the table16 is empty: there is no segmented table to look qint16 codes up in")
    qd = qdtype(out_dtype)
    lo, hi = qd.qrange
    evaluate = _evaluate_v1 if version == 1 else _evaluate_v2
    return evaluate(entries, q, lo, hi).to(qd.to_torch())
