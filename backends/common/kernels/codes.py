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


@register_kernel(
    "abs",
    schema=KernelSchema(),
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
        }
    ),
)
def pad(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``F.pad`` of codes: ``pad`` (last dimension first), ``mode``; constant mode pads the code ``value``."""
    a = inst.attrs
    mode = str(a["mode"])
    if mode == "constant":
        return [F.pad(args[0], [int(p) for p in a["pad"]], mode="constant", value=int(a["value"]))]
    return [F.pad(args[0], [int(p) for p in a["pad"]], mode=mode)]
