"""Integer FloatFunctional ops: what a converted model's ``self.ff.add(x, y)`` computes.

A converted FloatFunctional (``qir.nn.quantized.QFunctional``) holds the call site's input
scales and output scale; its methods requantize codes with integer multipliers and shifts
derived from them (docs/modules.md "FloatFunctional"). Each method family is one op here,
with the module's scales as attributes (``in_scales``, ``out``) and the method's literal
arguments as further attributes; the tensor arguments are the operands. There is no integer
state: the parameters follow from the scales (the lowering derives them with the same
functions the module uses).

Evaluating or emitting such an op calls the method on a QFunctional rebuilt from the
attributes and installed at the node's scope, so ``self.<scope>.<method>(...)`` survives a
round trip with the same state-dict keys (``input_scale_<i>``, ``scale``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs

from qir.ir.op import OP_REGISTRY, IRError, Op, register_op
from qir.ir.ops.integer import IntegerModuleOp
from qir.ir.types import DType, QuantSpec, TensorType, Type

__all__ = [
    "QAdd",
    "QAddScalar",
    "QCat",
    "QFunctionalOp",
    "QLutMethod",
    "QMatmul",
    "QMinMax",
    "QMul",
    "QMulScalar",
    "QReduce",
    "QTensorDiv",
]


def _floats(v: Any) -> tuple[float, ...]:
    return tuple(float(x) for x in v)


def _dims(v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


@attrs.frozen
class QFunctionalOp(IntegerModuleOp):
    """Base: ``method`` (one of ``ff_methods``), the call site's scales, the march."""

    #: the QFunctional methods this op stands for
    ff_methods: ClassVar[tuple[str, ...]] = ()
    legality_form: ClassVar[str] = "float_functional"
    #: tensor operands of the call (``QCat`` counts its list)
    tensor_inputs: ClassVar[int] = 1

    method: str
    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    march: str

    def __attrs_post_init__(self) -> None:
        if self.method not in self.ff_methods:
            raise IRError(f"{self.name}: method must be one of {self.ff_methods}, got {self.method!r}")
        if self.out.axis is not None:
            raise IRError(f"{self.name}: the output scale is per tensor, got axis {self.out.axis}")
        if len(self.in_scales) < self.scaled_inputs():
            raise IRError(
                f"{self.name}: {self.scaled_inputs()} tensor input(s) need as many input scales, got {self.in_scales}"
            )

    def num_inputs(self) -> int:
        return self.tensor_inputs

    def scaled_inputs(self) -> int:
        """Operands that are code tensors with an input scale (a run-time number has none)."""
        return self.num_inputs()

    def module_signature(self) -> Any:
        # one QFunctional serves every call site that shares its scales: emit installs it once
        return (QFunctionalOp, self.out, self.in_scales, self.march)

    def method_call(self, inputs: Sequence[Any]) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return self.method, tuple(inputs), {}

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        for t in operand_types[: self.scaled_inputs()]:
            if isinstance(t, TensorType) and t.dtype.is_float:
                raise IRError(f"op {self.name!r} takes integer codes, got {t}; quantize the input first")

    def float_op(self) -> Op | None:
        name, kwargs = self.float_form()
        cls: Callable[..., Op] | None = OP_REGISTRY.get(name)
        if cls is None:
            return None
        try:
            return cls(**kwargs)
        except (TypeError, ValueError, IRError):
            return None

    def float_form(self) -> tuple[str, dict[str, Any]]:
        """The float op name and attributes the tables describe this call as."""
        return self.method, {}

    @classmethod
    def from_call(cls, m: Any, method: str, bound: dict[str, Any]) -> tuple[QFunctionalOp, list[Any]]:
        """The op and its tensor operands for ``m.<method>(**bound)`` (bound: arguments by name)."""
        return cls(**cls.common(m, method), **cls.literals(bound)), cls.tensors(bound)

    @staticmethod
    def common(m: Any, method: str) -> dict[str, Any]:
        dtype: DType = m.dtype
        scale = m.scale.detach().reshape(-1)
        return {
            "method": method,
            "out": QuantSpec((float(scale[0]),), dtype),
            "in_scales": tuple(float(s.reshape(-1)[0]) for s in m.input_scales),
            "march": str(m.march),
        }

    @classmethod
    def literals(cls, bound: dict[str, Any]) -> dict[str, Any]:
        return {}

    @classmethod
    def tensors(cls, bound: dict[str, Any]) -> list[Any]:
        return [bound["x"], bound["y"]] if cls.tensor_inputs == 2 else [bound["x"]]


@register_op
@attrs.frozen
class QAdd(QFunctionalOp):
    """``add`` / ``add_relu`` / ``sub`` of two code tensors: both rescaled to the output with the
    integer add parameters, summed exactly, requantized (ReLU clamps after)."""

    name: ClassVar[str] = "qadd"
    ff_methods: ClassVar[tuple[str, ...]] = ("add", "add_relu", "sub")
    tensor_inputs: ClassVar[int] = 2

    def float_form(self) -> tuple[str, dict[str, Any]]:
        return ("sub" if self.method == "sub" else "add"), {}


