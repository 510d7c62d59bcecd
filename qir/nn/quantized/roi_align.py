"""Quantized RoIAlign on codes: integer sampling weights, exact int64 sums, exact mean, one requantization.

Rule (docs/semantics.md, "RoIAlign"): ``acc = W_y @ q @ W_x^T`` at ``s_in / 2**(2B)``;
``avg = round_half_up(acc / (count * 2**(2B - 8)))`` exactly (at ``s_in / 2**8``); ``out =
requantize(avg, M, k + 8)`` with ``(M, k) = requant_params(s_in, s_out)``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import check_out_dtype
from backends.common.roi_rules import ROI_BITS, ROI_MEAN_BITS, div_half_up
from passes.legality_facts import register_module_view
from qir.nn.qat.roi_align import RoIAlign as QATRoIAlign
from qir.nn.qat.roi_align import roi_sample
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq

__all__ = ["RoIAlign"]


class RoIAlign(QuantizedModule):
    """``forward(x, boxes)``: ``x`` (N, C, H, W) codes, ``boxes`` float as torchvision takes them."""

    derived: ClassVar[tuple[str, ...]] = ("multiplier", "shift")

    output_size: tuple[int, int]
    spatial_scale: float
    sampling_ratio: int
    aligned: bool
    multiplier: int
    shift: int
    float_inputs: ClassVar[tuple[int, ...]] = (1,)

    def forward(self, input: torch.Tensor, boxes: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        if input.is_floating_point() or input.dim() != 4:
            raise ValueError(
                f"RoIAlign: input must be (N, C, H, W) integer codes, got {input.dtype} {tuple(input.shape)}"
            )
        per_roi = roi_sample(input, boxes, self)
        q = input.to(torch.int64)
        ph, pw = self.output_size
        outs: list[torch.Tensor] = []
        for wy, wx, b, count in per_roi:
            acc = wy @ q[b] @ wx.T
            outs.append(torch.as_tensor(div_half_up(acc, count << (2 * ROI_BITS - ROI_MEAN_BITS))))
        avg = torch.stack(outs) if outs else torch.zeros(0, input.shape[1], ph, pw, dtype=torch.int64)
        assert self.dtype is not None
        return numerics.requantize(avg, self.multiplier, self.shift + ROI_MEAN_BITS, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> RoIAlign:
        check_qat(cls, qat, QATRoIAlign)
        assert isinstance(qat, QATRoIAlign)
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new.output_size, new.spatial_scale = qat.output_size, qat.spatial_scale
        new.sampling_ratio, new.aligned = qat.sampling_ratio, qat.aligned
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        mname = march_name(march)
        check_out_dtype(mname, fq.dtype, "RoIAlign")
        m, s = numerics.requant_params(new.per_tensor_input(0), float(new.scale[0]), mname, fq.dtype)
        new.multiplier, new.shift = int(m), int(s)
        return new

    def extra_repr(self) -> str:
        return (
            f"output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
            f"sampling_ratio={self.sampling_ratio}, aligned={self.aligned}, {super().extra_repr()}"
        )


def _legality_view(m: nn.Module) -> type | None:
    """qir's RoIAlign modules are checked against the ``torchvision.ops.RoIAlign`` row, when
    torchvision is loaded (the row is looked up by that class; qir never imports torchvision)."""
    from qir.nn.modules.roi_align import RoIAlign as FloatRoIAlign

    if not isinstance(m, (FloatRoIAlign, RoIAlign)):
        return None
    ops = sys.modules.get("torchvision.ops")
    cls = getattr(ops, "RoIAlign", None)
    return cls if isinstance(cls, type) else None


register_module_view(_legality_view)


# ----------------------------------------------------------------------------- the IR's qroi_align op


def _from_qroi_align(op: Any, tensors: dict[str, torch.Tensor]) -> RoIAlign:
    m = RoIAlign()
    m.output_size, m.spatial_scale = tuple(op.output_size), float(op.spatial_scale)
    m.sampling_ratio, m.aligned = int(op.sampling_ratio), bool(op.aligned)
    m._set_scales(op.in_scales, torch.tensor(op.out.scale), op.out.dtype)
    m.multiplier, m.shift = int(op.multiplier), int(op.shift)
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_sampling import QRoIAlign

    register_integer_module(QRoIAlign, RoIAlign, _from_qroi_align)


_register_ir()
