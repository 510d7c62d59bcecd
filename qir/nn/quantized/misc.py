"""Quantized pass-through (Identity, also for Dropout) and Div."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common.integer_rules import check_out_dtype, div_int, div_params
from qir.nn.qat.misc import Div as QATDiv
from qir.nn.qat.misc import Dropout as QATDropout
from qir.nn.qat.misc import Identity as QATIdentity
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq

__all__ = ["Div", "Identity"]


class Identity(QuantizedModule):
    """Returns its input (codes and scale unchanged); QAT Identity and Dropout both convert to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any = None) -> Identity:
        check_qat(cls, qat, (QATIdentity, QATDropout))
        new = cls()
        new._set_scales(input_scales, None, None)
        new.register_buffer("scale", new.input_scale_0.clone())
        return new


class Div(QuantizedModule):
    """``x / y`` by exact integer division (:func:`backends.common.integer_rules.div_int`)."""

    derived: ClassVar[tuple[str, ...]] = ("multiplier", "shift")

    num_inputs = 2
    multiplier: int
    shift: int

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self.dtype is not None
        return div_int(x, y, self.multiplier, self.shift, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> Div:
        check_qat(cls, qat, QATDiv)
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        mname = march_name(march)
        check_out_dtype(mname, fq.dtype, cls.__name__)
        new.multiplier, new.shift = div_params(
            new.per_tensor_input(0), new.per_tensor_input(1), float(new.scale[0]), mname
        )
        return new


# ----------------------------------------------------------------------------- IR ops


def _from_qidentity(op: Any, tensors: dict[str, torch.Tensor]) -> Identity:
    m = Identity()
    m._set_scales([op.out.scale[0]], None, None)
    m.register_buffer("scale", m.input_scale_0.clone())
    return m


def _from_qdiv(op: Any, tensors: dict[str, torch.Tensor]) -> Div:
    m = Div()
    m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
    m.multiplier, m.shift = int(op.multiplier), int(op.shift)
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_codes import register_float_class
    from qir.ir.ops.integer_elementwise import QDiv, QIdentity
    from qir.nn.modules.binary import Div as FloatDiv

    register_integer_module(QIdentity, Identity, _from_qidentity)
    register_integer_module(QDiv, Div, _from_qdiv)
    register_float_class("Div", FloatDiv)  # the tables list qir.nn.Div; no IR op stands for it


_register_ir()
