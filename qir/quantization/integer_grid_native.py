"""The integer grid's requantization, fused conv + add, input codes and weight codes as one native pass each
(``native_grid.c``).

:func:`~qir.quantization.integer_grid_conv.requant_blocks` evaluates ``clamp(floor(acc · ratio +
offset), lo, hi) · out_scale`` and its gradient factor in seven or eight torch passes per block (float64
copy, multiply, add, floor, float32 copy, gradient mask, clamp, scale), each a parallel region of
torch's thread pool; :func:`~qir.quantization.integer_grid_conv.input_codes` in two, the weight codes
(:class:`~qir.quantization.integer_grid._WeightCodes`) in eight, the fused conv + add's float64 rule
(:func:`~qir.quantization.integer_grid_conv.fused_add_blocks`) in about fifteen. The C loops of
``backends/common/kernels/native_grid.c`` make the same IEEE operations in one pass over memory and
one split across the native pool's threads, so the results are the torch path's bit for bit
(tests/quantization/test_integer_grid_native.py compares both).

The functions return None where they do not apply (the library unavailable, ``QIR_NATIVE=0``,
:data:`NATIVE` off, a tensor not contiguous float32 on the CPU, constants that are not per channel
along axis 1 (axis 0 for weights), bounds that are tensors or beyond float32's integers): the caller's
torch path runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from backends.common.kernels import native

__all__ = ["NATIVE", "native_abs_row_max", "native_codes", "native_fused_add", "native_requant", "native_weight_codes"]

#: the native pass where it applies; False: the torch path everywhere (the reference the tests compare with)
NATIVE = True

#: integers float32 holds exactly, with their halves (the kernel compares with ``lo - 1/2``, ``hi + 1/2``)
_EXACT = 1 << 22
#: float32's largest finite value
_FLOAT32_MAX = 3.4028234663852886e38
#: what ``qir_grid_abs_row_max`` returns for codes holding a NaN (INT64_MAX)
_NAN_ROW = (1 << 63) - 1
#: elements per row of the input codes' split
_CODES_ROW = 1 << 14


def _available() -> bool:
    return NATIVE and native.library() is not None


def _float32_scalar(v: Any) -> float | None:
    """``v`` (a Python float, a 0-d tensor, or a one-value float32 tensor) as the Python float the kernel
    rounds to float32, or None where the torch path must run: a one-value float64 tensor that is not
    0-d makes torch compute in float64; a value float32 cannot hold (struct refuses to pack it)."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or not v.is_floating_point() or (v.dim() > 0 and v.dtype != torch.float32):
            return None
        v = float(v.reshape(()))
    elif not isinstance(v, float):
        return None
    return v if math.isfinite(v) and abs(v) <= _FLOAT32_MAX else None


