"""Quantized Interpolate: nearest copies codes (exact); bilinear uses fixed-point weights.

Bilinear rule (docs/modules.md "Bilinear interpolation"): per axis, source indices and
weights ``w0 + w1 = 2**B`` (``B = 12`` for qint8 input, 15 for qint16) from
:func:`backends.common.integer_rules.bilinear_taps`; ``acc = sum w_y * w_x * q`` exactly in
int64 at scale ``s_in / 2**(2B)``; ``out = requantize(acc, M, k + 2B)`` with
``(M, k) = requant_params(s_in, s_out)``: the weights' ``2**-2B`` folds into the shift, so the
multiplier keeps its full precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import bilinear_taps, bilinear_weight_bits, check_out_dtype, resize_out_size
from qir.nn.qat.interpolate import Interpolate as QATInterpolate
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq

__all__ = ["Interpolate"]


def set_resample_scales(
    new: QuantizedModule, qat: nn.Module, input_scales: Sequence[Any], march: Any, what: str
) -> tuple[int, int] | None:
    """Scales of a resampling module (resize, grid sample): nearest copies codes and keeps the
    input scale (None); bilinear requantizes its weighted sum once to the QAT output scale, with
    the returned ``(multiplier, shift)``."""
    if qat.mode == "nearest":
        new._set_scales(input_scales, None, None)
        new.register_buffer("scale", new.input_scale_0.clone())
        return None
    fq = output_fq(qat)
    assert fq is not None
    new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
    mname = march_name(march)
    check_out_dtype(mname, fq.dtype, what)
    m, s = numerics.requant_params(new.per_tensor_input(0), float(new.scale[0]), mname, fq.dtype)
    return int(m), int(s)


class Interpolate(QuantizedModule):
    """Resize integer codes (N, C, H, W)."""

    derived: ClassVar[tuple[str, ...]] = ("multiplier", "shift")

    size: Any
    scale_factor: Any
    mode: str
    align_corners: bool | None
    recompute_scale_factor: bool | None
    multiplier: int
    shift: int

    def _out_size(self, h: int, w: int, size: Any = None) -> tuple[int, int, float | None, float | None]:
        """Output size and the scale factors the taps use; a run-time ``size`` wins (FPN's
        ``size=lateral.shape[2:]``)."""
        return resize_out_size(
            h, w, self.size if size is None else size, self.scale_factor, self.recompute_scale_factor
        )

    def forward(self, x: torch.Tensor, size: Any = None) -> torch.Tensor:
        if self.mode == "nearest":
            y = F.interpolate(
                x.to(torch.float64),
                size=self.size if size is None else size,
                scale_factor=self.scale_factor if size is None else None,
                mode="nearest",
                recompute_scale_factor=self.recompute_scale_factor if size is None else None,
            )
            return y.to(x.dtype)
        h, w = int(x.shape[-2]), int(x.shape[-1])
        oh, ow, fh, fw = self._out_size(h, w, size)
        bits = bilinear_weight_bits(x.dtype)
        ac = bool(self.align_corners)
        hi0, hi1, hw0, hw1 = bilinear_taps(h, oh, fh, ac, bits)
        wi0, wi1, ww0, ww1 = bilinear_taps(w, ow, fw, ac, bits)
        q = x.to(torch.int64)
        rows = q[..., hi0, :] * hw0[:, None] + q[..., hi1, :] * hw1[:, None]
        acc = rows[..., wi0] * ww0 + rows[..., wi1] * ww1
        assert self.dtype is not None
        return numerics.requantize(acc, self.multiplier, self.shift + 2 * bits, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> Interpolate:
        check_qat(cls, qat, QATInterpolate)
        assert isinstance(qat, QATInterpolate)
        new = cls()
        new.size, new.scale_factor, new.mode = qat.size, qat.scale_factor, qat.mode
        new.align_corners, new.recompute_scale_factor = qat.align_corners, qat.recompute_scale_factor
        params = set_resample_scales(new, qat, input_scales, march, "Interpolate")
        if params is not None:
            new.multiplier, new.shift = params
        return new


# ----------------------------------------------------------------------------- IR ops


def _from_qinterpolate(op: Any, tensors: dict[str, torch.Tensor]) -> Interpolate:
    """The Interpolate a ``qinterpolate`` op stands for: nearest keeps the input's scale and
    records no dtype; bilinear holds its output dtype, multiplier and shift."""
    m = Interpolate()
    m.size, m.scale_factor, m.mode = op.size, op.scale_factor, op.mode
    m.align_corners, m.recompute_scale_factor = op.align_corners, op.recompute_scale_factor
    if op.mode == "nearest":
        m._set_scales(op.in_scales, None, None)
        m.register_buffer("scale", m.input_scale_0.clone())
    else:
        m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
        m.multiplier, m.shift = int(op.multiplier), int(op.shift)
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_resize import QInterpolate

    register_integer_module(QInterpolate, Interpolate, _from_qinterpolate)


_register_ir()
