"""The IR's QAT pooling ops for qir's QAT pools: readers (module -> op) and builders (op -> module)."""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.ops.qat import register_qat_module
from qir.ir.ops.qat_pool import QATAdaptiveAvgPool2d, QATAvgPool2d, QATMaxPool2d
from qir.nn.qat.ir_ops import build_fake_quant, fake_quant_spec
from qir.nn.qat.pool import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d

__all__: list[str] = []

_FQ = "activation_post_process"


def _read_max(m: Any) -> QATMaxPool2d:
    return QATMaxPool2d(
        kernel_size=m.kernel_size, stride=m.stride, padding=m.padding, dilation=m.dilation, ceil_mode=bool(m.ceil_mode)
    )


def _build_max(op: Any, tensors: dict[str, torch.Tensor]) -> MaxPool2d:
    m = MaxPool2d(op.kernel_size, op.stride, op.padding, op.dilation, False, op.ceil_mode)
    m.activation_post_process = None
    return m


def _read_avg(m: Any) -> QATAvgPool2d:
    return QATAvgPool2d(
        out_fq=fake_quant_spec(m.activation_post_process, f"AvgPool2d.{_FQ}"),
        kernel_size=m.kernel_size,
        stride=m.stride,
        padding=m.padding,
        ceil_mode=bool(m.ceil_mode),
        count_include_pad=bool(m.count_include_pad),
        divisor_override=m.divisor_override,
    )


def _build_avg(op: Any, tensors: dict[str, torch.Tensor]) -> AvgPool2d:
    m = AvgPool2d(op.kernel_size, op.stride, op.padding, op.ceil_mode, op.count_include_pad, op.divisor_override)
    m.activation_post_process = build_fake_quant(op.out_fq, tensors, _FQ)
    return m


def _read_adaptive(m: Any) -> QATAdaptiveAvgPool2d:
    return QATAdaptiveAvgPool2d(
        out_fq=fake_quant_spec(m.activation_post_process, f"AdaptiveAvgPool2d.{_FQ}"), output_size=m.output_size
    )


def _build_adaptive(op: Any, tensors: dict[str, torch.Tensor]) -> AdaptiveAvgPool2d:
    m = AdaptiveAvgPool2d(op.output_size)
    m.activation_post_process = build_fake_quant(op.out_fq, tensors, _FQ)
    return m


register_qat_module(QATMaxPool2d, MaxPool2d, _read_max, _build_max)
register_qat_module(QATAvgPool2d, AvgPool2d, _read_avg, _build_avg)
register_qat_module(QATAdaptiveAvgPool2d, AdaptiveAvgPool2d, _read_adaptive, _build_adaptive)
