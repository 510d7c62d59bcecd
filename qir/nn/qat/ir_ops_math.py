"""The IR's QAT math ops for qir's QAT LayerNorm, Softmax, GLU, PReLU and Div: readers and builders.

The builders construct each module around the node's state tensors (shared, not copied): the
float ``weight`` / ``bias`` as parameters, every fake quant from its spec."""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.ops.qat import register_qat_module
from qir.ir.ops.qat_math import QATDiv, QATGlu, QATLayerNorm, QATPrelu, QATSoftmax
from qir.nn.qat.glu import GLU
from qir.nn.qat.ir_ops import _param, build_fake_quant, fake_quant_spec
from qir.nn.qat.misc import Div
from qir.nn.qat.normalization import LayerNorm
from qir.nn.qat.prelu import PReLU
from qir.nn.qat.softmax import Softmax

__all__: list[str] = []

_FQ = "activation_post_process"


def _out(m: Any, what: str) -> Any:
    return fake_quant_spec(m.activation_post_process, f"{what}.{_FQ}")


def _read_layer_norm(m: Any) -> QATLayerNorm:
    return QATLayerNorm(
        out_fq=_out(m, "LayerNorm"),
        normalized_shape=m.normalized_shape,
        eps=float(m.eps),
        elementwise_affine=m.weight is not None,
        has_bias=m.bias is not None,
    )


def _build_layer_norm(op: Any, tensors: dict[str, torch.Tensor]) -> LayerNorm:
    m = LayerNorm(op.normalized_shape, op.eps, None, None, build_fake_quant(op.out_fq, tensors, _FQ))
    if op.elementwise_affine:
        m.weight = _param(tensors["weight"])
    if op.has_bias:
        m.bias = _param(tensors["bias"])
    return m


def _read_softmax(m: Any) -> QATSoftmax:
    exp = fake_quant_spec(m.exp_post_process, "Softmax.exp_post_process")
    return QATSoftmax(out_fq=_out(m, "Softmax"), exp_fq=exp, dim=int(m.dim))


def _build_softmax(op: Any, tensors: dict[str, torch.Tensor]) -> Softmax:
    exp = build_fake_quant(op.exp_fq, tensors, "exp_post_process")
    return Softmax(op.dim, exp, build_fake_quant(op.out_fq, tensors, _FQ))


def _read_glu(m: Any) -> QATGlu:
    sig = fake_quant_spec(m.sigmoid_post_process, "GLU.sigmoid_post_process")
    return QATGlu(out_fq=_out(m, "GLU"), sigmoid_fq=sig, dim=int(m.dim))


def _build_glu(op: Any, tensors: dict[str, torch.Tensor]) -> GLU:
    sig = build_fake_quant(op.sigmoid_fq, tensors, "sigmoid_post_process")
    return GLU(op.dim, sig, build_fake_quant(op.out_fq, tensors, _FQ))


def _read_prelu(m: Any) -> QATPrelu:
    return QATPrelu(out_fq=_out(m, "PReLU"), num_parameters=int(m.num_parameters))


def _build_prelu(op: Any, tensors: dict[str, torch.Tensor]) -> PReLU:
    w = tensors["weight"]
    m = PReLU(torch.empty(w.shape, dtype=w.dtype, device="meta"), build_fake_quant(op.out_fq, tensors, _FQ))
    m.weight = _param(w)
    return m


def _build_div(op: Any, tensors: dict[str, torch.Tensor]) -> Div:
    m = Div()
    m.activation_post_process = build_fake_quant(op.out_fq, tensors, _FQ)
    return m


register_qat_module(QATLayerNorm, LayerNorm, _read_layer_norm, _build_layer_norm)
register_qat_module(QATSoftmax, Softmax, _read_softmax, _build_softmax)
register_qat_module(QATGlu, GLU, _read_glu, _build_glu)
register_qat_module(QATPrelu, PReLU, _read_prelu, _build_prelu)
register_qat_module(QATDiv, Div, lambda m: QATDiv(out_fq=_out(m, "Div")), _build_div)
