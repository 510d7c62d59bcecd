"""Layout kernels: reshape / view / permute / flatten / getitem / split / ... (an allowlist of
torch functions called by name, never code from the artifact), plus cat / stack of codes."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from backends.common.kernels.base import register_kernel
from backends.common.kernels.infer import ShapeError, meta_call
from backends.common.kernels.schema import KernelSchema, json_tree, one_of
from backends.common.program import Instruction, ValueRef, refs_in

#: name in the Program -> the function it calls (receiver first for tensor methods).
SHAPE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "reshape": torch.reshape,
    "view": torch.Tensor.view,
    "flatten": torch.flatten,
    "permute": torch.permute,
    "transpose": torch.transpose,
    "contiguous": torch.Tensor.contiguous,
    "squeeze": torch.squeeze,
    "unsqueeze": torch.unsqueeze,
    "getitem": operator.getitem,
    "split": torch.split,
    "chunk": torch.chunk,
    "unbind": torch.unbind,
    "expand": lambda x, *size: torch.Tensor.expand(x, *_grown(x, "expand", size, multiply=False)),
    "expand_as": torch.Tensor.expand_as,
    "repeat": lambda x, *reps: torch.Tensor.repeat(x, *_grown(x, "repeat", reps, multiply=True)),
    "tile": lambda x, reps: torch.tile(x, _grown(x, "tile", (reps,), multiply=True)),
    "flip": torch.flip,
    "roll": torch.roll,
    "view_as": torch.Tensor.view_as,
    "reshape_as": torch.Tensor.reshape_as,
    "clone": torch.clone,
    "detach": torch.Tensor.detach,
    "size": torch.Tensor.size,
    "dim": torch.Tensor.dim,
    "numel": torch.numel,
    "pixel_shuffle": torch.pixel_shuffle,
    "pixel_unshuffle": torch.pixel_unshuffle,
    "channel_shuffle": torch.channel_shuffle,
    "identity": lambda x: x,
    "cat": torch.cat,
    "stack": torch.stack,
    # Python arithmetic on shape values (``x.size(0) * 2``)
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "truediv": operator.truediv,  # ``1.0 / w``: a number for mul_scalar_dynamic
    "pow": lambda a, b: _bounded_pow(a, b),  # ``d ** -0.5``: attention's 1 / sqrt(head dim)
    "len": len,
    # float32 tensors built from sizes (positions before a QuantStub: torch.arange(w))
    "zeros": lambda *size: torch.zeros(*_bounded(size), dtype=torch.float32),
    "ones": lambda *size: torch.ones(*_bounded(size), dtype=torch.float32),
    "arange": lambda *a: torch.arange(*_bounded_range(a), dtype=torch.float32),
}

#: the most elements a tensor built from sizes may have (a size is a run-time value or a number
#: from the artifact file: never allocate without a bound)
MAX_BUILT_ELEMENTS = 2**28


#: an int power's result has at most this many bits (an exponent from the artifact file must
#: not make the runtime compute a number of unbounded size)
MAX_POW_BITS = 4096


def _bounded_pow(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and b > 0:
        if max(abs(a).bit_length(), 1) * b > MAX_POW_BITS:
            raise ValueError(f"{a} ** {b} would have more than {MAX_POW_BITS} bits")
    return operator.pow(a, b)  # float results overflow with an error, in bounded time


def _bounded(size: tuple[Any, ...]) -> tuple[Any, ...]:
    dims = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    n = 1
    for d in dims:
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"a tensor built from sizes needs non-negative int dimensions, got {dims!r}")
        n *= d
    if n > MAX_BUILT_ELEMENTS:
        raise ValueError(f"a tensor built from sizes {dims!r} would have {n} elements (limit {MAX_BUILT_ELEMENTS})")
    return dims


def _bounded_range(a: tuple[Any, ...]) -> tuple[Any, ...]:
    if not a or len(a) > 3 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in a):
        raise ValueError(f"arange takes 1 to 3 finite numbers, got {a!r}")
    start, end, step = (0, a[0], 1) if len(a) == 1 else (a[0], a[1], a[2] if len(a) == 3 else 1)
    if step == 0 or (end - start) / step > MAX_BUILT_ELEMENTS:
        raise ValueError(f"arange{a!r} is empty-stepped or has more than {MAX_BUILT_ELEMENTS} elements")
    return a


def _grown(x: Any, fn: str, args: tuple[Any, ...], multiply: bool) -> tuple[Any, ...]:
    """The sizes of ``repeat`` / ``tile`` (``multiply``: factors of the input's sizes) or ``expand``
    (target sizes, -1 keeps one), checked before the call: the result (a copy, or a view that the
    next kernel copies) may have at most MAX_BUILT_ELEMENTS elements."""
    dims = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
    if not isinstance(x, torch.Tensor) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"{fn} takes a tensor and integer sizes, got {dims!r}")
    shape = list(x.shape)
    if multiply:
        if any(d < 0 for d in dims):
            raise ValueError(f"{fn}{dims!r}: repetitions must be non-negative")
        shape = [1] * (len(dims) - len(shape)) + shape
        reps = [1] * (len(shape) - len(dims)) + list(dims)
        out = [a * b for a, b in zip(shape, reps, strict=True)]
    else:
        out = [
            s if d == -1 and i >= len(dims) - len(shape) else d
            for i, (d, s) in enumerate(zip(dims, [1] * (len(dims) - len(shape)) + shape, strict=False))
        ]
    n = math.prod(max(d, 0) for d in out)
    if n > MAX_BUILT_ELEMENTS:
        raise ValueError(
            f"{fn}{dims!r} of a {list(x.shape)} tensor would have {n} elements (limit {MAX_BUILT_ELEMENTS})"
        )
    return dims


def _resolve(v: Any, env: dict[str, Any]) -> Any:
    if isinstance(v, ValueRef):
        return env[v.name]
    if isinstance(v, list):
        return [_resolve(x, env) for x in v]
    if isinstance(v, tuple):
        return tuple(_resolve(x, env) for x in v)
    if isinstance(v, dict):
        return {k: _resolve(x, env) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_resolve(v.start, env), _resolve(v.stop, env), _resolve(v.step, env))
    return v


def named_call_attrs(table: Mapping[str, Any]) -> dict[str, Any]:
    """The attribute schema of a kernel that calls one function of ``table`` by name (``shape_fn``,
    ``float_fn``): ``fn``, and its ``args`` / ``kwargs`` naming values through ``{"$v": name}``."""
    return {"fn": one_of(*table), "args": json_tree(), "kwargs": json_tree(required=False, top=dict)}


def named_call(inst: Instruction, args: list[Any]) -> tuple[str, list[Any], dict[str, Any]]:
    """``(fn, positional args, kwargs)`` of a ``shape_fn`` / ``float_fn`` instruction, with the
    value names resolved to this instruction's inputs ``args``."""
    env = dict(zip(inst.inputs, args, strict=True))
    pos = _resolve(list(inst.attrs["args"]), env)
    kw = _resolve(dict(inst.attrs.get("kwargs", {})), env)
    return str(inst.attrs["fn"]), pos, kw


def call_named(inst: Instruction, args: list[Any], table: Mapping[str, Callable[..., Any]], what: str) -> Any:
    """Run a ``shape_fn`` / ``float_fn`` instruction: its function of ``table`` (an allowlist of
    ``what``) on its resolved arguments."""
    name, pos, kw = named_call(inst, args)
    fn = table.get(name)
    if fn is None:
        raise ValueError(f"{inst.op} ({inst.source}): '{name}' is not an allowed {what}")
    return fn(*pos, **kw)


def _refs_are_inputs(inst: Instruction, consts: Any) -> str | None:
    """Arguments name values through ``{"$v": name}``: only this instruction's inputs are in scope."""
    missing = sorted(set(refs_in([inst.attrs.get("args"), inst.attrs.get("kwargs")])) - set(inst.inputs))
    return f"arguments refer to {missing[:3]}, which are not inputs of this instruction" if missing else None


#: the most pieces split / chunk / unbind may make (each is a tensor object: time, not memory)
MAX_PIECES = 2**16
#: the largest integer a layout function may compute (sizes are int64 in torch)
MAX_SHAPE_VALUE = 2**62


def _pieces(name: str, args: list[Any], kwargs: dict[str, Any]) -> int:
    """How many tensors ``split`` / ``chunk`` / ``unbind`` would return (an upper bound), checked
    before the call makes them."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return 0
    at = 1 if name == "unbind" else 2  # split(x, size, dim), chunk(x, n, dim), unbind(x, dim)
    dim = kwargs.get("dim", args[at] if len(args) > at else 0)
    if not isinstance(dim, int) or not -max(x.dim(), 1) <= dim < max(x.dim(), 1) or x.dim() == 0:
        return 0  # torch refuses the call itself
    size = int(x.shape[dim])
    if name == "unbind":
        return size
    how = args[1] if len(args) > 1 else kwargs.get("chunks", kwargs.get("split_size_or_sections"))
    if isinstance(how, int) and not isinstance(how, bool) and how > 0:
        return min(how, size) if name == "chunk" else -(-size // how)
    return len(how) if isinstance(how, (list, tuple)) else 0


def _bounded_value(v: Any) -> Any:
    for x in v if isinstance(v, (tuple, list)) else (v,):
        if isinstance(x, int) and abs(x) > MAX_SHAPE_VALUE:
            raise ShapeError(f"computes {x}, beyond the {MAX_SHAPE_VALUE} a size may reach")
    return v


def _shape_fn_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    """The layout function itself on meta tensors (with every factory on the meta device): its
    result's shapes and dtypes, or torch's refusal of the arguments, and nothing allocated."""
    name, pos, kw = named_call(inst, args)
    if name in ("split", "chunk", "unbind") and _pieces(name, pos, kw) > MAX_PIECES:
        raise ShapeError(f"{name} would make {_pieces(name, pos, kw)} tensors (limit {MAX_PIECES})")
    with torch.device("meta"):
        try:
            out = meta_call(name, SHAPE_FUNCTIONS[name], *pos, **kw)
        except (ZeroDivisionError, OverflowError, KeyError, AttributeError) as e:
            raise ShapeError(f"{name}: {type(e).__name__}: {e}") from None
    if isinstance(out, torch.Size):
        out = tuple(out)
    return [_bounded_value(out)]


@register_kernel(
    "shape_fn",
    schema=KernelSchema(
        extra=_refs_are_inputs,
        inputs=(0, 64),
        attrs=named_call_attrs(SHAPE_FUNCTIONS),
        shape=_shape_fn_shape,
        work=lambda inst, args, outs: 0,  # views, or a copy that is its output
    ),
)
def shape_fn(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` for ``fn`` in :data:`SHAPE_FUNCTIONS`; ``args`` refer to values by name."""
    out = call_named(inst, args, SHAPE_FUNCTIONS, "layout function")
    if isinstance(out, torch.Size):
        out = tuple(out)
    return [out]
