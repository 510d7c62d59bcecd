"""Verify-time runs of stateless integer layers on zero codes.

A converted FloatFunctional (``qadd``, ``qcat``, ``qmatmul``, ...) derives its requantization
parameters from its scales when called, with the limits of its march and output dtype (a
multiplier limit the ratio ``in_scale / out_scale`` must stay under, the dtypes a march can
requantize to). Those rules live with the integer modules, above ``qir.ir``; rather than
restate them here, :func:`probe` calls the op's own module (rebuilt by the builder the module
layer registered) on zero codes, so ``verify`` refuses what the run would.

The rules read scales, dtypes and the march, not sizes (shapes are the op's type inference's
business, checked before the probe), except where the op says so (a ``mean`` folds ``1 / n``
into its multiplier, ``n`` the elements it reduces: :meth:`probe_dims`). So the probe runs on
operands of the same ranks and dtypes with every other dimension shrunk to at most 1: a layer
over any number of elements costs a few bytes to check. A probe whose kept dimensions still
hold more than :data:`PROBE_ELEMENTS` elements (a mean over more than 2**20 elements per
output) runs on ``meta`` tensors of those shapes instead: the parameter rules read sizes and
scales, never the codes, so the same rules run (and refuse what they refuse) without the
allocation; an op that declares ``probe_dims`` must therefore run on meta tensors. Each op and
probe shape is remembered.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from qir.ir.op import IRError
from qir.ir.ops.integer import integer_module_builder
from qir.ir.types import ScalarType, TensorType, Type

__all__ = ["PROBE_ELEMENTS", "probe"]

#: total elements of the shrunk operands up to which :func:`probe` runs a layer on zero codes
#: (above it, on meta tensors)
PROBE_ELEMENTS = 2**20


def probe(op: Any, operand_types: Sequence[Type]) -> None:
    """Run ``op`` (an integer op without state operands) on zero codes of ``operand_types``;
    an error it raises becomes an :class:`IRError` naming the op."""
    kept = getattr(op, "probe_dims", lambda types: [() for _ in types])(operand_types)
    small = tuple(_shrunk(t, dims) for t, dims in zip(operand_types, kept, strict=True))
    device = "meta" if sum(t.numel for t in small if isinstance(t, TensorType)) > PROBE_ELEMENTS else "cpu"
    try:
        integer_module_builder(op.name)
    except IRError:  # the module layer is not imported: nothing can run the op, nothing to ask
        return
    error = _probe(op, small, device)
    if error is not None:
        raise IRError(f"op {op.name!r} fails on its operand types {list(operand_types)}: {error}")


def _shrunk(t: Type, keep: Sequence[int]) -> Type:
    """``t`` with each dimension not in ``keep`` shrunk to at most 1 (0 stays 0: an empty operand
    is what the run gets)."""
    if not isinstance(t, TensorType):
        return t
    kept = {d % t.rank for d in keep} if t.rank else set()
    shape = tuple(n if i in kept else min(n, 1) for i, n in enumerate(t.shape))
    return TensorType(shape, t.dtype)  # a per-channel spec would not fit the shrunk shape


@functools.lru_cache(maxsize=4096)
def _probe(op: Any, operand_types: tuple[Type, ...], device: str) -> str | None:
    operands: list[Any] = []
    for t in operand_types:
        if isinstance(t, TensorType):
            operands.append(torch.zeros(t.shape, dtype=t.dtype.to_torch(), device=device))
        elif isinstance(t, ScalarType) and t.kind in ("int", "float"):
            operands.append(1 if t.kind == "int" else 0.5)  # a run-time number: any value of its kind
        else:
            return f"operand of type {t} is not a tensor or a number"
    try:
        op.evaluate(None, operands)
    except (ArithmeticError, RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None
