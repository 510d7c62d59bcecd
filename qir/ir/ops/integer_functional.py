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
import torch

from qir.ir.op import OP_REGISTRY, IRError, Op, register_op
from qir.ir.ops.integer import IntegerModuleOp, _floats
from qir.ir.ops.integer_codes import check_march, check_scales, code_dtype
from qir.ir.ops.integer_probe import probe
from qir.ir.table16 import check_table16_version
from qir.ir.types import DType, QuantSpec, ScalarType, TensorType, Type

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
        check_march(self.name, self.march)
        if self.out.dtype is DType.qint32 and self.method != "matmul":
            raise IRError(f"{self.name}: only matmul has a qint32 output; {self.method} needs qint8 / qint16")

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
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        for t in operand_types[: self.scaled_inputs()]:
            code_dtype(self.name, t)
        for t in operand_types[self.scaled_inputs() :]:  # a number computed at run time
            if not isinstance(t, ScalarType) or t.kind not in ("int", "float"):
                raise IRError(f"op {self.name!r}: the number operand must be an int or a float, got {t}")
        self.infer_type(operand_types)
        # the requantization parameters the module derives from the scales (their limits per
        # march and dtype) are the module's own code: run it on zero codes where that is cheap
        probe(self, operand_types)

    def probe_dims(self, operand_types: Sequence[Type]) -> list[tuple[int, ...]]:
        """Per operand, the dimensions whose sizes the module's parameter rules read: the verify
        probe keeps them and shrinks the rest (:mod:`qir.ir.ops.integer_probe`). None here."""
        return [() for _ in operand_types]

    def result_shape(self, inputs: Sequence[torch.Tensor]) -> Sequence[int]:
        """The result shape from meta tensors of the code operands (elementwise: broadcast)."""
        return torch.broadcast_shapes(*(t.shape for t in inputs))

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        metas = []
        for t in operand_types[: self.scaled_inputs()]:
            if not isinstance(t, TensorType):
                raise IRError(f"op {self.name!r} takes tensors of codes, got {t}")
            metas.append(torch.empty(t.shape, dtype=torch.int64, device="meta"))
        try:
            shape = self.result_shape(metas)
        except (RuntimeError, IndexError, ValueError, TypeError) as e:
            raise IRError(f"op {self.name!r} ({self.method}) rejects its operand shapes: {e}") from None
        return self.result_type(shape)

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

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.scalar is not None and (
            isinstance(self.scalar, bool) or not isinstance(self.scalar, (int, float)) or not abs(self.scalar) < 2**62
        ):
            raise IRError(
                f"{self.name}: scalar must be a finite number (or None for a run-time operand), got {self.scalar!r}"
            )

    def num_inputs(self) -> int:
        return 1 if self.scalar is not None else 2

    def result_shape(self, inputs: Sequence[torch.Tensor]) -> Sequence[int]:
        return inputs[0].shape

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

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not isinstance(self.x_trans, bool) or not isinstance(self.y_trans, bool):
            raise IRError(f"qmatmul: x_trans / y_trans must be booleans, got {self.x_trans!r}, {self.y_trans!r}")

    def result_shape(self, inputs: Sequence[torch.Tensor]) -> Sequence[int]:
        x, y = inputs
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(f"both operands need at least 2 dimensions, got {tuple(x.shape)} and {tuple(y.shape)}")
        xs = x.transpose(-2, -1) if self.x_trans else x
        ys = y.transpose(-2, -1) if self.y_trans else y
        return torch.matmul(xs, ys).shape

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

    def __attrs_post_init__(self) -> None:
        for name in ("count", "dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise IRError(f"qcat: {name} must be an integer, got {v!r}")
        if not 1 <= self.count <= 65536:
            raise IRError(f"qcat: count must be in [1, 65536], got {self.count}")
        super().__attrs_post_init__()

    def num_inputs(self) -> int:
        return self.count

    def result_shape(self, inputs: Sequence[torch.Tensor]) -> Sequence[int]:
        return (torch.stack if self.method == "stack" else torch.cat)(list(inputs), dim=self.dim).shape

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

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not isinstance(self.keepdim, bool):
            raise IRError(f"qreduce: keepdim must be a boolean, got {self.keepdim!r}")

    def probe_dims(self, operand_types: Sequence[Type]) -> list[tuple[int, ...]]:
        """``mean`` folds ``1 / n`` into its multiplier, ``n`` the elements it reduces: the reduced
        dimensions keep their sizes."""
        dims: list[tuple[int, ...]] = [() for _ in operand_types]
        x = operand_types[0] if operand_types else None
        if self.method == "mean" and isinstance(x, TensorType):
            dims[0] = tuple(range(x.rank)) if self.dim is None else self.dim
        return dims

    def result_shape(self, inputs: Sequence[torch.Tensor]) -> Sequence[int]:
        x = inputs[0]
        return x.sum().shape if self.dim is None else x.sum(dim=list(self.dim), keepdim=self.keepdim).shape

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
    """``exp`` / ``ceil`` / ``floor`` of qint8 codes through a 256-entry table, of qint16 codes
    through a segmented table (ceil / floor: from ``table16_version`` 2, exact)."""

    name: ClassVar[str] = "qlut_method"
    ff_methods: ClassVar[tuple[str, ...]] = ("exp", "ceil", "floor")

    #: the format of exp's qint16 segmented table (:mod:`qir.ir.table16`); text without it is version 1
    table16_version: int = 1

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        check_table16_version(self.name, self.table16_version)

    @classmethod
    def from_call(cls, m: Any, method: str, bound: dict[str, Any]) -> tuple[QFunctionalOp, list[Any]]:
        op, tensors = super().from_call(m, method, bound)
        assert isinstance(op, QLutMethod)
        return attrs.evolve(op, table16_version=int(getattr(m, "table16_version", 1))), tensors

    def module_signature(self) -> Any:
        # the version is the module's: call sites of different formats rebuild different modules
        return (*super().module_signature(), self.table16_version)

    def result_shape(self, inputs: Sequence[torch.Tensor]) -> Sequence[int]:
        return inputs[0].shape

    def verify_(self, operand_types: Sequence[Type]) -> None:
        dtype = code_dtype(self.name, operand_types[0])
        # ceil / floor of qint16 codes: exact segmented tables from format version 2
        qint16 = self.method == "exp" or self.table16_version > 1
        if dtype is not DType.qint8 and not (dtype is DType.qint16 and qint16):
            raise IRError(
                f"qlut_method: {self.method} reads qint8"
                + (" or qint16 codes" if qint16 else " codes (qint16 from table16_version 2)")
                + f", got {operand_types[0]}"
            )
        super().verify_(operand_types)
