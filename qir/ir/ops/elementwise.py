"""Elementwise activations and arithmetic."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from qir.ir.meta_shapes import binary_shape, meta_result
from qir.ir.op import (
    Commutative,
    Elementwise,
    IRError,
    ModuleOp,
    Op,
    Pure,
    ShapePreserving,
    Trait,
    register_op,
    resolve,
)
from qir.ir.types import Type

_ACT = frozenset({Pure, Elementwise, ShapePreserving})


def _meta_float(x: Any) -> bool:
    """A floating meta tensor: a shape-inference operand a ReLU keeps as it is."""
    return isinstance(x, torch.Tensor) and x.device.type == "meta" and x.is_floating_point()


@register_op
@attrs.frozen
class Relu(ModuleOp):
    """``nn.ReLU``, ``F.relu``, ``torch.relu``, ``Tensor.relu``."""

    name: ClassVar[str] = "relu"
    traits: ClassVar[frozenset[type[Trait]]] = _ACT
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    module_types: ClassVar[tuple[type, ...]] = (nn.ReLU,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.relu, torch.relu)
    methods: ClassVar[tuple[str, ...]] = ("relu",)
    signature: ClassVar[tuple[str, ...]] = ("input", "inplace")

    inplace: bool = False  # kept so emitted modules print like the originals

    def compute(self, x: Any) -> Any:
        if _meta_float(x):  # shape inference: same shape and dtype; torch's meta relu costs ~1 ms
            return x
        return torch.relu(x)

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return F.relu, (operands[0],), {"inplace": self.inplace} if self.inplace else {}

    @classmethod
    def from_module(cls, m: Any) -> Relu:
        return cls(inplace=m.inplace)

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        return nn.ReLU(inplace=self.inplace)


@register_op
@attrs.frozen
class Relu6(ModuleOp):
    """``nn.ReLU6``, ``F.relu6``."""

    name: ClassVar[str] = "relu6"
    traits: ClassVar[frozenset[type[Trait]]] = _ACT
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    module_types: ClassVar[tuple[type, ...]] = (nn.ReLU6,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.relu6,)
    signature: ClassVar[tuple[str, ...]] = ("input", "inplace")

    inplace: bool = False

    def compute(self, x: Any) -> Any:
        if _meta_float(x):  # shape inference: same shape and dtype; torch's meta relu6 costs ~4 ms
            return x
        return F.relu6(x)

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return F.relu6, (operands[0],), {"inplace": self.inplace} if self.inplace else {}

    @classmethod
    def from_module(cls, m: Any) -> Relu6:
        return cls(inplace=m.inplace)

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        return nn.ReLU6(inplace=self.inplace)


@attrs.frozen
class BinaryOp(Op):
    """``a <op> b``. With ``other`` set (a scalar or a Ref template), the op has one
    operand and ``other`` is its second argument (``x + 1``, ``x * y.size(1)``).
    ``reverse`` means the scalar is on the left (``1 - x``)."""

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, Elementwise})
    arity: ClassVar[tuple[int, int | None]] = (1, None)
    operand_names: ClassVar[tuple[str, ...]] = ("input", "other")

    other: Any = None
    reverse: bool = False
    #: two float tensors of one dtype give that dtype (add / sub / mul): shape inference on meta
    #: tensors broadcasts the shapes itself instead of running torch's meta kernel
    keeps_float_dtype: ClassVar[bool] = False

    @staticmethod
    def fn(a: Any, b: Any) -> Any:
        raise NotImplementedError

    def pair(self, operands: Sequence[Any]) -> tuple[Any, Any]:
        """The two arguments in call order (``other`` resolved, ``reverse`` applied)."""
        if self.other is None:
            a, b = operands[0], operands[1]
        else:
            a, b = operands[0], resolve(self.other, operands)
        return (b, a) if self.reverse else (a, b)

    def compute(self, *operands: Any) -> Any:
        a, b = self.pair(operands)
        if self.keeps_float_dtype:
            shape = binary_shape(a, b)
            if shape is not None:
                return meta_result(shape, a)
        return self.fn(a, b)

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The canonical spelling (``functions[0]``) applied to :meth:`pair`."""
        return type(self).functions[0], self.pair(operands), {}

    def verify_(self, operand_types: Sequence[Type]) -> None:
        if self.other is None and len(operand_types) != 2:
            raise IRError(f"op {self.name!r}: needs two operands (or an 'other' attribute), got {len(operand_types)}")
        if self.reverse and self.other is None:
            raise IRError(f"op {self.name!r}: reverse=True needs a scalar 'other'")


@register_op
@attrs.frozen
class Add(BinaryOp):
    """``a + b``, ``torch.add``, ``Tensor.add``, ``FloatFunctional.add`` / ``add_scalar``."""

    name: ClassVar[str] = "add"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, Elementwise, Commutative})
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (operator.add, torch.add)
    methods: ClassVar[tuple[str, ...]] = ("add",)
    keeps_float_dtype: ClassVar[bool] = True

    @staticmethod
    def fn(a: Any, b: Any) -> Any:
        return a + b


def _binary(
    cls_name: str,
    op_name: str,
    fn: Callable[[Any, Any], Any],
    functions: tuple[Callable[..., Any], ...],
    methods: tuple[str, ...],
    commutative: bool = False,
    doc: str = "",
    keeps_float_dtype: bool = False,
) -> type[BinaryOp]:
    """One registered binary op class; ``fn`` is its float semantics."""
    traits = frozenset({Pure, Elementwise, Commutative}) if commutative else frozenset({Pure, Elementwise})
    ns: dict[str, Any] = {
        "__doc__": doc or f"``{op_name}`` ({', '.join(m for m in methods)}).",
        "__qualname__": cls_name,
        "__module__": __name__,
        "name": op_name,
        "traits": traits,
        "functions": functions,
        "methods": methods,
        "fn": staticmethod(fn),
        "keeps_float_dtype": keeps_float_dtype,
    }
    return register_op(attrs.frozen(type(cls_name, (BinaryOp,), ns)))


