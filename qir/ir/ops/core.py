"""Structural ops: constants, opaque calls, item and attribute access."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from qir.ir.call_targets import resolve_call_target
from qir.ir.op import CannotInfer, IRError, MovesCodes, Op, Opaque, Pure, Ref, Trait, Transparent, register_op, resolve
from qir.ir.spec_flow import carry_spec
from qir.ir.types import DType, ObjectType, SequenceType, TensorType, Type, type_of


class EvalContext:
    """What context-dependent ops need while a graph runs: constants and objects."""

    def __init__(self, constants: dict[str, torch.Tensor], objects: dict[str, Any], training: bool = False):
        self.constants = constants
        self.objects = objects
        self.training = training


@register_op
@attrs.frozen
class Constant(Op):
    """A named tensor (weight, buffer) stored in ``Graph.constants[key]``.

    ``kind`` is ``parameter`` (trainable), ``buffer`` (state, saved) or
    ``buffer_np`` (non-persistent buffer) or ``tensor`` (a plain tensor attribute);
    emitters use it to recreate the same state dict.
    """

    name: ClassVar[str] = "constant"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    arity: ClassVar[tuple[int, int | None]] = (0, 0)

    key: str
    kind: str = "parameter"

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("parameter", "buffer", "buffer_np", "tensor"):
            raise IRError(f"constant {self.key!r}: kind must be parameter/buffer/buffer_np/tensor, got {self.kind!r}")

    @staticmethod
    def type_for(t: torch.Tensor) -> Type:
        return TensorType(tuple(t.shape), DType.from_torch(t.dtype))

    def evaluate(self, ctx: EvalContext, operands: Sequence[Any]) -> Any:
        try:
            return ctx.constants[self.key]
        except KeyError:
            raise IRError(f"constant {self.key!r} has no tensor bound in the graph") from None

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        raise CannotInfer(f"constant {self.key!r}: its type comes from its tensor; use Graph.add_constant")


def resolve_target(target: str, objects: dict[str, Any]) -> Any:
    """Find the callable an opaque ``call`` names: the graph's objects first, then the
    allowlist of :mod:`qir.ir.call_targets` (nothing is imported by name)."""
    return resolve_call_target(target, objects)


@register_op
@attrs.frozen
class Call(Op):
    """An opaque call the front end does not map to a registered op.

    ``kind`` is ``function`` (``target`` is a key of ``Graph.objects`` or a name on the
    allowlist of :mod:`qir.ir.call_targets`), ``method`` (``target`` is a method name called on operand 0)
    or ``module`` (``target`` is the qualified name of a submodule kept in
    ``Graph.objects``). ``args`` / ``kwargs`` are templates whose :class:`Ref` leaves
    point at operands. Never fused or optimised; kept so nothing is silently dropped.
    """

    name: ClassVar[str] = "call"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Opaque})

    kind: str
    target: str
    args: Any = ()
    kwargs: Any = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("function", "method", "module"):
            raise IRError(f"call {self.target!r}: kind must be function, method or module, got {self.kind!r}")

    def evaluate(self, ctx: EvalContext, operands: Sequence[Any]) -> Any:
        args = resolve(self.args, operands)
        kwargs = resolve(self.kwargs, operands)
        if self.kind == "method":
            obj, *rest = args
            return getattr(obj, self.target)(*rest, **kwargs)
        if self.kind == "module":
            key = f"module:{self.target}"
            if key not in ctx.objects:
                raise IRError(f"call of module {self.target!r}: no module object bound in the graph")
            return ctx.objects[key](*args, **kwargs)
        return resolve_target(self.target, ctx.objects)(*args, **kwargs)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        raise CannotInfer(f"opaque call {self.target!r}: result type must be given (it cannot be inferred)")

    def verify_(self, operand_types: Sequence[Type]) -> None:
        if self.kind == "method" and not (isinstance(self.args, (tuple, list)) and self.args):
            raise IRError(f"method call {self.target!r} needs its receiver as args[0]")
        if not isinstance(self.args, (tuple, list)) or not isinstance(self.kwargs, dict):
            raise IRError(f"call {self.target!r}: args must be a tuple and kwargs a dict")
        if any(not isinstance(k, str) for k in self.kwargs):
            raise IRError(f"call {self.target!r}: kwargs keys must be strings")


@register_op
@attrs.frozen
class GetItem(Op):
    """``x[index]``; ``index`` may hold Refs (dynamic indices) and slices."""

    name: ClassVar[str] = "getitem"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, MovesCodes})
    arity: ClassVar[tuple[int, int | None]] = (1, None)
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    index: Any

    def compute(self, x: Any, *rest: Any) -> Any:
        return x[resolve(self.index, (x, *rest))]

    def verify_(self, operand_types: Sequence[Type]) -> None:
        idx = self.index
        if isinstance(operand_types[0], SequenceType) and not isinstance(idx, (int, slice, Ref)):
            raise IRError(f"getitem: a {operand_types[0]} takes an int or slice index, got {idx!r}")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        t = operand_types[0]
        idx = self.index
        if isinstance(t, SequenceType) and isinstance(idx, int):
            try:
                return t.elements[idx]
            except IndexError:
                raise IRError(f"getitem: index {idx} out of range for {len(t.elements)} elements") from None
        result = super().infer_type(operand_types)
        # a slice of codes holds codes at their scale (an index tensor operand is not quantized)
        return carry_spec(operand_types[:1], result) if isinstance(t, TensorType) else result


@register_op
@attrs.frozen
class GetAttr(Op):
    """``getattr(x, attr)`` on a run-time value (``x.shape``, ``x.dtype``)."""

    name: ClassVar[str] = "getattr"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    attr: str

    def compute(self, x: Any) -> Any:
        return getattr(x, self.attr)

    def reads_only_shape(self) -> bool:
        return self.attr in ("shape", "ndim")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        t = operand_types[0]
        if isinstance(t, TensorType):
            if self.attr == "shape":
                return type_of(torch.Size(t.shape))
            if self.attr == "ndim":
                return type_of(0)
            if self.attr == "dtype":
                return ObjectType("dtype")
        return super().infer_type(operand_types)


@register_op
@attrs.frozen
class Identity(Op):
    """Pass-through (``nn.Identity``, eval-mode dropout after folding)."""

    name: ClassVar[str] = "identity"
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure, Transparent, MovesCodes})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)

    def compute(self, x: Any) -> Any:
        return x
