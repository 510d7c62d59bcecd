"""Elementwise activations and arithmetic."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from qir.ir.op import Commutative, Elementwise, IRError, ModuleOp, Op, Pure, ShapePreserving, Trait, register_op, resolve
from qir.ir.types import Type

_ACT = frozenset({Pure, Elementwise, ShapePreserving})


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

    inplace: bool = False  # kept so emitted modules print like the originals

    def compute(self, x: Any) -> Any:
        return torch.relu(x)

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

    inplace: bool = False

    def compute(self, x: Any) -> Any:
        return F.relu6(x)

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

    @staticmethod
    def fn(a: Any, b: Any) -> Any:
        raise NotImplementedError

    def compute(self, *operands: Any) -> Any:
        if self.other is None:
            a, b = operands[0], operands[1]
        else:
            a, b = operands[0], resolve(self.other, operands)
        return self.fn(b, a) if self.reverse else self.fn(a, b)

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

    @staticmethod
    def fn(a: Any, b: Any) -> Any:
        return a + b