@attrs.frozen
class _ScalarOp(QFunctionalOp):
    """``method(x, c)`` with a number ``c``: a literal (``scalar``) or, when ``scalar`` is None,
    a number computed at run time (``x * (1.0 / w)`` with ``w`` from a shape) as operand 1."""

    scalar: float | None = None

    def num_inputs(self) -> int:
        return 1 if self.scalar is not None else 2

    def scaled_inputs(self) -> int:
        return 1

    def method_call(self, inputs: Sequence[Any]) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        y = self.scalar if self.scalar is not None else inputs[1]
        return self.method, (inputs[0], y), {}

    def float_form(self) -> tuple[str, dict[str, Any]]:
        return ("add" if self.method == "add_scalar" else "mul"), {"other": self.scalar}

    @classmethod
    def literals(cls, bound: dict[str, Any]) -> dict[str, Any]:
        y = bound["y"]
        if isinstance(y, bool) or not isinstance(y, (int, float)):
            return {"scalar": None}  # a run-time number: an operand (checked by the front end)
        return {"scalar": float(y)}

    @classmethod
    def tensors(cls, bound: dict[str, Any]) -> list[Any]:
        y = bound["y"]
        return [bound["x"]] if isinstance(y, (int, float)) and not isinstance(y, bool) else [bound["x"], y]


@register_op
@attrs.frozen
class QAddScalar(_ScalarOp):
    """``add_scalar(x, c)``: ``c`` coded as ``±127`` at scale ``|c| / 127`` and added like a tensor."""

    name: ClassVar[str] = "qadd_scalar"
    ff_methods: ClassVar[tuple[str, ...]] = ("add_scalar",)


@register_op
@attrs.frozen
class QMul(QFunctionalOp):
    """``mul`` of two code tensors: the exact product requantized to the output."""

    name: ClassVar[str] = "qmul"
    ff_methods: ClassVar[tuple[str, ...]] = ("mul",)
    tensor_inputs: ClassVar[int] = 2


@register_op
@attrs.frozen
class QMulScalar(_ScalarOp):
    """``mul_scalar(x, c)``: ``x * ±127`` requantized from scale ``s_x * |c| / 127``."""

    name: ClassVar[str] = "qmul_scalar"
    ff_methods: ClassVar[tuple[str, ...]] = ("mul_scalar",)


@register_op
@attrs.frozen
class QMatmul(QFunctionalOp):
    """``matmul(x, y, x_trans, y_trans)``: exact integer product, requantized (or the qint32
    product at ``s_x * s_y`` when the call site has no output fake quant)."""

    name: ClassVar[str] = "qmatmul"
    ff_methods: ClassVar[tuple[str, ...]] = ("matmul",)
    tensor_inputs: ClassVar[int] = 2

    x_trans: bool = False
    y_trans: bool = False

    def method_call(self, inputs: Sequence[Any]) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return self.method, tuple(inputs), {"x_trans": self.x_trans, "y_trans": self.y_trans}

    def float_form(self) -> tuple[str, dict[str, Any]]:
        return "matmul", {}

    @classmethod
    def literals(cls, bound: dict[str, Any]) -> dict[str, Any]:
        return {"x_trans": bool(bound.get("x_trans", False)), "y_trans": bool(bound.get("y_trans", False))}


@register_op
@attrs.frozen
class QTensorDiv(QFunctionalOp):
    """``div`` of two code tensors with the integer division rule (``div_params``)."""

    name: ClassVar[str] = "qtensor_div"
    ff_methods: ClassVar[tuple[str, ...]] = ("div",)
    tensor_inputs: ClassVar[int] = 2

    def float_form(self) -> tuple[str, dict[str, Any]]:
        return "div", {}


@register_op
@attrs.frozen
class QCat(QFunctionalOp):
    """``cat`` / ``concat`` / ``concatenate`` / ``stack`` of ``count`` code tensors along ``dim``,
    each requantized to the output scale first (a copy when the scales are equal)."""

    name: ClassVar[str] = "qcat"
    ff_methods: ClassVar[tuple[str, ...]] = ("cat", "concat", "concatenate", "stack")

    count: int = 1
    dim: int = 0

    def num_inputs(self) -> int:
        return self.count

    def method_call(self, inputs: Sequence[Any]) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return self.method, (list(inputs),), {"dim": self.dim}

    def float_form(self) -> tuple[str, dict[str, Any]]:
        return ("stack" if self.method == "stack" else "cat"), {"dim": self.dim}

    @classmethod
    def literals(cls, bound: dict[str, Any]) -> dict[str, Any]:
        return {"count": len(bound["x"]), "dim": int(bound["dim"])}

    @classmethod
    def tensors(cls, bound: dict[str, Any]) -> list[Any]:
        return list(bound["x"])


@register_op
@attrs.frozen
class QMinMax(QFunctionalOp):
    """``maximum`` / ``minimum``: both inputs requantized to the output scale, then compared."""

    name: ClassVar[str] = "qminmax"
    ff_methods: ClassVar[tuple[str, ...]] = ("maximum", "minimum")
    tensor_inputs: ClassVar[int] = 2


@register_op
@attrs.frozen
class QReduce(QFunctionalOp):
    """``sum`` / ``mean`` over ``dim``: exact int64 sum, requantized (mean folds ``1 / n`` in)."""

    name: ClassVar[str] = "qreduce"
    ff_methods: ClassVar[tuple[str, ...]] = ("sum", "mean")

    dim: tuple[int, ...] | None = attrs.field(default=None, converter=_dims)
    keepdim: bool = False

    def method_call(self, inputs: Sequence[Any]) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        dim = None if self.dim is None else list(self.dim)
        return self.method, tuple(inputs), {"dim": dim, "keepdim": self.keepdim}

    def float_form(self) -> tuple[str, dict[str, Any]]:
        return self.method, {"dim": self.dim, "keepdim": self.keepdim}

    @classmethod
    def literals(cls, bound: dict[str, Any]) -> dict[str, Any]:
        return {"dim": bound.get("dim"), "keepdim": bool(bound.get("keepdim", False))}


@register_op
@attrs.frozen
class QLutMethod(QFunctionalOp):
    """``exp`` / ``ceil`` / ``floor`` of qint8 codes through a 256-entry table."""

    name: ClassVar[str] = "qlut_method"
    ff_methods: ClassVar[tuple[str, ...]] = ("exp", "ceil", "floor")
