"""Checks of values computed at run time before a kernel indexes or sizes with them.

The artifact loader checks every constant a kernel indexes with (a gather index constant, a
resize's index tables, a table's length against the code range) when it loads the file. A
value that arrives with the data (a gather index that is a model input, the batch index and
coordinates of RoI boxes, the level of each box) can only be checked when the kernel runs:
these helpers do it before the value is used, so a bad one is a :class:`DataError` naming the
kernel and the field, never a silently wrapped negative index, a garbage integer from a NaN,
or a loop sized by a forged coordinate.
"""

from __future__ import annotations

import torch

__all__ = ["DataError", "check_finite", "check_index"]


class DataError(ValueError):
    """A run-time value a kernel would index or size with is outside what it can use."""


def check_index(kernel: str, field: str, index: torch.Tensor, size: int) -> None:
    """Every entry of ``index`` is an integer in ``[0, size)`` (float entries must be whole numbers)."""
    if index.numel() == 0:
        return
    if index.is_floating_point():
        check_finite(kernel, field, index)
        if not bool(torch.equal(index, torch.floor(index))):
            bad = float(index[index != torch.floor(index)].reshape(-1)[0])
            raise DataError(f"{kernel}: {field} holds {bad!r}, not a whole number")
    lo, hi = int(index.min()), int(index.max())
    if lo < 0 or hi >= size:
        raise DataError(f"{kernel}: {field} holds {lo if lo < 0 else hi}, outside [0, {size})")


def check_finite(kernel: str, field: str, values: torch.Tensor) -> None:
    """Every entry of a float tensor is finite."""
    if values.is_floating_point() and values.numel() and not bool(torch.isfinite(values).all()):
        bad = float(values[~torch.isfinite(values)].reshape(-1)[0])
        raise DataError(f"{kernel}: {field} holds {bad}, not a finite number")
