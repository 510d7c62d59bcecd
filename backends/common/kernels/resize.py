"""Resize kernels on codes with integer tables computed at lowering for the compiled input size:
nearest (source indices per axis) and bilinear (two taps and fixed-point weights per axis)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel, requant_i64, sat_to
from backends.common.kernels.schema import MAX_COUNT, MULT, OUT_DTYPE, SHIFT, Const, KernelSchema, ints
from backends.common.program import Instruction

_BILINEAR_CONSTS = (
    "hi0",
    "hi1",
    "wi0",
    "wi1",
    *(f"{a}{i}_{b}" for a in ("hw", "ww") for i in (0, 1) for b in (12, 15)),
)


def _check_size(inst: Instruction, args: list[Any]) -> None:
    """The tables were computed for one input size and output size: refuse others. A run-time
    output size (``size=lateral.shape[2:]``) is the kernel's second input."""
    x = args[0]
    h, w = inst.attrs["in_size"]
    if (int(x.shape[-2]), int(x.shape[-1])) != (int(h), int(w)):
        raise ValueError(f"{inst.op} ({inst.source}): compiled for input size {h}x{w}, got {x.shape[-2]}x{x.shape[-1]}")
    if len(args) > 1:
        size = args[1]
        got = (int(size), int(size)) if isinstance(size, int) else tuple(int(s) for s in size)[-2:]
        oh, ow = inst.attrs["out_size"]
        if got != (int(oh), int(ow)):
            raise ValueError(f"{inst.op} ({inst.source}): compiled for output size {oh}x{ow}, asked for {got}")


@register_kernel(
    "resize_nearest",
    schema=KernelSchema(
        inputs=(1, 2),  # the second: a run-time output size, checked against out_size
        attrs={"in_size": ints(1, MAX_COUNT, 2), "out_size": ints(1, MAX_COUNT, 2, required=False)},
        consts={"rows": Const(("int64",), (1, 1)), "cols": Const(("int64",), (1, 1))},
    ),
)
def resize_nearest(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    x = args[0]
    _check_size(inst, args)
    return [x.index_select(-2, state["rows"]).index_select(-1, state["cols"])]


@register_kernel(
    "resize_bilinear",
    schema=KernelSchema(
        inputs=(1, 2),
        attrs={
            "in_size": ints(1, MAX_COUNT, 2),
            "out_size": ints(1, MAX_COUNT, 2, required=False),
            "multiplier12": MULT,
            "shift12": SHIFT,
            "multiplier15": MULT,
            "shift15": SHIFT,
            "out_dtype": OUT_DTYPE,
        },
        consts={k: Const(("int64",), (1, 1)) for k in _BILINEAR_CONSTS},
    ),
)
def resize_bilinear(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``acc = sum w_y * w_x * q`` in int64, then one requantization (int64: with int16 input
    ``|acc * M|`` reaches 2**60, beyond float64's exact range)."""
    x = args[0]
    _check_size(inst, args)
    a = inst.attrs
    bits = 12 if x.dtype == torch.int8 else 15
    s = state
    q = x.to(torch.int64)
    hw0, hw1 = s[f"hw0_{bits}"].to(torch.int64)[:, None], s[f"hw1_{bits}"].to(torch.int64)[:, None]
    rows = q.index_select(-2, s["hi0"]) * hw0 + q.index_select(-2, s["hi1"]) * hw1
    ww0, ww1 = s[f"ww0_{bits}"].to(torch.int64), s[f"ww1_{bits}"].to(torch.int64)
    acc = rows.index_select(-1, s["wi0"]) * ww0 + rows.index_select(-1, s["wi1"]) * ww1
    out = requant_i64(acc, torch.tensor(int(a[f"multiplier{bits}"])), torch.tensor(int(a[f"shift{bits}"])), None)
    dt = str(a["out_dtype"])
    lo, hi = qbounds(dt)
    return [sat_to(out.clamp_(lo, hi), dt)]
