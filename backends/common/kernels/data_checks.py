"""Checks of values computed at run time before a kernel indexes or sizes with them.

The artifact loader checks every constant a kernel indexes with (a gather index constant, a
resize's index tables, a table's length against the code range) when it loads the file. A
value that arrives with the data (a gather index that is a model input, the batch index and
coordinates of RoI boxes, the level of each box) can only be checked when the kernel runs:
these helpers do it before the value is used, so a bad one is a :class:`DataError` naming the
kernel and the field, never a silently wrapped negative index, a garbage integer from a NaN,
or a loop sized by a forged coordinate.

The converted modules of ``qir.nn.quantized`` (and their QAT forms, which sample with the same
integer rule) make the same checks with the same code (:func:`check_rois`), so a model and the
artifact compiled from it refuse the same boxes with the same message.
"""

from __future__ import annotations

import torch

from backends.common.numerics import round_half_up

__all__ = ["MAX_ROI_EXTENT", "DataError", "check_finite", "check_index", "check_rois"]


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


#: the widest box, in multiples of its feature map's size, an adaptive sampling ratio samples
#: (its samples per bin grow with the extent: a forged coordinate would size the loop)
MAX_ROI_EXTENT = 16


def check_rois(
    kernel: str, rois: torch.Tensor, spatial_scale: float, n: int, hw: tuple[int, int], sampling_ratio: int, bits: int
) -> torch.Tensor:
    """RoI boxes ``(K, 5)`` rows ``(batch index, x1, y1, x2, y2)`` before they index a feature map
    of ``n`` images of size ``hw``: finite coordinates, a batch index naming an image, corners at
    ``2**-bits`` (after ``spatial_scale``) exact in float64, and (an adaptive ``sampling_ratio``,
    whose samples per bin follow a box's extent) boxes at most :data:`MAX_ROI_EXTENT` map sizes
    wide. ``kernel`` names the kernel or module in the :class:`DataError`.

    Returns the corners ``(K, 4)`` as int64 at ``2**-bits``, rounded half up:
    ``round_half_up(f64(box) * f64(spatial_scale) * 2**bits)``, what the kernel and the QAT
    module sample at (computed once, here, where they are checked)."""
    check_finite(kernel, "the box coordinates", rois[:, 1:])
    check_index(kernel, "the box batch index (column 0 of the boxes)", rois[:, 0], n)
    fixed = rois[:, 1:].detach().to(torch.float64) * float(spatial_scale) * float(1 << bits)
    if not rois.numel():
        return fixed.to(torch.int64)
    if float(fixed.abs().max()) > 2**52:
        raise DataError(f"{kernel}: a box coordinate is beyond 2**52 / 2**bits feature-map pixels")
    if sampling_ratio <= 0:
        one = 1 << bits
        for (c0, c1), size, axis in (((0, 2), hw[1], "x"), ((1, 3), hw[0], "y")):
            extent = float((fixed[:, c1] - fixed[:, c0]).abs().max()) / one
            if extent > MAX_ROI_EXTENT * max(size, 1):
                raise DataError(
                    f"{kernel}: a box spans {extent:g} feature-map pixels along {axis}, over {MAX_ROI_EXTENT} times "
                    f"the size-{size} map: with an adaptive sampling ratio the samples per bin follow the box's "
                    "extent; clip the boxes to the image"
                )
    return round_half_up(fixed).to(torch.int64)
