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

__all__ = ["binary_shape", "conv_shape", "linear_shape", "meta_result"]


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
    d = w.dim() - 2
    if d < 1 or x.dim() != d + 2 or not (len(stride) == len(padding) == len(dilation) == d) or groups < 1:
        return None
    if x.numel() == 0 or x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        return None
    if b is not None and tuple(b.shape) != (w.shape[0],):
        return None
    sizes = []
    for n, k, s, p, dil in zip(x.shape[2:], w.shape[2:], stride, padding, dilation, strict=True):
        if s < 1 or p < 0 or dil < 1:
            return None
        out = (n + 2 * p - dil * (k - 1) - 1) // s + 1
        if out < 1:
            return None
        sizes.append(out)
    shape = (x.shape[0], w.shape[0], *sizes)
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
