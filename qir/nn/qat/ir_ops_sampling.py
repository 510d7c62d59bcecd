"""The IR's ``qat_grid_sample`` op for qir's QAT GridSample: reader (module -> op) and builder."""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.ops.qat import register_qat_module
from qir.ir.ops.qat_sampling import QATGridSample
from qir.nn.qat.grid_sample import GridSample
from qir.nn.qat.ir_ops import build_fake_quant, fake_quant_spec

__all__: list[str] = []

_FQ = "activation_post_process"


def _read(m: Any) -> QATGridSample:
    apq = m.activation_post_process
    return QATGridSample(
        out_fq=None if apq is None else fake_quant_spec(apq, f"GridSample.{_FQ}"),
        mode=str(m.mode),
        padding_mode=str(m.padding_mode),
        align_corners=bool(m.align_corners),
    )


def _build(op: Any, tensors: dict[str, torch.Tensor]) -> GridSample:
    m = GridSample(op.mode, op.padding_mode, op.align_corners)
    m.activation_post_process = None if op.out_fq is None else build_fake_quant(op.out_fq, tensors, _FQ)
    return m


register_qat_module(QATGridSample, GridSample, _read, _build)
