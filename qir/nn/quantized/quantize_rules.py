"""The ``quantize`` pass's conversion rules for qir's QAT ops: each rebuilds the QAT module from
the op (``qir.nn.qat``'s builder, sharing the state tensors) and converts it with the integer
class's own ``from_qat``, so the pass and module-swapping ``convert_fx`` run the same arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from passes.quantize import register_quantize_rule
from qir.ir.op import ModuleOp
from qir.ir.ops.integer import QConv
from qir.ir.ops.integer_stubs import QDequantStub, QQuantStub
from qir.nn.quantized.conv import QUANTIZED_CONV_CLASSES
from qir.nn.quantized.stubs import DeQuantStub, QuantStub

__all__: list[str] = []


def _state(new: ModuleOp, q: Any) -> dict[str, torch.Tensor]:
    return {role: getattr(q, role) for role in new.param_roles()}


def _conv(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
    qat = op.to_module(tensors)
    q = QUANTIZED_CONV_CLASSES[type(qat)].from_qat(qat, list(scales), march)
    new = QConv.from_module(q)
    return new, _state(new, q)


def _quant_stub(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
    q = QuantStub.from_qat(op.to_module(tensors), [], march)
    new = QQuantStub.from_module(q)
    return new, _state(new, q)


def _dequant_stub(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
    q = DeQuantStub.from_qat(op.to_module(tensors), list(scales), march)
    new = QDequantStub.from_module(q)
    return new, _state(new, q)


register_quantize_rule("qat_conv", _conv)
register_quantize_rule("qat_quant_stub", _quant_stub)
register_quantize_rule("qat_dequant_stub", _dequant_stub)
