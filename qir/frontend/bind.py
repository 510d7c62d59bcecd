"""Bind a torch call's arguments to a registered op: attributes plus operands.

``bind(cls, fn, args, kwargs, form)`` returns the op instance and its operand values.
Graph values among the arguments become operands; where they sit inside attributes
(``x.reshape(x.size(0), -1)``) the attribute holds a :class:`~qir.ir.op.Ref` to them.
A call the op cannot express raises :class:`Unbindable`; the front end then keeps it as
an opaque ``call``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qir.ir.graph import Value, split_operands
from qir.ir.op import Op
from qir.ir.ops.core import GetAttr, GetItem
from qir.ir.ops.elementwise import BinaryOp, Div, Maximum, Minimum
from qir.ir.ops.misc import CAST_METHODS, Cast, Dropout, Einsum
from qir.ir.ops.nn import ConvTransposeNd, Linear, WeightedOp
from qir.ir.ops.norm import GroupNorm, LayerNorm
from qir.ir.ops.reduce import Max, Min
from qir.ir.types import SequenceType, TensorType


class Unbindable(Exception):
    """The call's arguments do not fit the op (the reason is the message)."""


Bound = tuple[Op, list[Value]]


def _is_tensor_value(v: Any) -> bool:
    return isinstance(v, Value) and isinstance(v.type, TensorType)


