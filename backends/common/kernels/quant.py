"""Boundary kernels: ``quantize`` (float -> codes) and ``dequantize`` (codes -> float32).

These hold the only floats of a Program: the input scale (an attr) and the output scale
(a float32 constant, per tensor or per channel).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels import native
from backends.common.kernels.base import qbounds, register_kernel
from backends.common.kernels.infer import ShapeError, broadcast, code, meta, tensor_arg
from backends.common.kernels.schema import DIM, OUT_DTYPE, Const, KernelSchema, floating, optional
from backends.common.program import Instruction

_TORCH = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}


def _quantize_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = tensor_arg(args, 0)
    if not x.is_floating_point():
        raise ShapeError(f"quantize takes a float tensor, got {x.dtype}")
    return [code(x.shape, inst.attrs["dtype"])]


def _dequantize_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = tensor_arg(args, 0)
    if x.is_floating_point():
        return [x]
    n = consts[inst.consts["scale"]].numel()
    if n <= 1:
        return [meta(x.shape, torch.float32)]
    axis = inst.attrs.get("axis")
    if axis is None or x.dim() == 0:
        raise ShapeError(f"a per-channel scale of {n} entries needs an axis of a tensor, got axis {axis} of {x.shape}")
    shape = [1] * x.dim()
    shape[int(axis) % x.dim()] = n
    return [meta(broadcast(x, meta(shape, torch.float32)), torch.float32)]


@register_kernel(
    "quantize",
    schema=KernelSchema(attrs={"scale": floating(1e-30, 1e30), "dtype": OUT_DTYPE}, shape=_quantize_shape),
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
    codes = _quantize_native(x, float(inst.attrs["scale"]), dtype)
    if codes is not None:
        return [codes]
    ct = torch.float64 if dtype == "qint32" or x.dtype == torch.float64 else torch.float32
    v = x.to(ct) / torch.tensor(float(inst.attrs["scale"]), dtype=torch.float32).to(ct)
    f = torch.floor(v)
    f += v.sub_(f).ge_(0.5)  # in place: the fraction v - floor(v) is exact, then its tie test as 0 / 1
    lo, hi = qbounds(dtype)
    return [f.clamp_(lo, hi).to(_TORCH[dtype])]


def _quantize_native(x: torch.Tensor, scale: float, dtype: str) -> torch.Tensor | None:
    """The same rule in one native pass over a float32 (N, C, H, W) input, codes laid out NHWC (the
    layout the conv kernels read); None where it does not apply (no library, another dtype or rank,
    a non-finite input: the torch path decides those)."""
    lib = native.library()
    if lib is None or x.dtype != torch.float32 or x.dim() != 4 or dtype not in ("qint8", "qint16"):
        return None
    xc = x.contiguous()
    nb, c, h, w = (int(d) for d in xc.shape)
    out = torch.empty((nb, h, w, c), dtype=_TORCH[dtype])
    # the C loop reads pixels [r0, r1) of nb * h * w (all c planes of each) and writes their NHWC codes
    assert xc.numel() == out.numel() == nb * c * h * w
    name = "qir_quantize_pixels_i8" if dtype == "qint8" else "qir_quantize_pixels_i16"
    p = native.ptr
    # the float32 scale the torch path divides by, passed as its bits; returns the non-finite count.
    # Parts cut at 64 pixels: whole cache lines of codes per thread
    bad = native.run(name, (p(xc), c, h * w, native.float_bits(scale), p(out)), nb * h * w, xc.numel(), grain=64)
    return None if bad else out.permute(0, 3, 1, 2)


def _prepare_dequant(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return consts[inst.consts["scale"]].to(torch.float32).reshape(-1)


@register_kernel(
    "dequantize",
    prepare=_prepare_dequant,
    schema=KernelSchema(
        attrs={"axis": optional(DIM)}, consts={"scale": Const(("float32",), (0, 1))}, shape=_dequantize_shape
    ),
)
def dequantize(inst: Instruction, args: list[Any], state: torch.Tensor) -> list[Any]:
    """``float32(q) * s`` (per channel along ``axis`` when the scale has several entries), in torch's
    standard (contiguous) layout whatever layout the integer kernels left the codes in (NHWC after a
    native conv): the float part reads it as the converted model's float tensor, and torch's float
    functions can round differently (1 ULP) on another memory layout (a vectorized inner loop)."""
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
    return [(x.to(torch.float32) * s).contiguous()]


def _constant_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    c = consts[inst.consts["value"]]
    return [meta(c.shape, c.dtype)]


def _prepare_constant(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return consts[inst.consts["value"]]


@register_kernel(
    "constant",
    prepare=_prepare_constant,
    schema=KernelSchema(
        inputs=(0, 0),
        consts={"value": Const(("int8", "int16", "int32", "int64", "float32"), (0, 8))},
        shape=_constant_shape,
    ),
)
def constant(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """The codes of a parameter a QuantStub quantizes (a DETR query embedding), quantized when the
    program was compiled, or a float32 / int64 buffer the float part reads (a decoder's grid); a
    copy, so a caller that edits an output cannot change the program."""
    return [state.clone()]
