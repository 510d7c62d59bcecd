"""A tensor of codes times / plus a number known only at run time: ``x * (1.0 / w)`` with ``w``
read from ``x.shape``. The number arrives as the kernel's second input (a shape value computed
by the program), and the kernel derives the integer parameters from it on each call with the
same rule the converted model's ``QFunctional`` runs (``backends/common/integer_rules.py``), so
the two agree bit for bit at every input size. A number fixed at compile time uses the ``mul``
and ``add`` kernels with precomputed parameters instead."""

from __future__ import annotations

from typing import Any

import torch

from backends.common.integer_rules import add_scalar_int, mul_scalar_int
from backends.common.kernels.base import register_kernel
from backends.common.kernels.infer import ShapeError, code, tensor_arg
from backends.common.kernels.schema import OUT_DTYPE, KernelSchema, floating, one_of
from backends.common.program import Instruction


def _scalar_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    """Codes of ``out_dtype`` in the shape of x; y a number (at load: the one the declared input
    shapes give)."""
    x = tensor_arg(args, 0, "x")
    if x.is_floating_point() or x.dtype == torch.bool:
        raise ShapeError(f"{inst.op} takes integer codes, got {x.dtype}")
    y = args[1]
    if isinstance(y, bool) or not isinstance(y, (int, float)):
        raise ShapeError(f"{inst.op}: input 1 must be a number, got {type(y).__name__} {y!r:.40}")
    return [code(x.shape, inst.attrs["out_dtype"])]


_SCHEMA = KernelSchema(
    inputs=(2, 2),
    attrs={
        "in_scale": floating(1e-30, 1e30),
        "out_scale": floating(1e-30, 1e30),
        "march": one_of("bayes", "bernoulli2"),
        "out_dtype": OUT_DTYPE,
    },
    shape=_scalar_shape,
)


def _number(inst: Instruction, y: Any) -> Any:
    if isinstance(y, bool) or not isinstance(y, (int, float)):
        raise TypeError(f"{inst.op} ({inst.source}): the second input must be a number, got {type(y).__name__}")
    return y


@register_kernel("mul_scalar_dynamic", schema=_SCHEMA)
def mul_scalar_dynamic(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``x * y`` for a run-time number ``y``: :func:`~backends.common.integer_rules.mul_scalar_int`."""
    a = inst.attrs
    y = _number(inst, args[1])
    return [mul_scalar_int(args[0], y, float(a["in_scale"]), float(a["out_scale"]), a["march"], a["out_dtype"])]


@register_kernel("add_scalar_dynamic", schema=_SCHEMA)
def add_scalar_dynamic(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``x + y`` for a run-time number ``y``: :func:`~backends.common.integer_rules.add_scalar_int`."""
    a = inst.attrs
    y = _number(inst, args[1])
    return [add_scalar_int(args[0], y, float(a["in_scale"]), float(a["out_scale"]), a["march"], a["out_dtype"])]
