"""Reductions: mean, sum, max/min (values or values+indices), arg-reductions, top-k."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch

from qir.ir.op import IRError, Pure, Trait, register_op
from qir.ir.ops.torchop import TorchOp, check_dim
from qir.ir.types import TensorType, Type


def _dims(dim: Any) -> tuple[Any, ...]:
    if dim is None:
        return ()
    return dim if isinstance(dim, tuple) else (dim,)


@attrs.frozen
class Reduction(TorchOp):
    """``op(input, dim=None, keepdim=False)``; ``dim`` None reduces every dimension."""

    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    signature: ClassVar[tuple[str, ...]] = ("input", "dim", "keepdim")
    omit_none: ClassVar[tuple[str, ...]] = ("dim",)

    dim: Any = None
    keepdim: bool = False

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        fn = type(self).functions[0]
        if self.dim is None and not self.keepdim:
            return fn, (operands[0],), {}  # the all-reduce overload takes no keepdim
        return fn, (operands[0],), {"dim": self.dim, "keepdim": self.keepdim}

    def verify_(self, operand_types: Sequence[Type]) -> None:
        t = operand_types[0]
        if isinstance(t, TensorType):
            for d in _dims(self.dim):
                check_dim(self, d, t.rank)


@register_op
@attrs.frozen
class Mean(Reduction):
    """``torch.mean`` / ``Tensor.mean`` (``FloatFunctional.mean``)."""

    name: ClassVar[str] = "mean"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.mean,)
    methods: ClassVar[tuple[str, ...]] = ("mean",)


@register_op
@attrs.frozen
class Sum(Reduction):
    """``torch.sum`` / ``Tensor.sum`` (``FloatFunctional.sum``)."""

    name: ClassVar[str] = "sum"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.sum,)
    methods: ClassVar[tuple[str, ...]] = ("sum",)


@register_op
@attrs.frozen
class Amax(Reduction):
    """``torch.amax`` / ``Tensor.amax``."""

    name: ClassVar[str] = "amax"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.amax,)
    methods: ClassVar[tuple[str, ...]] = ("amax",)


@register_op
@attrs.frozen
class Amin(Reduction):
    """``torch.amin`` / ``Tensor.amin``."""

    name: ClassVar[str] = "amin"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.amin,)
    methods: ClassVar[tuple[str, ...]] = ("amin",)


@register_op
@attrs.frozen
class Max(Reduction):
    """``torch.max`` / ``Tensor.max`` over one tensor: the maximum (``dim`` None) or the
    ``(values, indices)`` pair along ``dim``. Two-tensor ``torch.max`` is ``maximum``."""

    name: ClassVar[str] = "max"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.max,)
    methods: ClassVar[tuple[str, ...]] = ("max",)

    def torch_call(self, operands: Sequence[Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        fn = type(self).functions[0]
        if self.dim is None:
            return fn, (operands[0],), {}
        return fn, (operands[0], self.dim), {"keepdim": self.keepdim}

    def verify_(self, operand_types: Sequence[Type]) -> None:
        if self.keepdim and self.dim is None:
            raise IRError(f"op {self.name!r}: keepdim needs a dim")
        super().verify_(operand_types)


@register_op
@attrs.frozen
class Min(Max):
    """``torch.min`` / ``Tensor.min`` over one tensor (see ``max``)."""

    name: ClassVar[str] = "min"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.min,)
    methods: ClassVar[tuple[str, ...]] = ("min",)


@register_op
@attrs.frozen
class Argmax(Reduction):
    """``torch.argmax`` / ``Tensor.argmax``."""

    name: ClassVar[str] = "argmax"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.argmax,)
    methods: ClassVar[tuple[str, ...]] = ("argmax",)


@register_op
@attrs.frozen
class Argmin(Reduction):
    """``torch.argmin`` / ``Tensor.argmin``."""

    name: ClassVar[str] = "argmin"
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.argmin,)
    methods: ClassVar[tuple[str, ...]] = ("argmin",)


@register_op
@attrs.frozen
class Topk(TorchOp):
    """``torch.topk`` / ``Tensor.topk``: ``(values, indices)``."""

    name: ClassVar[str] = "topk"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    arity: ClassVar[tuple[int, int | None]] = (1, 2)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (torch.topk,)
    methods: ClassVar[tuple[str, ...]] = ("topk",)
    signature: ClassVar[tuple[str, ...]] = ("input", "k", "dim", "largest", "sorted")
    positional: ClassVar[tuple[str, ...]] = ("k",)

    k: Any = 1
    dim: int = -1
    largest: bool = True
    sorted: bool = True
