"""Result shapes of conv / linear / elementwise ops on meta tensors, without torch's meta kernels.

Shape inference (``Op.infer_type``, which the verifier runs on every node) computes each op
on meta tensors. torch's meta kernels for convolutions and for a ``+`` on meta tensors run
Python decompositions (about 1 ms a call); the formulas here give the same shape and dtype
in microseconds. They answer only the plain case: floating meta tensors of one dtype, shapes
that agree (no broadcasting of a fused addend, zero padding given as numbers, batched input);
anything else returns None and goes to torch, which computes it or raises its own error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "adaptive_pool_shape",
    "binary_shape",
    "cat_shape",
    "conv_out_shape",
    "conv_shape",
    "linear_shape",
    "meta_result",
    "pool_shape",
]


def _float_meta(*ts: Any) -> bool:
    """All given tensors (None: absent) are floating meta tensors of one dtype."""
    dtype = None
    for t in ts:
        if t is None:
            continue
        if not (isinstance(t, torch.Tensor) and t.device.type == "meta" and t.is_floating_point()):
            return False
        if dtype is not None and t.dtype != dtype:
            return False
        dtype = t.dtype
    return True


def meta_result(shape: Sequence[int] | None, like: torch.Tensor) -> torch.Tensor | None:
    """An empty meta tensor of ``shape`` and ``like``'s dtype (None when ``shape`` is None)."""
    return None if shape is None else torch.empty(tuple(shape), dtype=like.dtype, device="meta")


def conv_shape(
    x: Any,
    w: Any,
    b: Any,
    addend: Any,
    stride: Sequence[int],
    padding: Any,
    dilation: Sequence[int],
    groups: int,
) -> tuple[int, ...] | None:
    """``convNd(x, w, b, stride, padding, dilation, groups) (+ addend)``'s shape, for zero padding
    given per spatial dim and a batched input; None otherwise."""
    if not _float_meta(x, w, b, addend) or isinstance(padding, str):
        return None
    if b is not None and tuple(b.shape) != (w.shape[0],):
        return None
    shape = conv_out_shape(tuple(x.shape), tuple(w.shape), stride, padding, dilation, groups)
    if shape is None:
        return None
    if addend is not None and tuple(addend.shape) != shape:
        return None
    return shape


def linear_shape(x: Any, w: Any, b: Any, addend: Any) -> tuple[int, ...] | None:
    """``linear(x, w, b) (+ addend)``'s shape; None unless the shapes agree without broadcasting."""
    if not _float_meta(x, w, b, addend) or w.dim() != 2 or x.dim() < 2 or x.shape[-1] != w.shape[1]:
        return None
    if b is not None and tuple(b.shape) != (w.shape[0],):
        return None
    shape = (*x.shape[:-1], w.shape[0])
    if addend is not None and tuple(addend.shape) != shape:
        return None
    return shape


def binary_shape(a: Any, b: Any) -> tuple[int, ...] | None:
    """The broadcast shape of two floating meta tensors of one dtype (an add / sub / mul keeps
    that dtype); None for anything else (scalars, mixed dtypes, shapes that do not broadcast)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _float_meta(a, b)):
        return None
    try:
        return tuple(torch.broadcast_shapes(a.shape, b.shape))
    except RuntimeError:
        return None


# -- pure shape formulas: shape tuples in, a shape tuple out (None: not the plain case; torch decides)


def _positive(*vs: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in vs)


def _per_dim(v: Any, nd: int) -> tuple[Any, ...] | None:
    """An int or an ``nd``-tuple of a pool's hyper-parameter as ``nd`` entries (None: another form)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * nd
    if isinstance(v, (tuple, list)) and len(v) == nd:
        return tuple(v)
    if isinstance(v, (tuple, list)) and len(v) == 1:  # torch repeats a one-element window
        return tuple(v) * nd
    return None


def pool_shape(
    shape: Sequence[int],
    nd: int,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> tuple[int, ...] | None:
    """``max_poolNd`` / ``avg_poolNd``'s result shape for a batched input of ``nd`` spatial dims
    (torch's ``pooling_output_shape``, ceil mode included); None outside the plain case (an
    unbatched or empty input, padding over half the kernel, an empty result)."""
    k = _per_dim(kernel_size, nd)
    s = k if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) else _per_dim(stride, nd)
    p, d = _per_dim(padding, nd), _per_dim(dilation, nd)
    if k is None or s is None or p is None or d is None or len(shape) != nd + 2 or not _positive(*shape):
        return None
    if nd == 3 and any(n < kk for n, kk in zip(shape[2:], k, strict=True)):
        return None  # avg_pool3d refuses an input smaller than its kernel, padded or not: torch says so
    sizes = []
    for n, kk, ss, pp, dd in zip(shape[2:], k, s, p, d, strict=True):
        if not (_positive(kk, ss, dd) and isinstance(pp, int) and 0 <= pp <= kk // 2):  # torch's pad limit
            return None
        out = (n + 2 * pp - dd * (kk - 1) - 1 + (ss - 1 if ceil_mode else 0)) // ss + 1
        if ceil_mode and (out - 1) * ss >= n + pp:
            out -= 1  # the last window must start inside the input or its left padding
        if out < 1:
            return None
        sizes.append(out)
    return (*shape[:2], *sizes)


def adaptive_pool_shape(shape: Sequence[int], nd: int, output_size: Any) -> tuple[int, ...] | None:
    """``adaptive_{avg,max}_poolNd``'s result shape for a batched input (None entries of
    ``output_size`` keep the input size); None outside the plain case."""
    o = _per_dim(output_size, nd)
    if o is None or len(shape) != nd + 2 or not _positive(*shape) or (nd == 1 and None in o):
        return None  # (the 1-d pools take no None)
    sizes = tuple(n if v is None else v for n, v in zip(shape[2:], o, strict=True))
    return (*shape[:2], *sizes) if _positive(*sizes) else None


def cat_shape(shapes: Sequence[Sequence[int]], dim: int) -> tuple[int, ...] | None:
    """``torch.cat``'s result shape: same rank, equal sizes off ``dim``; None for anything else
    (torch's skipping of 1-D empty tensors, ranks that differ, a dim out of range)."""
    if not shapes:
        return None
    rank = len(shapes[0])
    if rank == 0 or not -rank <= dim < rank or any(len(s) != rank for s in shapes):
        return None
    d = dim % rank
    if any(tuple(s[:d]) + tuple(s[d + 1 :]) != tuple(shapes[0][:d]) + tuple(shapes[0][d + 1 :]) for s in shapes):
        return None
    if any(len(s) == 1 and s[0] == 0 for s in shapes):
        return None
    return (*shapes[0][:d], sum(s[d] for s in shapes), *shapes[0][d + 1 :])


def conv_out_shape(
    shape: Sequence[int],
    weight: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> tuple[int, ...] | None:
    """``convNd``'s result shape (zero padding given per spatial dim, batched non-empty input)."""
    d = len(weight) - 2
    if not all(isinstance(v, (tuple, list)) for v in (stride, padding, dilation)):
        return None
    if d < 1 or len(shape) != d + 2 or not (len(stride) == len(padding) == len(dilation) == d) or groups < 1:
        return None
    if 0 in shape or shape[1] != weight[1] * groups or weight[0] % groups:
        return None
    sizes = []
    for n, k, s, p, dil in zip(shape[2:], weight[2:], stride, padding, dilation, strict=True):
        if s < 1 or p < 0 or dil < 1:
            return None
        out = (n + 2 * p - dil * (k - 1) - 1) // s + 1
        if out < 1:
            return None
        sizes.append(out)
    return (shape[0], weight[0], *sizes)
