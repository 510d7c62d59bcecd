"""Boundary kernels: ``quantize`` (float -> codes) and ``dequantize`` (codes -> float32).

These hold the only floats of a Program: the input scale (an attr) and the output scale
(a float32 constant, per tensor or per channel).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel
from backends.common.kernels.schema import DIM, OUT_DTYPE, Const, KernelSchema, floating, optional
from backends.common.program import Instruction

_TORCH = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}


@register_kernel(
    "quantize",
    schema=KernelSchema(attrs={"scale": floating(1e-30, 1e30), "dtype": OUT_DTYPE}),
)
def quantize(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``sat(floor(x / s + 1/2))``: one IEEE division (float32; float64 for float64 input or qint32),
    the half-up tie decided on the exact fraction ``v - floor(v)``."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"quantize ({inst.source}): expected a float tensor input, got {getattr(x, 'dtype', type(x).__name__)}"
        )
    dtype = str(inst.attrs["dtype"])
    ct = torch.float64 if dtype == "qint32" or x.dtype == torch.float64 else torch.float32
    v = x.to(ct) / torch.tensor(float(inst.attrs["scale"]), dtype=torch.float32).to(ct)
    f = torch.floor(v)
    f += v.sub_(f).ge_(0.5)  # in place: the fraction v - floor(v) is exact, then its tie test as 0 / 1
    lo, hi = qbounds(dtype)
    return [f.clamp_(lo, hi).to(_TORCH[dtype])]


def _prepare_dequant(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return consts[inst.consts["scale"]].to(torch.float32).reshape(-1)


@register_kernel(
    "dequantize",
    prepare=_prepare_dequant,
    schema=KernelSchema(attrs={"axis": optional(DIM)}, consts={"scale": Const(("float32",), (0, 1))}),
)
def dequantize(inst: Instruction, args: list[Any], state: torch.Tensor) -> list[Any]:
    """``float32(q) * s`` (per channel along ``axis`` when the scale has several entries)."""
    x = args[0]
    if x.is_floating_point():
        return [x]
    s = state
    axis = inst.attrs.get("axis")
    if s.numel() > 1:
        if axis is None:
            raise ValueError(f"dequantize ({inst.source}): per-channel scale without an axis")
        shape = [1] * x.dim()
        shape[int(axis) % x.dim()] = -1
        s = s.reshape(shape)
    else:
        s = s.reshape(())
    return [x.to(torch.float32) * s]