Sub = _binary(
    "Sub", "sub", operator.sub, (operator.sub, torch.sub, torch.subtract), ("sub", "subtract"), keeps_float_dtype=True
)
Mul = _binary(
    "Mul",
    "mul",
    operator.mul,
    (operator.mul, torch.mul, torch.multiply),
    ("mul", "multiply"),
    commutative=True,
    keeps_float_dtype=True,
)
FloorDiv = _binary(
    "FloorDiv", "floordiv", operator.floordiv, (operator.floordiv, torch.floor_divide), ("floor_divide",)
)
Remainder = _binary("Remainder", "remainder", operator.mod, (operator.mod, torch.remainder), ("remainder",))
Pow = _binary("Pow", "pow", operator.pow, (operator.pow, torch.pow), ("pow",))
Maximum = _binary("Maximum", "maximum", torch.maximum, (torch.maximum,), ("maximum",), True)
Minimum = _binary("Minimum", "minimum", torch.minimum, (torch.minimum,), ("minimum",), True)
Eq = _binary("Eq", "eq", operator.eq, (operator.eq, torch.eq), ("eq",), True)
Ne = _binary("Ne", "ne", operator.ne, (operator.ne, torch.ne, torch.not_equal), ("ne", "not_equal"), True)
Gt = _binary("Gt", "gt", operator.gt, (operator.gt, torch.gt, torch.greater), ("gt", "greater"))
Ge = _binary("Ge", "ge", operator.ge, (operator.ge, torch.ge, torch.greater_equal), ("ge", "greater_equal"))
Lt = _binary("Lt", "lt", operator.lt, (operator.lt, torch.lt, torch.less), ("lt", "less"))
Le = _binary("Le", "le", operator.le, (operator.le, torch.le, torch.less_equal), ("le", "less_equal"))
LogicalAnd = _binary("LogicalAnd", "logical_and", torch.logical_and, (torch.logical_and,), ("logical_and",), True)
LogicalOr = _binary("LogicalOr", "logical_or", torch.logical_or, (torch.logical_or,), ("logical_or",), True)
BitwiseAnd = _binary(
    "BitwiseAnd", "bitwise_and", operator.and_, (operator.and_, torch.bitwise_and), ("bitwise_and",), True
)
BitwiseOr = _binary("BitwiseOr", "bitwise_or", operator.or_, (operator.or_, torch.bitwise_or), ("bitwise_or",), True)


@register_op
@attrs.frozen
class Div(BinaryOp):
    """``a / b``, ``torch.div`` / ``Tensor.div`` (with ``rounding_mode``), ``torch.true_divide``."""

    name: ClassVar[str] = "div"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (operator.truediv, torch.div, torch.true_divide, torch.divide)
    methods: ClassVar[tuple[str, ...]] = ("div", "divide", "true_divide")

    rounding_mode: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.rounding_mode not in (None, "trunc", "floor"):
            raise IRError(f"op 'div': rounding_mode must be None, 'trunc' or 'floor', got {self.rounding_mode!r}")

    @staticmethod
    def fn(a: Any, b: Any) -> Any:
        return a / b

    def compute(self, *operands: Any) -> Any:
        fn, args, kwargs = self.torch_call(operands)
        return fn(*args, **kwargs)

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        if self.rounding_mode is None:
            return operator.truediv, self.pair(operands), {}
        return torch.div, self.pair(operands), {"rounding_mode": self.rounding_mode}


@register_op
@attrs.frozen
class Clamp(Op):
    """``torch.clamp`` / ``clip`` / ``Tensor.clamp``: ``min`` and ``max`` are scalars, None,
    or Refs to tensor operands."""

    name: ClassVar[str] = "clamp"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, Elementwise, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (1, 3)
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.clamp, torch.clip)
    methods: ClassVar[tuple[str, ...]] = ("clamp", "clip")
    signature: ClassVar[tuple[str, ...]] = ("input", "min", "max")

    min: Any = None
    max: Any = None

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return torch.clamp, (operands[0],), {"min": resolve(self.min, operands), "max": resolve(self.max, operands)}

    def compute(self, *operands: Any) -> Any:
        fn, args, kwargs = self.torch_call(operands)
        return fn(*args, **kwargs)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        if self.min is None and self.max is None:
            raise IRError("op 'clamp': at least one of min / max must be given")


@register_op
@attrs.frozen
class Where(Op):
    """``torch.where(condition, input, other)``; ``input``/``other`` are scalars or Refs."""

    name: ClassVar[str] = "where"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, Elementwise})
    arity: ClassVar[tuple[int, int | None]] = (1, 3)
    operand_names: ClassVar[tuple[str, ...]] = ("condition",)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.where,)
    methods: ClassVar[tuple[str, ...]] = ()
    signature: ClassVar[tuple[str, ...]] = ("condition", "input", "other")
    inputs: ClassVar[tuple[str, ...]] = ("condition",)

    input: Any = None
    other: Any = None

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return torch.where, (operands[0], resolve(self.input, operands), resolve(self.other, operands)), {}

    def compute(self, *operands: Any) -> Any:
        fn, args, kwargs = self.torch_call(operands)
        return fn(*args, **kwargs)
