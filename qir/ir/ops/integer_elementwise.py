"""Integer elementwise layers: ReLU, ReLU6, Identity (scale kept), table lookups, Div.

* ``qrelu``: ``max(q, 0)``; ``qrelu6``: ``clamp(q, 0, bound)`` with ``bound = round(6 / s)``;
  ``qidentity``: the codes unchanged (an integer Identity, also what QAT Dropout converts to).
  All three keep the input's scale and dtype (:class:`~qir.ir.ops.integer_codes.SameScaleOp`).
* ``qlut``: ``table[q + 128]``, a 256-entry table of a nonlinear function for qint8 codes;
  the table is the state operand ``table``, ``function`` names the float function
  (``"Sigmoid"``, ``"Exp"``) as the module records it.
* ``qdiv``: ``x / y`` by exact integer division with the rule's multiplier and shift
  (docs/semantics.md "Division").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import elementwise as float_ops
from qir.ir.ops.integer import IntegerModuleOp, _floats
from qir.ir.ops.integer_codes import (
    SameScaleOp,
    check_int,
    check_scales,
    code_dtype,
    float_class,
    per_tensor_scale,
    same_scale_spec,
    shaped_like,
)
from qir.ir.types import DType, QuantSpec, TensorType, Type

__all__ = ["QDiv", "QIdentity", "QLut", "QRelu", "QRelu6"]


@register_op
@attrs.frozen
class QRelu(SameScaleOp):
    """``max(q, 0)`` on codes (exact)."""

    name: ClassVar[str] = "qrelu"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    def float_op(self) -> Op:
        return float_ops.Relu()

    @classmethod
    def from_module(cls, m: Any) -> QRelu:
        return cls(out=same_scale_spec(m))


@register_op
@attrs.frozen
class QRelu6(SameScaleOp):
    """``clamp(q, 0, bound)``, ``bound`` the code of 6.0 at the input scale."""

    name: ClassVar[str] = "qrelu6"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    bound: int = 0

    def __attrs_post_init__(self) -> None:
        check_int(self.name, "bound", self.bound, 0, 2**31 - 1)

    def float_op(self) -> Op:
        return float_ops.Relu6()

    @classmethod
    def from_module(cls, m: Any) -> QRelu6:
        return cls(out=same_scale_spec(m), bound=int(m.bound))


@register_op
@attrs.frozen
class QIdentity(SameScaleOp):
    """The codes unchanged (integer Identity; QAT Identity and Dropout convert to it)."""

    name: ClassVar[str] = "qidentity"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    def float_op(self) -> type:
        return nn.Identity

    @classmethod
    def from_module(cls, m: Any) -> QIdentity:
        return cls(out=same_scale_spec(m))


@register_op
@attrs.frozen
class QLut(IntegerModuleOp):
    """``table[q + 128]`` for qint8 codes: one 256-entry table of ``function`` at the input and
    output scales (docs/semantics.md "Table lookup")."""

    name: ClassVar[str] = "qlut"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    state_roles: ClassVar[tuple[str, ...]] = ("table",)

    function: str
    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)

    def __attrs_post_init__(self) -> None:
        if not self.function.isidentifier():
            raise IRError(f"qlut: function must name a function (an identifier), got {self.function!r}")
        if len(self.in_scales) != 1 or self.out.axis is not None:
            raise IRError(f"qlut: one per-tensor input and output scale, got {self.in_scales} and {self.out}")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return shaped_like(self.name, operand_types[0], self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        if code_dtype(self.name, operand_types[0]) is not DType.qint8:
            raise IRError(
                f"qlut: one 256-entry table reads qint8 codes, got {operand_types[0]} (qint16 input needs "
                "segmented tables, not implemented)"
            )
        table = operand_types[1]
        assert isinstance(table, TensorType)
        if table.shape != (256,) or table.dtype.is_float:
            raise IRError(f"qlut: table must hold 256 integer entries, got {table}")

    def float_op(self) -> type | None:
        cls = float_class(self.function) or getattr(nn, self.function, None)
        return cls if isinstance(cls, type) else None

    @classmethod
    def from_module(cls, m: Any) -> QLut:
        return cls(
            function=str(m.op_name),
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=(per_tensor_scale(m, "input_scale_0"),),
        )


@register_op
@attrs.frozen
class QDiv(IntegerModuleOp):
    """``x / y`` on codes by exact integer division: ``multiplier`` / ``shift`` fold
    ``s_x / (s_y * s_out)`` (docs/semantics.md "Division")."""

    name: ClassVar[str] = "qdiv"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "other")

    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    multiplier: int = 1
    shift: int = 0

    def __attrs_post_init__(self) -> None:
        if len(self.in_scales) != 2 or self.out.axis is not None:
            raise IRError(f"qdiv: two per-tensor input scales and a per-tensor out, got {self.in_scales}, {self.out}")
        check_int(self.name, "multiplier", self.multiplier, -(2**31) + 1, 2**31 - 1)
        check_int(self.name, "shift", self.shift, 0, 62)

    def num_inputs(self) -> int:
        return 2

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        self.verify_(operand_types)  # the inputs must broadcast
        x, y = operand_types[:2]
        assert isinstance(x, TensorType) and isinstance(y, TensorType)
        return TensorType(tuple(torch.broadcast_shapes(x.shape, y.shape)), self.out.dtype, self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        x, y = operand_types[:2]
        for t in (x, y):
            code_dtype(self.name, t)
        assert isinstance(x, TensorType) and isinstance(y, TensorType)
        try:
            torch.broadcast_shapes(x.shape, y.shape)
        except RuntimeError:
            raise IRError(f"qdiv: input shapes {x.shape} and {y.shape} do not broadcast") from None

    def float_op(self) -> type | None:
        return float_class("Div")

    @classmethod
    def from_module(cls, m: Any) -> QDiv:
        return cls(
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=(per_tensor_scale(m, "input_scale_0"), per_tensor_scale(m, "input_scale_1")),
            multiplier=int(m.multiplier),
            shift=int(m.shift),
        )
