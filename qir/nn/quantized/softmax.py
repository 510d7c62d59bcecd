"""Quantized Softmax: row maximum on codes, int16 exp table, exact int64 sum and division."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common.math_rules import SOFTMAX_MAX_LENGTH, softmax_exp_table, softmax_int, softmax_params
from qir.nn.qat.softmax import Softmax as QATSoftmax
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq

__all__ = ["Softmax"]


class Softmax(QuantizedModule):
    """``e = table[q - max(q) + 255]`` (int16, scale 1/32767), ``S = sum(e)``, ``out = round(e * M / (S * 2**k))``
    with ``M / 2**k ~ 1 / s_out`` (docs/semantics.md, "Softmax")."""

    derived: ClassVar[tuple[str, ...]] = ("multiplier", "shift")

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.Softmax
    dim: int
    table: torch.Tensor
    multiplier: int
    shift: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.dtype is not None
        if x.dtype != torch.int8:
            raise NotImplementedError(
                "Softmax: only qint8 input is implemented (a 256-entry exp table over q - max(q)); give the "
                "producer a qint8 qconfig"
            )
        if x.shape[self.dim] > SOFTMAX_MAX_LENGTH:
            raise ValueError(
                f"Softmax: {x.shape[self.dim]} entries along dim {self.dim}; the int32 sum takes at "
                f"most {SOFTMAX_MAX_LENGTH}"
            )
        return softmax_int(x, self.table, self.multiplier, self.shift, self.dim, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> Softmax:
        check_qat(cls, qat, QATSoftmax)
        assert isinstance(qat, QATSoftmax)
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        new.dim = qat.dim
        new.multiplier, new.shift = softmax_params(float(new.scale[0]), fq.dtype, march_name(march))
        with torch.no_grad():
            new.register_buffer("table", softmax_exp_table(new.per_tensor_input(0)))
        return new

    def extra_repr(self) -> str:
        return f"dim={self.dim}, {super().extra_repr()}"


# ----------------------------------------------------------------------------- IR ops


def _from_qsoftmax(op: Any, tensors: dict[str, torch.Tensor]) -> Softmax:
    m = Softmax()
    m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
    m.dim, m.multiplier, m.shift = int(op.dim), int(op.multiplier), int(op.shift)
    m.register_buffer("table", tensors["table"])
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_math import QSoftmax

    register_integer_module(QSoftmax, Softmax, _from_qsoftmax)


_register_ir()
