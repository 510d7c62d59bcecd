"""Quantized PReLU: two requantizations on codes, the slope folded into the negative side's multipliers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common.math_rules import PReLUParams, prelu_int, prelu_params
from qir.nn.qat.prelu import PReLU as QATPReLU
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq

__all__ = ["PReLU"]


class PReLU(QuantizedModule):
    """``q >= 0``: ``requant(q)`` for ``s_in / s_out``; ``q < 0``: ``requant(q)`` for ``slope[c] * s_in / s_out``
    (per channel along dim 1; signed multipliers). Buffers ``neg_multiplier`` / ``neg_shift``."""

    derived: ClassVar[tuple[str, ...]] = ("pos_multiplier", "pos_shift")

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.PReLU
    pos_multiplier: int
    pos_shift: int
    neg_multiplier: torch.Tensor
    neg_shift: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.dtype is not None
        c = self.neg_multiplier.numel()
        if c > 1 and (x.dim() < 2 or x.shape[1] != c):
            raise ValueError(f"PReLU: {c} slopes need an input with {c} channels on dim 1, got shape {tuple(x.shape)}")
        p = PReLUParams(self.pos_multiplier, self.pos_shift, self.neg_multiplier, self.neg_shift)
        return prelu_int(x, p, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> PReLU:
        check_qat(cls, qat, QATPReLU)
        assert isinstance(qat, QATPReLU)
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        p = prelu_params(new.per_tensor_input(0), float(new.scale[0]), qat.weight, march_name(march), fq.dtype)
        new.pos_multiplier, new.pos_shift = p.pos_multiplier, p.pos_shift
        new.register_buffer("neg_multiplier", p.neg_multiplier)
        new.register_buffer("neg_shift", p.neg_shift)
        return new

    def extra_repr(self) -> str:
        return f"num_parameters={self.neg_multiplier.numel()}, {super().extra_repr()}"


# ----------------------------------------------------------------------------- IR ops


def _from_qprelu(op: Any, tensors: dict[str, torch.Tensor]) -> PReLU:
    m = PReLU()
    m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
    m.pos_multiplier, m.pos_shift = int(op.pos_multiplier), int(op.pos_shift)
    m.register_buffer("neg_multiplier", tensors["neg_multiplier"])
    m.register_buffer("neg_shift", tensors["neg_shift"])
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_math import QPrelu

    register_integer_module(QPrelu, PReLU, _from_qprelu)


_register_ir()
