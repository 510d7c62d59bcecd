"""Integer elementwise layers: ReLU, ReLU6, Identity (scale kept), table lookups, Div.

* ``qrelu``: ``max(q, 0)``; ``qrelu6``: ``clamp(q, 0, bound)`` with ``bound = round(6 / s)``;
  ``qidentity``: the codes unchanged (an integer Identity, also what QAT Dropout converts to).
  All three keep the input's scale and dtype (:class:`~qir.ir.ops.integer_codes.SameScaleOp`).
* ``qlut``: a nonlinear function by table lookup: ``table[q + 128]`` (256 entries) for qint8
  codes, the segmented table ``table16`` (knots, interpolated; its format is
  ``table16_version``, :mod:`qir.ir.table16`) for qint16 codes; both are state operands,
  ``function`` names the float function (``"Sigmoid"``, ``"Exp"``) as the module records it.
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
from qir.ir.table16 import KNOTS_V1, check_table16_version, table16_problem, table16_shape_problem
from qir.ir.types import DType, QuantSpec, TensorType, Type

__all__ = ["KNOTS16", "QDiv", "QIdentity", "QLut", "QRelu", "QRelu6"]

#: knots of a version-1 qint16 segmented table: 8 segments x 64 intervals of 128 codes, plus the end knot
KNOTS16 = KNOTS_V1


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
    """``function`` by table lookup at the input and output scales (docs/semantics.md "Table
    lookup"): qint8 codes index the 256-entry ``table`` (``table[q + 128]``); qint16 codes
    interpolate between the knots of ``table16`` in format ``table16_version``
    (:mod:`qir.ir.table16`: 1, the 513 uniform knots, what text without the attribute holds;
    2, ``(2, n)`` knot codes and values placed by an error bound). ``table16`` is empty when
    the function is undefined (NaN) somewhere on the qint16 range at the input scale: such a
    layer takes qint8 codes only."""

    name: ClassVar[str] = "qlut"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    state_roles: ClassVar[tuple[str, ...]] = ("table", "table16")

    function: str
    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    table16_version: int = 1

    def __attrs_post_init__(self) -> None:
        check_table16_version(self.name, self.table16_version)
        if not self.function.isidentifier():
            raise IRError(f"qlut: function must name a function (an identifier), got {self.function!r}")
        if len(self.in_scales) != 1 or self.out.axis is not None:
            raise IRError(f"qlut: one per-tensor input and output scale, got {self.in_scales} and {self.out}")
        if self.out.dtype not in (DType.qint8, DType.qint16):
            raise IRError(f"qlut: a table holds qint8 or qint16 codes, got out dtype {self.out.dtype.name}")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return shaped_like(self.name, operand_types[0], self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        table, table16 = operand_types[1], operand_types[2]
        assert isinstance(table, TensorType) and isinstance(table16, TensorType)
        if table.shape != (256,) or table.dtype.is_float:
            raise IRError(f"qlut: table must hold 256 integer entries, got {table}")
        if table.dtype.to_torch() != self.out.dtype.to_torch():
            # the lookup returns the table's entries as they are: they are the output codes
            raise IRError(f"qlut: table entries are the output codes: out is {self.out.dtype.name}, table is {table}")
        problem = table16_shape_problem(table16.shape, self.table16_version)
        if problem is not None or table16.dtype.is_float or table16.dtype in (DType.bool, DType.qbool):
            raise IRError(f"qlut: {problem or 'table16 holds integers'}; got {table16}")
        dt = code_dtype(self.name, operand_types[0])
        if dt is DType.qint16 and table16.shape == (0,):
            raise IRError(
                f"qlut ({self.function}): qint16 input needs the segmented table16, which is empty: the function "
                f"is undefined (NaN) on part of the qint16 range at input scale {self.in_scales[0]:.6g}; use a "
                "qint8 qconfig for the producer or restrict the function's domain"
            )
        if dt not in (DType.qint8, DType.qint16):
            raise IRError(f"qlut: tables read qint8 or qint16 codes, got {operand_types[0]}")

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        if "table16" in state:
            problem = table16_problem(state["table16"], self.table16_version, self.out.dtype)
            if problem is not None:
                raise IRError(f"qlut ({self.function}): state operand table16: {problem}")

    def float_op(self) -> type | None:
        cls = float_class(self.function) or getattr(nn, self.function, None)
        return cls if isinstance(cls, type) else None

    @classmethod
    def from_module(cls, m: Any) -> QLut:
        return cls(
            function=str(m.op_name),
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=(per_tensor_scale(m, "input_scale_0"),),
            table16_version=int(m.table16_version),
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
