"""Quantized GridSample on codes: fixed-point source coordinates, integer bilinear weights, one requantization.

Rule: :mod:`backends.common.sampling_rules` (docs/semantics.md, "Grid sample"). Nearest
selects codes (scale and dtype kept; 0 off the input with zeros padding); bilinear sums
``w_y * w_x * q`` exactly in int64 at ``s_in / 2**(2B)`` and requantizes once with
``(M, k + 2B)``, ``(M, k) = requant_params(s_in, s_out)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common import numerics
from backends.common.sampling_rules import grid_axis, grid_sample_int
from passes.legality_facts import register_module_view
from qir.ir.ops.vision import GridSample as GridSampleOp
from qir.nn.qat.grid_sample import GRID_COORD_BITS
from qir.nn.qat.grid_sample import GridSample as QATGridSample
from qir.nn.quantized._base import QuantizedModule, check_qat
from qir.nn.quantized.interpolate import set_resample_scales

__all__ = ["GridSample"]


class GridSample(QuantizedModule):
    """``forward(x, grid)``: ``x`` (N, C, H, W) codes, ``grid`` (N, Ho, Wo, 2) qint8 / qint16 codes."""

    derived: ClassVar[tuple[str, ...]] = ("multiplier", "shift")

    num_inputs: ClassVar[int] = 2  # input and grid
    mode: str
    padding_mode: str
    align_corners: bool
    multiplier: int
    shift: int

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"GridSample: input must be (N, C, H, W), got shape {tuple(x.shape)}")
        if grid.is_floating_point():
            raise TypeError("GridSample: the grid must be integer codes (quantize it with a QuantStub)")
        bits = GRID_COORD_BITS
        s_g = self.per_tensor_input(1)
        ax_x = grid_axis(int(x.shape[-1]), s_g, self.align_corners, bits)
        ax_y = grid_axis(int(x.shape[-2]), s_g, self.align_corners, bits)
        out = grid_sample_int(x, grid, ax_x, ax_y, self.mode, self.padding_mode, bits)
        if self.mode == "nearest":
            return out
        assert self.dtype is not None
        return numerics.requantize(out, self.multiplier, self.shift + 2 * bits, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> GridSample:
        check_qat(cls, qat, QATGridSample)
        assert isinstance(qat, QATGridSample)
        new = cls()
        new.mode, new.padding_mode, new.align_corners = qat.mode, qat.padding_mode, qat.align_corners
        params = set_resample_scales(new, qat, input_scales, march, "GridSample")
        if params is not None:
            new.multiplier, new.shift = params
        return new

    def extra_repr(self) -> str:
        return (
            f"mode={self.mode!r}, padding_mode={self.padding_mode!r}, align_corners={self.align_corners}, "
            f"{super().extra_repr()}"
        )


def _legality_view(m: nn.Module) -> GridSampleOp | None:
    """qir's GridSample modules (float, QAT, integer) are checked as the ``F.grid_sample`` call."""
    from qir.nn.modules.grid_sample import GridSample as FloatGridSample

    if not isinstance(m, (FloatGridSample, GridSample)):
        return None
    return GridSampleOp(mode=m.mode, padding_mode=m.padding_mode, align_corners=m.align_corners)


register_module_view(_legality_view)


# ----------------------------------------------------------------------------- the IR's qgrid_sample op


def _from_qgrid_sample(op: Any, tensors: dict[str, torch.Tensor]) -> GridSample:
    m = GridSample()
    m.mode, m.padding_mode, m.align_corners = op.mode, op.padding_mode, bool(op.align_corners)
    if op.mode == "nearest":  # codes copied: the input's scale, the input's dtype
        m._set_scales(op.in_scales, None, None)
        m.register_buffer("scale", m.input_scale_0.clone())
    else:
        m._set_scales(op.in_scales, torch.tensor(op.out.scale), op.out.dtype)
        m.multiplier, m.shift = int(op.multiplier), int(op.shift)
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_sampling import QGridSample

    register_integer_module(QGridSample, GridSample, _from_qgrid_sample)


_register_ir()
