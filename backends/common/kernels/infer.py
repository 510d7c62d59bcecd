"""Output shapes of the integer kernels, declared beside each kernel's schema and evaluated when an
artifact is loaded (``backends.common.artifact_shapes``).

A kernel's shape declaration (``KernelSchema(shape=...)``) takes the instruction, its arguments
as *abstract values* and the program's constants, and returns its outputs as abstract values, or
raises :class:`ShapeError` saying which operand does not fit and why. Abstract values are:

* a tensor: a tensor on the ``meta`` device (a shape and a dtype, no data, nothing allocated);
* a Python value (an int from a shape query, a tuple of them, a list of tensors): itself.

Declarations are plain Python over shapes and attributes. Where the kernel's work is one torch
function whose shape rule torch already states (a convolution's output size, a pooling window,
``F.pad``), the declaration calls that function on meta tensors: the rule is torch's own, and
the kernel's real call cannot disagree with it. Kernels themselves never run on meta tensors
(they allocate work buffers on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "CODE_TORCH",
    "ShapeError",
    "broadcast",
    "code",
    "meta",
    "meta_call",
    "same_shape",
    "tensor_arg",
]

#: The torch dtype of each code dtype name (``out_dtype`` attributes).
CODE_TORCH = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}


class ShapeError(ValueError):
    """An instruction's operands do not fit its kernel (the message says which and why)."""


def meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An abstract tensor: ``shape`` and ``dtype`` on the meta device."""
    return torch.empty(tuple(int(d) for d in shape), dtype=dtype, device="meta")


def code(shape: Sequence[int], dtype_name: Any) -> torch.Tensor:
    """An abstract code tensor of ``shape`` and the code dtype named ``dtype_name`` (``qint8`` ...)."""
    return meta(shape, CODE_TORCH[str(dtype_name)])


def tensor_arg(args: Sequence[Any], i: int, what: str = "", rank: tuple[int, int] | None = None) -> torch.Tensor:
    """``args[i]``, which must be a tensor (of rank within ``rank``)."""
    if i >= len(args):
        raise ShapeError(f"input {i}{' (' + what + ')' if what else ''} is missing")
    v = args[i]
    label = f"input {i}{' (' + what + ')' if what else ''}"
    if not isinstance(v, torch.Tensor):
        raise ShapeError(f"{label} must be a tensor, got {type(v).__name__} {v!r:.40}")
    if rank is not None and not rank[0] <= v.dim() <= rank[1]:
        want = str(rank[0]) if rank[0] == rank[1] else f"{rank[0]} to {rank[1]}"
        raise ShapeError(f"{label} has rank {v.dim()} (shape {list(v.shape)}), the kernel takes rank {want}")
    return v


def broadcast(*tensors: torch.Tensor) -> torch.Size:
    """The broadcast shape of ``tensors``, or a ShapeError naming their shapes."""
    try:
        return torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        raise ShapeError(f"shapes {', '.join(str(list(t.shape)) for t in tensors)} do not broadcast") from None


def same_shape(out_dtype_attr: str | None = None) -> Callable[[Any, list[Any], Mapping[str, torch.Tensor]], list[Any]]:
    """The declaration of a one-tensor kernel whose output has its input's shape and the dtype named
    by attribute ``out_dtype_attr`` (None: the input's dtype)."""

    def shape(inst: Any, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
        x = tensor_arg(args, 0)
        dtype = x.dtype if out_dtype_attr is None else CODE_TORCH[str(inst.attrs[out_dtype_attr])]
        return [meta(x.shape, dtype)]

    return shape


def meta_call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on meta tensors; torch's refusal becomes a ShapeError naming ``what``."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShapeError(f"{what}: {first[:300]}") from None