def _bind_names(names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    if len(args) > len(names):
        raise Unbindable(f"{what}: {len(args)} positional arguments, the op knows {len(names)} ({', '.join(names)})")
    bound = dict(zip(names, args, strict=False))
    for k, v in kwargs.items():
        if k in bound:
            raise Unbindable(f"{what}: argument {k!r} given twice")
        if k not in names:
            if v is None or k == "_stacklevel":
                continue  # None means the default; _stacklevel only affects warnings
            raise Unbindable(f"{what}: keyword {k!r} is not modelled by the op")
        bound[k] = v
    return bound


def _varargs(cls: type[Op], args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Fold a method's ``*args`` (``x.view(b, -1)``) into one sequence parameter."""
    vname = getattr(cls, "method_varargs", None)
    sig: tuple[str, ...] = cls.signature  # type: ignore[attr-defined]
    if vname is None or vname in kwargs:
        return tuple(args)
    i = sig.index(vname)
    head, rest = list(args[:i]), list(args[i:])
    if len(rest) == 1 and (
        isinstance(rest[0], (tuple, list, torch.Size))
        or (isinstance(rest[0], Value) and isinstance(rest[0].type, SequenceType))
    ):
        return (*head, rest[0])
    return (*head, tuple(rest)) if rest else tuple(head)


def bind_generic(cls: type[Op], fn: Any, args: Sequence[Any], kwargs: dict[str, Any], form: str) -> Bound:
    """Bind by the op's ``signature`` / ``inputs`` / ``list_input`` class attributes."""
    sig = getattr(cls, "signature", None)
    if sig is None:
        raise Unbindable(f"op {cls.name!r} has no call signature")
    if form == "method":
        args = _varargs(cls, args, kwargs)
    bound = _bind_names(sig, args, kwargs, f"op {cls.name!r}")
    inputs: list[Value] = []
    for p in getattr(cls, "inputs", ("input",)):
        if p not in bound:
            raise Unbindable(f"op {cls.name!r}: missing input {p!r}")
        v = bound.pop(p)
        if getattr(cls, "list_input", False):
            if not isinstance(v, (tuple, list)) or not all(isinstance(t, Value) for t in v):
                raise Unbindable(f"op {cls.name!r}: {p!r} must be a sequence of graph values")
            inputs.extend(v)
        elif isinstance(v, Value):
            inputs.append(v)
        else:
            raise Unbindable(f"op {cls.name!r}: input {p!r} is not a graph value ({type(v).__name__})")
    if cls is Dropout:
        bound["variant"] = Dropout.variant_of(fn)
    extra, template = split_operands(bound, leading=len(inputs))
    if extra and getattr(cls, "list_input", False):
        raise Unbindable(f"op {cls.name!r}: attributes of a list-input op must be static")
    try:
        op = cls(**template)
    except (TypeError, ValueError) as e:
        raise Unbindable(f"op {cls.name!r}: {e}") from None
    return op, inputs + extra


def bind_binary(cls: type[BinaryOp], args: Sequence[Any], kwargs: dict[str, Any]) -> Bound:
    kwargs = dict(kwargs)
    alpha = kwargs.pop("alpha", 1)
    if alpha != 1:
        raise Unbindable(f"op {cls.name!r}: alpha={alpha!r} is not modelled")
    extra: dict[str, Any] = {}
    if "rounding_mode" in kwargs:
        if cls is not Div:
            raise Unbindable(f"op {cls.name!r}: rounding_mode is only modelled for div")
        extra["rounding_mode"] = kwargs.pop("rounding_mode")
    b = _bind_names(("input", "other"), args, kwargs, f"op {cls.name!r}")
    if "input" not in b or "other" not in b:
        raise Unbindable(f"op {cls.name!r} needs two arguments")
    a, o = b["input"], b["other"]
    if isinstance(a, Value) and isinstance(o, Value):
        return cls(**extra), [a, o]
    if isinstance(a, Value):
        return cls(other=o, **extra), [a]  # type: ignore[arg-type]
    if isinstance(o, Value):
        return cls(other=a, reverse=True, **extra), [o]  # type: ignore[arg-type]
    raise Unbindable(f"op {cls.name!r}: neither argument is a graph value")


def bind_max(cls: type[Op], fn: Any, args: Sequence[Any], kwargs: dict[str, Any], form: str) -> Bound:
    other = args[1] if len(args) > 1 else kwargs.get("other")
    if _is_tensor_value(other):
        pair = Maximum if cls is Max else Minimum
        return bind_binary(pair, args, kwargs)
    op, operands = bind_generic(cls, fn, args, kwargs, "function")
    if len(operands) != 1:
        raise Unbindable(f"op {cls.name!r}: dim must be static")
    return op, operands


def _ntuple(v: Any, n: int) -> Any:
    return (v,) * n if isinstance(v, int) else tuple(v) if isinstance(v, (list, tuple)) else v


def bind_weighted(cls: type[WeightedOp], args: Sequence[Any], kwargs: dict[str, Any]) -> Bound:
    """``F.linear`` / ``F.convNd`` / ``F.conv_transposeNd`` with weights as operands."""
    if issubclass(cls, Linear):
        names: tuple[str, ...] = ("input", "weight", "bias")
    elif issubclass(cls, ConvTransposeNd):
        names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
    else:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    b = _bind_names(names, args, kwargs, f"op {cls.name!r}")
    x, w, bias = b.pop("input", None), b.pop("weight", None), b.pop("bias", None)
    if not (isinstance(x, Value) and isinstance(w, Value)) or not (bias is None or isinstance(bias, Value)):
        raise Unbindable(f"op {cls.name!r}: input, weight and bias must be graph values")
    if any(isinstance(v, Value) for v in b.values()):
        raise Unbindable(f"op {cls.name!r}: stride/padding/... must be static")
    operands = [x, w] + ([bias] if bias is not None else [])
    if issubclass(cls, Linear):
        return cls(bias=bias is not None), operands
    n = cls.dims  # type: ignore[attr-defined]
    opts = {k: (_ntuple(v, n) if k not in ("groups",) and not isinstance(v, str) else v) for k, v in b.items()}
    if issubclass(cls, ConvTransposeNd):
        defaults = {"stride": 1, "padding": 0, "output_padding": 0, "dilation": 1}
        opts = {k: _ntuple(v, n) for k, v in defaults.items()} | opts
    return cls(bias=bias is not None, **opts), operands  # type: ignore[call-arg]


def bind_norm(cls: type[Op], args: Sequence[Any], kwargs: dict[str, Any]) -> Bound:
    """``F.layer_norm(input, normalized_shape, weight, bias, eps)`` / ``F.group_norm(input, num_groups, ...)``."""
    second = "normalized_shape" if cls is LayerNorm else "num_groups"
    b = _bind_names(("input", second, "weight", "bias", "eps"), args, kwargs, f"op {cls.name!r}")
    x, w, bias = b.pop("input", None), b.pop("weight", None), b.pop("bias", None)
    if not isinstance(x, Value) or any(v is not None and not isinstance(v, Value) for v in (w, bias)):
        raise Unbindable(f"op {cls.name!r}: input, weight and bias must be graph values")
    if any(isinstance(v, Value) for v in b.values()):
        raise Unbindable(f"op {cls.name!r}: {second} and eps must be static")
    op = cls(**b, weight=w is not None, bias=bias is not None)  # type: ignore[call-arg]
    return op, [v for v in (x, w, bias) if v is not None]


def bind_cast(method: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Bound:
    """``x.float()`` / ``x.to(torch.float16)`` / ``x.to(dtype=...)`` / ``x.type(torch.int32)``."""
    if not args or not isinstance(args[0], Value):
        raise Unbindable("a cast needs a tensor")
    if method in CAST_METHODS:
        if len(args) > 1 or set(kwargs) - {"memory_format"} or kwargs.get("memory_format") not in (None,):
            raise Unbindable(f"Tensor.{method} with arguments is not modelled")
        return Cast(dtype=CAST_METHODS[method]), [args[0]]
    rest = list(args[1:])
    dtype = kwargs.get("dtype", rest[0] if len(rest) == 1 else None)
    if not isinstance(dtype, torch.dtype) or len(rest) + len(kwargs) != 1:
        raise Unbindable(f"Tensor.{method} other than a plain dtype cast is not modelled")
    return Cast(dtype=dtype), [args[0]]


def bind(cls: type[Op], fn: Any, args: Sequence[Any], kwargs: dict[str, Any], form: str) -> Bound:
    """Bind a call spelled as a function (``form="function"``) or a method (``"method"``,
    with the tensor first in ``args``) to op class ``cls``."""
    if issubclass(cls, BinaryOp):
        return bind_binary(cls, args, kwargs)
    if cls in (Max, Min):
        return bind_max(cls, fn, args, kwargs, form)
    if issubclass(cls, WeightedOp):
        return bind_weighted(cls, args, kwargs)
    if cls in (LayerNorm, GroupNorm):
        return bind_norm(cls, args, kwargs)
    if cls is Cast:
        return bind_cast(fn, args, kwargs)
    if cls is Einsum:
        tensors = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        if kwargs or not args or not isinstance(args[0], str) or not all(isinstance(t, Value) for t in tensors):
            raise Unbindable("einsum takes (equation, *tensors)")
        return Einsum(equation=args[0]), list(tensors)
    if cls is GetItem:
        if kwargs or len(args) != 2 or not isinstance(args[0], Value):
            raise Unbindable("getitem takes (value, index)")
        extra, index = split_operands(args[1], leading=1)
        return GetItem(index=index), [args[0], *extra]
    if cls is GetAttr:
        if kwargs or len(args) != 2 or not isinstance(args[0], Value) or not isinstance(args[1], str):
            raise Unbindable("getattr takes (value, name) without a default")
        return GetAttr(attr=args[1]), [args[0]]
    return bind_generic(cls, fn, args, kwargs, form)
