"""Quantized ReLU / ReLU6 (exact, scale-preserving) and table-lookup unary ops."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common import numerics
from backends.common.lut_segmented import full_table16, lut_int16
from qir.ir.table16 import LATEST
from qir.nn.qat.activation import ReLU as QATReLU
from qir.nn.qat.activation import ReLU6 as QATReLU6
from qir.nn.qat.activation import UnaryLUT as QATUnaryLUT
from qir.nn.quantized._base import QuantizedModule, check_qat, output_fq

__all__ = ["ReLU", "ReLU6", "UnaryLUT"]


class ReLU(QuantizedModule):
    """``max(q, 0)``: exact; the output keeps the input's scale and dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, min=0)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any = None) -> ReLU:
        check_qat(cls, qat, QATReLU)
        new = cls()
        new._set_scales(input_scales, None, None)
        new.register_buffer("scale", new.input_scale_0.clone())
        return new


class ReLU6(QuantizedModule):
    """``clamp(q, 0, round(6 / s_in))``: the input's scale and dtype are kept."""

    derived: ClassVar[tuple[str, ...]] = ("bound",)

    bound: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int64).clamp(0, self.bound).to(x.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any = None) -> ReLU6:
        check_qat(cls, qat, QATReLU6)
        new = cls()
        new._set_scales(input_scales, None, None)
        new.register_buffer("scale", new.input_scale_0.clone())
        new.bound = int(numerics.quantize(torch.tensor([6.0]), new.per_tensor_input(0), "qint32")[0])
        return new


#: per UnaryLUT: its table16 evaluated at every code, with the buffer and state it was built from
#: (outside the module's ``__dict__``, so pickles and state dicts stay as they were)
_FULL16: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, tuple[Any, ...], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


class UnaryLUT(QuantizedModule):
    """``f`` by table lookup: qint8 input through a 256-entry table (``numerics.lut_int8``),
    qint16 input through a segmented table of interpolated knots (``lut_segmented.lut_int16``).

    Both tables are built at conversion (the module does not know its input dtype before it
    runs); ``table16`` is empty when ``f`` is undefined (NaN) somewhere on the qint16 range at
    the input scale, and qint16 input is then refused. ``table16_version`` is the segmented
    table's format (:mod:`qir.ir.table16`): conversion builds the latest (2: knots placed by an
    error bound); a module saved before the version existed reads as 1 (513 uniform knots) and
    computes what it did. ``lut_int16`` measures the segmented table's worst error against
    ``f`` in output LSBs (docs/semantics.md "Table lookup").
    """

    resized_buffers: ClassVar[tuple[str, ...]] = ("table16",)
    table: torch.Tensor
    table16: torch.Tensor
    op_name: str
    #: the class default is the format of modules pickled before the version existed
    table16_version: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.int16:
            if self.table16.numel() == 0:
                raise NotImplementedError(
                    f"{self.op_name}: the function is undefined (NaN) on part of the qint16 input range at input "
                    f"scale {self.per_tensor_input(0):.6g}, so there is no segmented table; restrict the input range "
                    "or use a qint8 qconfig for the producer"
                )
            assert self.dtype is not None  # from_qat and the IR builder always set the tables' output dtype
            return self._full16().index_select(0, x.reshape(-1).to(torch.int64) + 32768).reshape(x.shape)
        if x.dtype != torch.int8:
            raise TypeError(f"{self.op_name}: table lookup takes qint8 or qint16 codes, got {x.dtype}")
        return numerics.lut_apply(self.table, x)

    def _full16(self) -> torch.Tensor:
        """``table16`` evaluated at every qint16 code (``full_table16``: exactly the interpolation), kept
        beside the module until the buffer is replaced or written in place, or the format or dtype changes."""
        t = self.table16
        key = (t._version, self.table16_version, self.dtype)
        kept = _FULL16.get(self)
        # the entry holds the buffer itself: an identity test cannot match a new tensor at a freed address
        if kept is not None and kept[0] is t and kept[1] == key:
            return kept[2]
        assert self.dtype is not None
        full = full_table16(t, self.dtype, self.table16_version)
        _FULL16[self] = (t, key, full)
        return full

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any = None) -> UnaryLUT:
        check_qat(cls, qat, QATUnaryLUT)
        assert isinstance(qat, QATUnaryLUT)
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        new.op_name = qat.op_name
        fn = qat.function()
        with torch.no_grad():
            table = numerics.lut_int8(fn, new.per_tensor_input(0), float(new.scale[0]), fq.dtype)
            try:
                entries = lut_int16(
                    fn, new.per_tensor_input(0), float(new.scale[0]), fq.dtype, measure=False, version=LATEST
                ).entries
            except ValueError:
                # f is undefined on part of the qint16 range at this scale (a qint8 producer's scale
                # reaches 256x further in qint16 codes): no segmented table; qint16 input is refused
                entries = torch.zeros(0, dtype=torch.int32)
        new.register_buffer("table", table)
        new.register_buffer("table16", entries)
        new.table16_version = LATEST
        return new

    def extra_repr(self) -> str:
        return f"op={self.op_name}, {super().extra_repr()}"


# ----------------------------------------------------------------------------- IR ops


def _same_scale(m: QuantizedModule, op: Any) -> None:
    """Input and output scale buffers of a scale-keeping module built from ``op``."""
    m._set_scales([op.out.scale[0]], None, None)
    m.register_buffer("scale", m.input_scale_0.clone())


def _from_qrelu(op: Any, tensors: dict[str, torch.Tensor]) -> ReLU:
    m = ReLU()
    _same_scale(m, op)
    return m


def _from_qrelu6(op: Any, tensors: dict[str, torch.Tensor]) -> ReLU6:
    m = ReLU6()
    _same_scale(m, op)
    m.bound = int(op.bound)
    return m


def _from_qlut(op: Any, tensors: dict[str, torch.Tensor]) -> UnaryLUT:
    m = UnaryLUT()
    m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
    m.op_name = op.function
    m.register_buffer("table", tensors["table"])
    m.register_buffer("table16", tensors["table16"])
    m.table16_version = int(op.table16_version)
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_codes import register_float_class
    from qir.ir.ops.integer_elementwise import QLut, QRelu, QRelu6
    from qir.nn.modules.unary import UNARY_MODULES

    register_integer_module(QRelu, ReLU, _from_qrelu)
    register_integer_module(QRelu6, ReLU6, _from_qrelu6)
    register_integer_module(QLut, UnaryLUT, _from_qlut)
    for name, cls in UNARY_MODULES.items():  # qir's own functions (Exp, Log, ...): checked as their module rows
        register_float_class(name, cls)


_register_ir()
