"""Dropout (mode dependent) and matrix products."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from qir.ir.op import IRError, ModuleOp, Op, Pure, SameDtypeOperands, ShapePreserving, Trait, Transparent, register_op
from qir.ir.ops.core import EvalContext
from qir.ir.ops.torchop import TorchOp

_DROPOUTS: dict[str, tuple[type[nn.Module], Callable[..., Any]]] = {
    "": (nn.Dropout, F.dropout),
    "1d": (nn.Dropout1d, F.dropout1d),
    "2d": (nn.Dropout2d, F.dropout2d),
    "3d": (nn.Dropout3d, F.dropout3d),
    "alpha": (nn.AlphaDropout, F.alpha_dropout),
    "feature_alpha": (nn.FeatureAlphaDropout, F.feature_alpha_dropout),
}


@register_op
@attrs.frozen
class Dropout(ModuleOp):
    """``nn.Dropout`` (1d/2d/3d/alpha variants) and ``F.dropout*``.

    ``training`` None (the module form) follows the graph's mode, so the emitted module
    behaves like the original in both modes; the functional form records its flag.
    """

    name: ClassVar[str] = "dropout"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Transparent, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    module_types: ClassVar[tuple[type, ...]] = tuple(m for m, _ in _DROPOUTS.values())
    functions: ClassVar[tuple[Callable[..., Any], ...]] = tuple(f for _, f in _DROPOUTS.values())
    signature: ClassVar[tuple[str, ...]] = ("input", "p", "training", "inplace")

    p: float = 0.5
    training: bool | None = None
    inplace: bool = False
    variant: str = ""

    def __attrs_post_init__(self) -> None:
        if self.variant not in _DROPOUTS:
            raise IRError(f"op 'dropout': variant must be one of {sorted(_DROPOUTS)}, got {self.variant!r}")

    def module_flavor(self) -> type | None:
        """The one module class of :attr:`module_types` this op stands for."""
        return _DROPOUTS[self.variant][0]

    def evaluate(self, ctx: EvalContext, operands: Sequence[Any]) -> Any:
        training = ctx.training if self.training is None else self.training
        return _DROPOUTS[self.variant][1](operands[0], self.p, training, self.inplace)

    def compute(self, x: Any) -> Any:
        return _DROPOUTS[self.variant][1](x, self.p, bool(self.training), self.inplace)

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        if self.training is None:
            raise IRError("op 'dropout' in module form (training=None) is emitted as a module, not a call")
        return (
            _DROPOUTS[self.variant][1],
            (operands[0],),
            {
                "p": self.p,
                "training": self.training,
                "inplace": self.inplace,
            },
        )

    @classmethod
    def from_module(cls, m: Any) -> Dropout:
        variant = next(k for k, (mt, _) in _DROPOUTS.items() if type(m) is mt)
        return cls(p=m.p, training=None, inplace=m.inplace, variant=variant)

    @staticmethod
    def variant_of(fn: Callable[..., Any]) -> str:
        """The variant a functional spelling (``F.dropout2d``) stands for."""
        return next(k for k, (_, f) in _DROPOUTS.items() if f is fn)

    def to_module(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        return _DROPOUTS[self.variant][0](p=self.p, inplace=self.inplace)


@register_op
@attrs.frozen
class Matmul(TorchOp):
    """``a @ b``, ``torch.matmul`` / ``mm`` / ``bmm``, ``Tensor.matmul``, ``FloatFunctional.matmul``."""

    name: ClassVar[str] = "matmul"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, SameDtypeOperands})
    arity: ClassVar[tuple[int, int | None]] = (2, 2)
    operand_names: ClassVar[tuple[str, ...]] = ("input", "other")
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.matmul, operator.matmul, torch.mm, torch.bmm)
    methods: ClassVar[tuple[str, ...]] = ("matmul", "mm", "bmm")
    signature: ClassVar[tuple[str, ...]] = ("input", "other")
    inputs: ClassVar[tuple[str, ...]] = ("input", "other")


@register_op
@attrs.frozen
class Assert(TorchOp):
    """``torch._assert(condition, message)``: a run-time check kept in the graph (not pure,
    so dead-code elimination keeps it)."""

    name: ClassVar[str] = "assert"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset()
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    operand_names: ClassVar[tuple[str, ...]] = ("condition",)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch._assert,)
    signature: ClassVar[tuple[str, ...]] = ("condition", "message")
    inputs: ClassVar[tuple[str, ...]] = ("condition",)
    positional: ClassVar[tuple[str, ...]] = ("message",)

    message: str = ""


@register_op
@attrs.frozen
class Einsum(Op):
    """``torch.einsum(equation, *operands)``: all operands are tensors."""

    name: ClassVar[str] = "einsum"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, SameDtypeOperands})
    arity: ClassVar[tuple[int, int | None]] = (1, None)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.einsum,)

    equation: str

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return torch.einsum, (self.equation, *operands), {}

    def compute(self, *operands: Any) -> Any:
        return torch.einsum(self.equation, *operands)


#: Tensor methods that are casts to one fixed dtype.
CAST_METHODS: dict[str, torch.dtype] = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int": torch.int32,
    "long": torch.int64,
    "short": torch.int16,
    "char": torch.int8,
    "byte": torch.uint8,
    "bool": torch.bool,
}


@register_op
@attrs.frozen
class Cast(Op):
    """``Tensor.to(dtype)`` and the fixed casts ``Tensor.float()``, ``.long()``, ... (dtype only;
    device moves stay opaque calls)."""

    name: ClassVar[str] = "cast"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, ShapePreserving})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    methods: ClassVar[tuple[str, ...]] = ("to", "type", *CAST_METHODS)

    dtype: Any = torch.float32

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise IRError(f"op 'cast': dtype must be a torch.dtype, got {self.dtype!r}")

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return torch.Tensor.to, (operands[0], self.dtype), {}

    def compute(self, x: Any) -> Any:
        return x.to(self.dtype)