def _dense(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _per_channel(t: Any, c: int, nd: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` (broadcasting against a rank-``nd`` tensor of ``c`` channels on axis 1) as ``c`` contiguous
    values, or None when it varies along another axis or has another dtype."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu" or t.dim() > nd:
        return None
    shape = (1,) * (nd - t.dim()) + tuple(t.shape)
    if any(s != 1 for i, s in enumerate(shape) if i != 1) or shape[1] not in (1, c):
        return None
    if shape[1] == c and t.is_contiguous():
        return t
    return t.reshape(-1).expand(c).contiguous()


def native_requant(
    acc: torch.Tensor,
    ratio: Any,
    offset: Any,
    lo: Any,
    hi: Any,
    out_scale: Any,
    acc_grad: Any,
    out: torch.Tensor,
) -> torch.Tensor | None:
    """The gain of :func:`~qir.quantization.integer_grid_conv.requant_blocks` (a new float32 tensor), its
    result written to ``out`` (``acc`` itself, or a float32 tensor of its shape); None (nothing written)
    where the native pass does not apply."""
    if acc.dim() < 2 or acc.numel() == 0 or not _dense(acc) or not _dense(out) or out.shape != acc.shape:
        return None
    if not (isinstance(lo, int) and isinstance(hi, int) and -_EXACT <= lo <= hi <= _EXACT):
        return None
    scale = _float32_scalar(out_scale)
    if scale is None or not _available():
        return None
    nd, c = acc.dim(), acc.shape[1]
    r = _per_channel(ratio, c, nd, torch.float64)
    b = _per_channel(offset, c, nd, torch.float64)
    g = _per_channel(acc_grad, c, nd, torch.float32)
    if r is None or b is None or g is None:
        return None
    gain = torch.empty(acc.shape, dtype=torch.float32)
    rows = acc.shape[0] * c
    p = native.ptr
    args = (p(acc), acc.numel() // rows, c, p(r), p(b), p(g), lo, hi, native.float_bits(scale), p(out), p(gain))
    native.run("qir_grid_requant_rows", args, rows, acc.numel())
    return gain


def native_fused_add(acc: torch.Tensor, addend: torch.Tensor, c: Any, out: torch.Tensor) -> torch.Tensor | None:
    """The keep mask of :func:`~qir.quantization.integer_grid_conv.fused_add_blocks` (a new float32 tensor), its
    result written to ``out`` (``acc`` itself, or a float32 tensor of its shape), from ``c`` (its
    ``AddConstants``); None (nothing written) where the native pass does not apply."""
    if acc.dim() < 2 or acc.numel() == 0 or not _dense(acc) or not _dense(out) or out.shape != acc.shape:
        return None
    if not _dense(addend) or addend.shape != acc.shape:
        return None
    lo, hi, bits = c.lo, c.hi, c.extra_bits
    if not (isinstance(lo, int) and isinstance(hi, int) and -_EXACT <= lo <= hi <= _EXACT):
        return None
    if not (isinstance(bits, int) and 0 <= bits <= 62):
        return None
    scale, inv = _float32_scalar(c.out_scale), _float32_scalar(c.inv_add)
    r2 = c.r2
    if scale is None or inv is None or not isinstance(r2, torch.Tensor) or r2.dtype != torch.float64:
        return None
    if r2.numel() != 1 or r2.device.type != "cpu" or not _available():
        return None
    nd, ch = acc.dim(), acc.shape[1]
    a_lo = _per_channel(c.acc_lo, ch, nd, torch.float32)
    a_hi = _per_channel(c.acc_hi, ch, nd, torch.float32)
    r1 = _per_channel(c.r1, ch, nd, torch.float64)
    off1 = _per_channel(c.off1, ch, nd, torch.float64)
    if a_lo is None or a_hi is None or r1 is None or off1 is None:
        return None
    r2 = r2.reshape(1).contiguous()
    keep = torch.empty(acc.shape, dtype=torch.float32)
    rows = acc.shape[0] * ch
    p = native.ptr
    args = (
        *(p(acc), p(addend), acc.numel() // rows, ch, p(a_lo), p(a_hi), p(r1), p(off1), p(r2)),
        *(native.float_bits(inv), bits, lo, hi, native.float_bits(scale), p(out), p(keep)),
    )
    native.run("qir_grid_fused_add_rows", args, rows, acc.numel())
    return keep


def native_codes(x: torch.Tensor, inv_scale: Any) -> torch.Tensor | None:
    """``round(x · inv_scale)`` (float32 product, half to even) as a new tensor, as
    :func:`~qir.quantization.integer_grid_conv.input_codes` computes it; None where the native pass does
    not apply."""
    if x.numel() == 0 or not _dense(x):
        return None
    inv = _float32_scalar(inv_scale)
    if inv is None or not _available():
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    n = x.numel()
    rows = -(-n // _CODES_ROW)
    args = (native.ptr(x), n, _CODES_ROW, native.float_bits(inv), native.ptr(out))
    native.run("qir_grid_codes_rows", args, rows, n)
    return out


def native_weight_codes(
    w: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int, s_in: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes, factor)`` of :class:`~qir.quantization.integer_grid._WeightCodes`: ``clamp(round_half_up(w /
    scale), qmin, qmax)`` and ``s_in / scale`` where not clamped, else 0 (``scale``: one value, or one per
    slice along axis 0 shaped to broadcast); None where the native pass does not apply."""
    if w.dim() < 1 or w.numel() == 0 or not _dense(w) or not _dense(scale) or not -_EXACT <= qmin <= qmax <= _EXACT:
        return None
    rows = w.shape[0]
    if scale.numel() != 1 and (scale.dim() != w.dim() or scale.shape[0] != rows or scale.numel() != rows):
        return None
    if not _available():
        return None
    fac = s_in / scale  # torch's float32 reciprocal times s_in, as the torch path computes it
    codes = torch.empty(w.shape, dtype=torch.float32)
    factor = torch.empty(w.shape, dtype=torch.float32)
    p = native.ptr
    args = (p(w), w.numel() // rows, scale.numel(), p(scale), p(fac), qmin, qmax, p(codes), p(factor))
    native.run("qir_grid_weight_codes_rows", args, rows, w.numel())
    return codes, factor


def native_abs_row_max(codes: torch.Tensor) -> int | None:
    """The largest sum of ``|codes|`` over a slice along axis 0 (an output channel's weight codes: integers),
    exact; None where the native pass does not apply or a code is NaN (the caller's torch path decides)."""
    if codes.dim() < 1 or codes.numel() == 0 or not _dense(codes) or not _available():
        return None
    rows = codes.shape[0]
    top = native.run("qir_grid_abs_row_max", (native.ptr(codes), codes.numel() // rows), rows, 0)
    return None if top >= _NAN_ROW else top
