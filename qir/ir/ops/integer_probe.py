"""Verify-time runs of stateless integer layers on zero codes.

A converted FloatFunctional (``qadd``, ``qcat``, ``qmatmul``, ...) derives its requantization
parameters from its scales when called, with the limits of its march and output dtype (a
multiplier limit the ratio ``in_scale / out_scale`` must stay under, the dtypes a march can
requantize to). Those rules live with the integer modules, above ``qir.ir``; rather than
restate them here, :func:`probe` calls the op's own module (rebuilt by the builder the module
layer registered) on zero codes of the operand types, so ``verify`` refuses what the run would.
It runs only where that is cheap (at most :data:`PROBE_ELEMENTS` operand elements; larger
operands are checked for shapes, dtypes and scales only) and remembers each op and operand
types it has seen.
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

#: total operand elements up to which :func:`probe` runs a layer on zeros
PROBE_ELEMENTS = 2**16


def probe(op: Any, operand_types: Sequence[Type]) -> None:
    """Run ``op`` (an integer op without state operands) on zero codes of ``operand_types``;
    an error it raises becomes an :class:`IRError` naming the op."""
    tensors = [t for t in operand_types if isinstance(t, TensorType)]
    if sum(t.numel for t in tensors) > PROBE_ELEMENTS:
        return
    try:
        integer_module_builder(op.name)
    except IRError:  # the module layer is not imported: nothing can run the op, nothing to ask
        return
    error = _probe(op, tuple(operand_types))
    if error is not None:
        raise IRError(f"op {op.name!r} fails on its operand types {list(operand_types)}: {error}")


@functools.lru_cache(maxsize=4096)
def _probe(op: Any, operand_types: tuple[Type, ...]) -> str | None:
    operands: list[Any] = []
    for t in operand_types:
        if isinstance(t, TensorType):
            operands.append(torch.zeros(t.shape, dtype=t.dtype.to_torch()))
        elif isinstance(t, ScalarType) and t.kind in ("int", "float"):
            operands.append(1 if t.kind == "int" else 0.5)  # a run-time number: any value of its kind
        else:
            return f"operand of type {t} is not a tensor or a number"
    try:
        op.evaluate(None, operands)
    except (ArithmeticError, RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None
