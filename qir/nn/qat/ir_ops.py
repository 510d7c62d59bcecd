"""The IR's QAT ops for qir's QAT modules: readers (module -> op) and builders (op -> module).

``qir.ir.ops.qat`` defines ``qat_conv``, ``qat_quant_stub`` and ``qat_dequant_stub`` without
naming a module class (``qir.ir`` sits below ``qir.nn``); importing :mod:`qir.nn.qat` registers
here which classes each op is read from and how a module is rebuilt from an op and its state
tensors. A fake quant becomes a :class:`~qir.ir.ops.qat.FakeQuantSpec` when its class and its
observer's class are ones qir knows by name (:data:`OBSERVER_KINDS`); any other (a learnable
scale, a user observer) keeps its module an opaque call, with the reason in the node's note.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qir.ir.ops.qat import QATConv, QATDequantStub, QATQuantStub, register_qat_module
from qir.nn.qat.conv import QAT_CONV_CLASSES, QATConvBase
from qir.nn.qat.stubs import DeQuantStub, QuantStub
from qir.quantization.fake_quant_ir import OBSERVER_KINDS, build_fake_quant, fake_quant_factory, fake_quant_spec
from qir.quantization.qconfig import QConfig

__all__ = ["OBSERVER_KINDS", "build_fake_quant", "fake_quant_factory", "fake_quant_spec"]

# ----------------------------------------------------------------------------- conv / linear

_KIND = {nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d", nn.ConvTranspose2d: "conv_transpose2d"}
_KIND[nn.Linear] = "linear"
_TORCH = {v: k for k, v in _KIND.items()}


def _read_conv(m: Any) -> QATConv:
    kind = _KIND[m.float_conv]
    apq = m.activation_post_process
    common: dict[str, Any] = {
        "weight_fq": fake_quant_spec(m.weight_fake_quant, f"{type(m).__name__}.weight_fake_quant"),
        "out_fq": None if apq is None else fake_quant_spec(apq, f"{type(m).__name__}.activation_post_process"),
        "bias": m.bias is not None,
        "add": bool(m.has_add),
        "act": m.act,
    }
    if kind == "linear":
        return QATConv(kind=kind, in_channels=m.in_features, out_channels=m.out_features, **common)
    if m.padding_mode != "zeros" and kind == "conv_transpose2d":
        raise NotImplementedError("a conv transpose pads with zeros only")
    return QATConv(
        kind=kind,
        in_channels=m.in_channels,
        out_channels=m.out_channels,
        kernel_size=m.kernel_size,
        stride=m.stride,
        padding=m.padding,
        dilation=m.dilation,
        groups=m.groups,
        output_padding=m.output_padding if kind == "conv_transpose2d" else None,
        padding_mode=m.padding_mode,
        **common,
    )


def _param(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=t.is_floating_point())


def _build_conv(op: Any, tensors: dict[str, torch.Tensor]) -> QATConvBase:
    cls = QAT_CONV_CLASSES[(_TORCH[op.kind], op.add, op.act)]
    out_factory = None if op.out_fq is None else fake_quant_factory(op.out_fq)
    qc = QConfig(activation=out_factory, weight=fake_quant_factory(op.weight_fq))
    kw: dict[str, Any] = {"bias": op.bias, "device": "meta", "qconfig": qc}
    if op.kind == "linear":
        m: Any = cls(op.in_channels, op.out_channels, **kw)
    else:
        kw.update(stride=op.stride, padding=op.padding, dilation=op.dilation, groups=op.groups)
        if op.kind == "conv_transpose2d":
            kw["output_padding"] = op.output_padding
        else:
            kw["padding_mode"] = op.padding_mode
        m = cls(op.in_channels, op.out_channels, op.kernel_size, **kw)
    m.weight = _param(tensors["weight"])
    if op.bias:
        m.bias = _param(tensors["bias"])
    m.weight_fake_quant = build_fake_quant(op.weight_fq, tensors, "weight_fake_quant")
    if op.out_fq is not None:
        m.activation_post_process = build_fake_quant(op.out_fq, tensors, "activation_post_process")
    return m  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- stubs


def _read_quant_stub(m: Any) -> QATQuantStub:
    return QATQuantStub(out_fq=fake_quant_spec(m.activation_post_process, "QuantStub.activation_post_process"))


def _build_quant_stub(op: Any, tensors: dict[str, torch.Tensor]) -> QuantStub:
    fq = build_fake_quant(op.out_fq, tensors, "activation_post_process")
    return QuantStub(fq, QConfig(activation=fake_quant_factory(op.out_fq)))


def _read_dequant_stub(m: Any) -> QATDequantStub:
    return QATDequantStub()


def _build_dequant_stub(op: Any, tensors: dict[str, torch.Tensor]) -> DeQuantStub:
    return DeQuantStub()


def _register() -> None:
    for cls in QAT_CONV_CLASSES.values():
        register_qat_module(QATConv, cls, _read_conv, _build_conv)
    register_qat_module(QATQuantStub, QuantStub, _read_quant_stub, _build_quant_stub)
    register_qat_module(QATDequantStub, DeQuantStub, _read_dequant_stub, _build_dequant_stub)


_register()
