"""Kernels of ops that compute exactly on codes: abs, comparisons, padding (docs/semantics.md, "Ops on codes").

Their integer constants (comparison bounds, the pad value's code) are derived at conversion
and read from the converted graph by the lowering; the kernels only apply them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from backends.common.comparisons import COMPARISONS  # the operators QAT evaluates: one table
from backends.common.kernels.base import register_kernel
from backends.common.kernels.infer import ShapeError, broadcast, meta, meta_call, tensor_arg
from backends.common.kernels.schema import (
    CODE_BOUND,
    MAX_EXTENT,
    KernelSchema,
    boolean,
    integer,
    ints,
    one_of,
    optional,
)
from backends.common.program import Instruction


def _abs_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    x = tensor_arg(args, 0)
    if x.is_floating_point() or x.dtype == torch.bool:
        raise ShapeError(f"abs takes integer codes, got {x.dtype}")
    return [x]


def _compare_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    x = tensor_arg(args, 0, "x")
    if len(args) == 1:
        return [meta(x.shape, torch.bool)]
    if "op" not in inst.attrs:
        raise ShapeError("compare of two inputs needs the op attribute")
    return [meta(broadcast(x, tensor_arg(args, 1, "y")), torch.bool)]


def _pad_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    a = inst.attrs
    x = tensor_arg(args, 0)
    pads = [int(p) for p in a["pad"]]
    if a["mode"] == "constant":
        if "value" not in a:
            raise ShapeError("constant padding needs the value attribute")
        return [meta_call("pad", F.pad, x, pads, mode="constant", value=0)]
    return [meta_call("pad", F.pad, x, pads, mode=str(a["mode"]))]


@register_kernel(
    "abs",
    schema=KernelSchema(shape=_abs_shape),
)
def abs_(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``min(|x|, qmax)`` in the input's dtype (``|-128|`` saturates to 127 for qint8)."""
    x = args[0]
    return [x.to(torch.int64).abs().clamp_(max=torch.iinfo(x.dtype).max).to(x.dtype)]


@register_kernel(
    "compare",
    schema=KernelSchema(
        inputs=(1, 2),
        attrs={
            "op": one_of(*sorted(COMPARISONS), required=False),
            "lo": optional(CODE_BOUND, required=False),
            "hi": optional(CODE_BOUND, required=False),
            "negate": boolean(required=False),
        },
        shape=_compare_shape,
    ),
)
def compare(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """One input: ``lo <= x <= hi`` (attrs ``lo`` / ``hi``, None = unbounded; negated when
    ``negate``), on int64 so bounds outside the dtype's range are exact. Two inputs on one
    scale: the attr ``op`` applied to the codes."""
    a = inst.attrs
    if len(args) == 2:
        return [COMPARISONS[str(a["op"])](args[0], args[1])]
    x = args[0].to(torch.int64)
    inside = torch.ones(x.shape, dtype=torch.bool)
    if a.get("lo") is not None:
        inside &= x >= int(a["lo"])
    if a.get("hi") is not None:
        inside &= x <= int(a["hi"])
    return [~inside if a.get("negate") else inside]


@register_kernel(
    "pad",
    schema=KernelSchema(
        attrs={
            "mode": one_of("constant", "reflect", "replicate", "circular"),
            "pad": ints(0, MAX_EXTENT, (2, 6)),
            "value": integer(-(2**31), 2**31 - 1, required=False),
        },
        shape=_pad_shape,
    ),
)
def pad(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``F.pad`` of codes: ``pad`` (last dimension first), ``mode``; constant mode pads the code ``value``."""
    a = inst.attrs
    mode = str(a["mode"])
    if mode == "constant":
        return [F.pad(args[0], [int(p) for p in a["pad"]], mode="constant", value=int(a["value"]))]
    return [F.pad(args[0], [int(p) for p in a["pad"]], mode=mode)]
