"""The IR's QAT activation ops for qir's QAT activations, Identity, Dropout and table lookups.

A table lookup's function module becomes ``function`` (its class name) and ``function_args`` (its
literal attributes, ``negative_slope`` of a LeakyReLU); the builder rebuilds it only from the
classes a ``UnaryLUT`` takes (torch's activations in ``LUT_FLOAT_CLASSES``, qir's unary modules),
never from an arbitrary name. A function module with other state keeps its layer an opaque call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qir.ir.ops.qat import register_qat_module
from qir.ir.ops.qat_activation import QATDropout, QATIdentity, QATLut, QATRelu, QATRelu6
from qir.nn.modules.unary import UNARY_MODULES
from qir.nn.qat.activation import LUT_FLOAT_CLASSES, ReLU, ReLU6, UnaryLUT
from qir.nn.qat.ir_ops import build_fake_quant, fake_quant_spec
from qir.nn.qat.misc import Dropout, Identity

__all__: list[str] = []

_FQ = "activation_post_process"
#: the function modules a table lookup is rebuilt from, by class name
_FUNCTIONS: dict[str, type[nn.Module]] = {**{c.__name__: c for c in LUT_FLOAT_CLASSES}, **UNARY_MODULES}
_LITERALS = (bool, int, float, str, type(None))


def _read_lut(m: Any) -> QATLut:
    fm = m.function_module
    name = type(fm).__name__
    if _FUNCTIONS.get(name) is not type(fm):
        raise NotImplementedError(f"UnaryLUT of {type(fm).__qualname__}: not a function module the IR can rebuild")
    fields = {k: v for k, v in vars(fm).items() if not k.startswith("_") and k != "training"}
    odd = [k for k, v in fields.items() if not isinstance(v, _LITERALS)]
    if odd:
        raise NotImplementedError(f"UnaryLUT of {name}: attribute(s) {odd} are not literals")
    return QATLut(
        out_fq=fake_quant_spec(m.activation_post_process, f"UnaryLUT({name}).{_FQ}"),
        function=name,
        function_args=tuple(sorted(fields.items())),
    )


def _build_lut(op: Any, tensors: dict[str, torch.Tensor]) -> UnaryLUT:
    cls = _FUNCTIONS.get(op.function)
    if cls is None:
        raise ValueError(
            f"qat_lut: unknown function {op.function!r}; the functions are {', '.join(sorted(_FUNCTIONS))}"
        )
    fm = cls()
    for k, v in op.function_args:
        if not hasattr(fm, k):
            raise ValueError(f"qat_lut: {op.function} has no attribute {k!r} (function_args)")
        setattr(fm, k, v)
    return UnaryLUT(fm, build_fake_quant(op.out_fq, tensors, _FQ))


def _build_dropout(op: Any, tensors: dict[str, torch.Tensor]) -> Dropout:
    return Dropout(op.p, getattr(nn, op.kind))


register_qat_module(QATRelu, ReLU, lambda m: QATRelu(), lambda op, t: ReLU())
register_qat_module(QATRelu6, ReLU6, lambda m: QATRelu6(), lambda op, t: ReLU6())
register_qat_module(QATIdentity, Identity, lambda m: QATIdentity(), lambda op, t: Identity())
register_qat_module(QATDropout, Dropout, lambda m: QATDropout(p=m.p, kind=m.kind.__name__), _build_dropout)
register_qat_module(QATLut, UnaryLUT, _read_lut, _build_lut)
