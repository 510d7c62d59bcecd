"""Quantized MultiScaleRoIAlign: the level of each box from the float box, the integer RoIAlign rule on
that level's codes, each level's exact mean requantized to the one output scale.

Rule (docs/semantics.md, "MultiScaleRoIAlign"): for a box on level ``l`` (input scale ``s_l``),
``out = requantize(avg_l, M_l, k_l + 8)`` with ``(M_l, k_l) = requant_params(s_l, s_out)`` and
``avg_l`` RoIAlign's exact mean at ``s_l / 2**8``.
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
from qir.nn.qat.multi_scale_roi_align import MultiScaleRoIAlign as QATMultiScaleRoIAlign
from qir.nn.qat.multi_scale_roi_align import level_rows
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq

__all__ = ["MultiScaleRoIAlign"]


class MultiScaleRoIAlign(QuantizedModule):
    """``forward(x, boxes, image_shapes)``: ``x`` a dict of (N, C, H_l, W_l) codes (input scale ``i`` is
    the ``i``-th entry of ``x``), ``boxes`` float as torchvision takes them."""

    derived: ClassVar[tuple[str, ...]] = ("multipliers", "shifts")

    featmap_names: list[str]
    output_size: tuple[int, int]
    sampling_ratio: int
    canonical_scale: int
    canonical_level: int
    multipliers: list[int]
    shifts: list[int]
    num_inputs: ClassVar[int] = -1
    float_inputs: ClassVar[tuple[int, ...]] = (1,)

    def forward(
        self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor], image_shapes: list[tuple[int, int]]
    ) -> torch.Tensor:
        from qir.nn.qat.roi_align import roi_sample

        name = type(self).__name__
        if not isinstance(x, dict) or len(x) != len(self.multipliers):
            raise ValueError(
                f"{name}: x must be the dict of {len(self.multipliers)} quantized feature maps it was converted "
                f"with (one input scale per entry, in order), got {type(x).__name__} of {len(x)}"
            )
        params = [(m, s) for k, m, s in zip(x, self.multipliers, self.shifts, strict=True) if k in self.featmap_names]
        feats, rois, per_level = level_rows(self, x, boxes, image_shapes)
        for f in feats:
            if f.is_floating_point() or f.dim() != 4:
                raise ValueError(f"{name}: feature maps must be (N, C, H, W) integer codes, got {f.dtype}")
        ph, pw = self.output_size
        assert self.dtype is not None
        out = torch.zeros(int(rois.shape[0]), int(feats[0].shape[1]), ph, pw, dtype=self.dtype.to_torch())
        for f, (idx, fields), (mult, shift) in zip(feats, per_level, params, strict=True):
            if not idx.numel():
                continue
            q = f.to(torch.int64)
            rows = [
                torch.as_tensor(div_half_up(wy @ q[b] @ wx.T, count << (2 * ROI_BITS - ROI_MEAN_BITS)))
                for wy, wx, b, count in roi_sample(f, rois[idx], fields, name)
            ]
            out[idx] = numerics.requantize(torch.stack(rows), mult, shift + ROI_MEAN_BITS, self.dtype)
        return out

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> MultiScaleRoIAlign:
        check_qat(cls, qat, QATMultiScaleRoIAlign)
        assert isinstance(qat, QATMultiScaleRoIAlign)
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new.featmap_names, new.output_size = list(qat.featmap_names), qat.output_size
        new.sampling_ratio = qat.sampling_ratio
        new.canonical_scale, new.canonical_level = qat.canonical_scale, qat.canonical_level
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype, n=len(input_scales))
        mname = march_name(march)
        check_out_dtype(mname, fq.dtype, "MultiScaleRoIAlign")
        params = [
            numerics.requant_params(new.per_tensor_input(i), float(new.scale[0]), mname, fq.dtype)
            for i in range(len(input_scales))
        ]
        new.multipliers, new.shifts = [int(m) for m, _ in params], [int(s) for _, s in params]
        return new

    def extra_repr(self) -> str:
        return (
            f"featmap_names={self.featmap_names}, output_size={self.output_size}, "
            f"sampling_ratio={self.sampling_ratio}, canonical_scale={self.canonical_scale}, "
            f"canonical_level={self.canonical_level}, {super().extra_repr()}"
        )


def _legality_view(m: nn.Module) -> type | None:
    """qir's MultiScaleRoIAlign modules are checked against the ``torchvision.ops.MultiScaleRoIAlign``
    row when torchvision is loaded (qir never imports torchvision)."""
    from qir.nn.modules.multi_scale_roi_align import MultiScaleRoIAlign as FloatMultiScaleRoIAlign

    if not isinstance(m, (FloatMultiScaleRoIAlign, MultiScaleRoIAlign)):
        return None
    ops = sys.modules.get("torchvision.ops")
    cls = getattr(ops, "MultiScaleRoIAlign", None)
    return cls if isinstance(cls, type) else None


register_module_view(_legality_view)


# ----------------------------------------------------------------------------- the IR's qmulti_scale_roi_align op


def _from_qmulti_scale_roi_align(op: Any, tensors: dict[str, torch.Tensor]) -> MultiScaleRoIAlign:
    m = MultiScaleRoIAlign()
    m.featmap_names, m.output_size = list(op.featmap_names), tuple(op.output_size)
    m.sampling_ratio = int(op.sampling_ratio)
    m.canonical_scale, m.canonical_level = int(op.canonical_scale), int(op.canonical_level)
    m._set_scales(op.in_scales, torch.tensor(op.out.scale), op.out.dtype, n=len(op.in_scales))
    m.multipliers, m.shifts = list(op.multipliers), list(op.shifts)
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_sampling import QMultiScaleRoIAlign

    register_integer_module(QMultiScaleRoIAlign, MultiScaleRoIAlign, _from_qmulti_scale_roi_align)


_register_ir()
