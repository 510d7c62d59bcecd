"""Quantized GLU: a sigmoid table on the second half, an exact product with the first, one requantization."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import check_out_dtype
from qir.ir.types import DType
from qir.nn.qat.glu import GLU as QATGLU
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq

__all__ = ["GLU"]


class GLU(QuantizedModule):
    """``a, b = chunk(q, 2, dim)``; ``sig = table[b + 128]`` (``numerics.lut_int8`` of sigmoid at the
    QAT ``sigmoid_post_process`` scale); ``out = requant(a * sig)`` with ``conv_requant_params(s_in, s_sig, s_out)``."""

    derived: ClassVar[tuple[str, ...]] = ("multiplier", "shift")

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.GLU
    dim: int
    table: torch.Tensor
    sigmoid_scale: torch.Tensor
    sigmoid_dtype: DType
    multiplier: int
    shift: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.dtype is not None
        if x.dtype != torch.int8:
            raise NotImplementedError(
                "GLU: only qint8 input is implemented (a 256-entry sigmoid table); give the producer a qint8 qconfig"
            )
        a, b = x.chunk(2, dim=self.dim)
        sig = numerics.lut_apply(self.table, b)
        return numerics.requantize(a.to(torch.int64) * sig.to(torch.int64), self.multiplier, self.shift, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> GLU:
        check_qat(cls, qat, QATGLU)
        assert isinstance(qat, QATGLU)
        fq = output_fq(qat)
        assert fq is not None
        sig_fq = qat.sigmoid_post_process
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        mname = march_name(march)
        check_out_dtype(mname, fq.dtype, cls.__name__)
        check_out_dtype(mname, sig_fq.dtype, f"{cls.__name__} sigmoid")
        new.dim = qat.dim
        new.sigmoid_dtype = sig_fq.dtype
        new.register_buffer("sigmoid_scale", sig_fq.scale.detach().to(torch.float32).clone().reshape(1))
        s_in, s_sig, s_out = new.per_tensor_input(0), float(new.sigmoid_scale[0]), float(new.scale[0])
        with torch.no_grad():
            new.register_buffer("table", numerics.lut_int8(torch.sigmoid, s_in, s_sig, sig_fq.dtype))
        m, s = numerics.conv_requant_params(s_in, s_sig, s_out, mname, fq.dtype)
        new.multiplier, new.shift = int(m.reshape(-1)[0]), int(s.reshape(-1)[0])
        return new

    def extra_repr(self) -> str:
        return f"dim={self.dim}, {super().extra_repr()}"


# ----------------------------------------------------------------------------- IR ops


def _from_qglu(op: Any, tensors: dict[str, torch.Tensor]) -> GLU:
    m = GLU()
    m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
    m.dim, m.multiplier, m.shift = int(op.dim), int(op.multiplier), int(op.shift)
    m.sigmoid_dtype = op.sigmoid.dtype
    m.register_buffer("sigmoid_scale", torch.tensor([op.sigmoid.scale[0]], dtype=torch.float32))
    m.register_buffer("table", tensors["table"])
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_math import QGlu

    register_integer_module(QGlu, GLU, _from_qglu)


_register_ir()
