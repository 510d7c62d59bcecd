"""The formats of a qint16 segmented table (``table16``) and the rules a table obeys.

A qint16 input has 65,536 codes: a nonlinear function of them is tabulated at knots and
interpolated linearly in between (docs/semantics.md "Table lookup"). Two formats, told apart by
an explicit version (the IR ops' ``table16_version``, the ``lut16`` kernel's ``version``, the
converted modules' ``table16_version``; absent means version 1, what files written before the
version existed hold):

* **version 1**: 513 int32 knot values at the uniform knots ``k_j = -32768 + 128 j`` (the last
  one, 32768, just past the range), each within ``±2**24`` (not saturated to the output dtype).
* **version 2**: a ``(2, n)`` int32 tensor: row 0 the knot codes, row 1 the knot values. The
  knots start at -32768, end at 32768 and increase strictly; every interval is a power of two
  codes wide (the interpolation divides by a shift); the values lie inside the output dtype's
  range. ``2 <= n <= 65537``.

An empty tensor (no segmented table: the function is undefined on part of the qint16 range)
is valid in either version. :func:`table16_problem` states the first rule a tensor breaks; the
verifier (``qlut``'s state check) and the artifact loader (``lut16``'s constant check) both ask
it, so a hostile table is refused with the same rule in both.
"""

from __future__ import annotations

import torch

from qir.ir.op import IRError
from qir.ir.types import DType

__all__ = [
    "KNOTS_V1",
    "LATEST",
    "MAX_KNOTS",
    "QMIN16",
    "SHIFT_V1",
    "VALUE_LIMIT_V1",
    "VERSIONS",
    "check_table16_version",
    "table16_problem",
    "table16_shape_problem",
]

#: the table formats this qir reads; tables it builds are :data:`LATEST`
VERSIONS = (1, 2)
LATEST = 2
#: version 1: 8 segments x 64 intervals of 2**7 codes, plus the knot past the range
SHIFT_V1 = 7
KNOTS_V1 = 8 * 64 + 1
#: version 1 knot values are clamped to +-2**24: (T[j+1] - T[j]) * r stays far inside int64
VALUE_LIMIT_V1 = 1 << 24
#: version 2: at most one knot per code, plus the knot past the range
MAX_KNOTS = (1 << 16) + 1
QMIN16 = -32768
_END = 32768


def check_table16_version(op: str, version: object) -> None:
    """``table16_version`` names a format this qir reads (:data:`qir.ir.table16.VERSIONS`)."""
    if type(version) is not int or version not in VERSIONS:
        raise IRError(
            f"{op}: table16_version must be one of {', '.join(map(str, VERSIONS))} (the segmented table formats "
            f"this qir reads), got {version!r} (written by a newer qir, or corrupted)"
        )


def table16_shape_problem(shape: tuple[int, ...], version: int) -> str | None:
    """The rule a ``table16`` of ``shape`` breaks in format ``version``, or None."""
    if version not in VERSIONS:
        return f"table16_version {version!r} is not one this qir reads ({', '.join(map(str, VERSIONS))})"
    if shape == (0,):
        return None  # no segmented table
    if version == 1:
        if shape != (KNOTS_V1,):
            return f"a version-1 table16 holds {KNOTS_V1} knot values, got shape {list(shape)}"
        return None
    if len(shape) != 2 or shape[0] != 2 or not 2 <= shape[1] <= MAX_KNOTS:
        return (
            f"a version-2 table16 is (2, n): knot codes and knot values, 2 <= n <= {MAX_KNOTS}; got shape {list(shape)}"
        )
    return None


def table16_problem(entries: torch.Tensor, version: int, out_dtype: DType) -> str | None:
    """The first rule the ``table16`` tensor ``entries`` breaks in format ``version`` with outputs in
    ``out_dtype`` (shape, integer dtype, knot order and spacing, value range), or None."""
    problem = table16_shape_problem(tuple(entries.shape), version)
    if problem is not None:
        return problem
    if entries.is_floating_point() or entries.is_complex() or entries.dtype == torch.bool:
        return f"table16 holds integers, got {entries.dtype}"
    if entries.numel() == 0:
        return None
    t = entries.to(torch.int64)
    if version == 1:
        bad = (t.abs() > VALUE_LIMIT_V1).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            return f"version-1 knot value {j} is {int(t[j])}, outside +-2**24"
        return None
    knots, values = t[0], t[1]
    if int(knots[0]) != QMIN16 or int(knots[-1]) != _END:
        return (
            f"the knot codes run from {QMIN16} to {_END} (the code past the range), got {int(knots[0])} to "
            f"{int(knots[-1])}"
        )
    widths = knots[1:] - knots[:-1]
    bad = (widths <= 0).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        return f"the knot codes increase strictly; knot {j + 1} ({int(knots[j + 1])}) follows {int(knots[j])}"
    bad = ((widths & (widths - 1)) != 0).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        return (
            f"every interval is a power of two codes wide; knots {j} and {j + 1} ({int(knots[j])}, "
            f"{int(knots[j + 1])}) are {int(widths[j])} apart"
        )
    lo, hi = out_dtype.qrange
    bad = ((values < lo) | (values > hi)).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        return f"knot value {j} is {int(values[j])}, outside the {out_dtype.name} output range [{lo}, {hi}]"
    return None
