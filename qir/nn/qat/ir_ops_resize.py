"""The IR's ``qat_interpolate`` op for qir's QAT Interpolate: reader (module -> op) and builder."""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.ops.qat import register_qat_module
from qir.ir.ops.qat_resize import QATInterpolate
from qir.nn.qat.interpolate import Interpolate
from qir.nn.qat.ir_ops import build_fake_quant, fake_quant_spec

__all__: list[str] = []

_FQ = "activation_post_process"


def _read(m: Any) -> QATInterpolate:
    apq = m.activation_post_process
    return QATInterpolate(
        out_fq=None if apq is None else fake_quant_spec(apq, f"Interpolate.{_FQ}"),
        mode=str(m.mode),
        size=m.size,
        scale_factor=m.scale_factor,
        align_corners=m.align_corners,
        recompute_scale_factor=m.recompute_scale_factor,
    )


def _build(op: Any, tensors: dict[str, torch.Tensor]) -> Interpolate:
    m = Interpolate(op.size, op.scale_factor, op.mode, op.align_corners, op.recompute_scale_factor)
    m.activation_post_process = None if op.out_fq is None else build_fake_quant(op.out_fq, tensors, _FQ)
    return m


register_qat_module(QATInterpolate, Interpolate, _read, _build)
