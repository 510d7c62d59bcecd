"""Integer rules of the quantized module library that are not in ``backends/common/numerics.py``.

Each rule is built only from numerics' primitives (``multiplier_shift``, ``requantize``,
``round_half_up``, ``saturate``) and is stated in docs/modules.md, "Integer rules":

* fused conv + add (:func:`fused_add_params`, :func:`fused_add_int`, :func:`fused_add_wide`),
* average pooling (:func:`avg_pool_params`),
* bilinear interpolation weights (:func:`bilinear_taps`) and resize output sizes
  (:func:`resize_out_size`),
* division (:func:`div_params`, :func:`div_int`),
* a tensor times / plus a number (:func:`scalar_operand`, :func:`mul_scalar_int`,
  :func:`add_scalar_int`): the number may be known only at run time (``x * (1.0 / w)`` with
  ``w`` from ``x.shape``), so the rule derives its parameters from the number on each call.

Parameters are derived in float64 from float32 scales, like every numerics rule.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from backends.common.numerics import (
    DTypeLike,
    add_int,
    add_params,
    conv_requant_params,
    multiplier_shift,
    multiplier_shift_np,
    qdtype,
    requant_limits,
    requant_params,
    requantize,
    round_half_up,
    saturate,
    shift_right_half_up,
)
from qir.ir.types import DType

__all__ = [
    "FUSED_ADD_MAX_EXTRA_BITS",
    "FUSED_ADD_MID_MAX_MULTIPLIER",
    "FUSED_ADD_MID_MAX_SHIFT",
    "SCALAR_CODE",
    "FusedAddParams",
    "add_scalar_int",
    "adaptive_pool_counts",
    "avg_pool_divisor",
    "avg_pool_params",
    "bilinear_taps",
    "bilinear_weight_bits",
    "check_out_dtype",
    "div_int",
    "div_params",
    "f32",
    "fused_add_int",
    "fused_add_wide",
    "fused_add_params",
    "fused_add_params_np",
    "mul_scalar_int",
    "ratio_params",
    "scalar_operand",
]

#: Extra fraction bits of the fused-add intermediate (its scale is ``s_out / 2**p``, ``p <= 8``).
FUSED_ADD_MAX_EXTRA_BITS = 8
#: The fused add aligns its two operands with 31-bit multipliers (shift <= 62): products stay
#: below 2**62 in int64 and the alignment error is negligible next to the final rounding.
FUSED_ADD_MID_MAX_MULTIPLIER = 2**31 - 1
FUSED_ADD_MID_MAX_SHIFT = 62


def f32(v: float | torch.Tensor) -> float:
    """A scale as the float32 value every rule starts from (then widened to float64)."""
    t = v.detach().reshape(-1)[0] if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    return float(t.to(torch.float32))


def check_out_dtype(march: object, dtype: DTypeLike, what: str) -> DType:
    """``dtype`` as a DType, after checking ``march`` can requantize to it."""
    qd = qdtype(dtype)
    lim = requant_limits(march)
    if qd not in lim.out_dtypes:
        raise ValueError(
            f"{what}: march {march} cannot produce {qd.name} outputs; valid: "
            f"{', '.join(d.name for d in lim.out_dtypes)} (change the activation qconfig dtype)"
        )
    return qd


def ratio_params(ratio: torch.Tensor | float, march: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(multiplier, shift)`` for a float64 ratio (or 1-D ratios) within ``march``'s limits."""
    lim = requant_limits(march)
    r = torch.as_tensor(ratio, dtype=torch.float64)
    return multiplier_shift(r, lim.max_multiplier, lim.max_shift)


# ---------------------------------------------------------------------------------------------
# Fused conv + add
# ---------------------------------------------------------------------------------------------


class FusedAddParams(NamedTuple):
    """Integer parameters of ``act(acc * s_acc + addend * s_add)`` at ``s_out`` (see :func:`fused_add_params`)."""

    acc_multiplier: torch.Tensor  # per output channel, int64
    acc_shift: torch.Tensor  # per output channel, int64
    add_multiplier: int
    add_shift: int
    extra_bits: int  # p: the intermediate has scale s_out / 2**p


def fused_add_params(
    acc_scale: torch.Tensor, addend_scale: float, out_scale: float, march: object, dtype: DTypeLike
) -> FusedAddParams:
    """Parameters of the fused conv + add rule.

    Both operands are requantized onto one intermediate grid ``s_mid = s_out / 2**p``
    (ratios ``r_acc[c] = s_acc[c] * 2**p / s_out`` and ``r_add = s_add * 2**p / s_out``,
    each through :func:`~backends.common.numerics.multiplier_shift` with 31-bit multipliers
    and shifts up to 62), summed exactly, and shifted right by ``p`` with half-up rounding,
    then saturated to ``dtype``. ``p`` is the largest value ``<= 8`` for which every ratio is
    below ``2**31 - 1/2``. The march only decides which output dtypes are allowed.
    """
    s = acc_scale.detach().to(device="cpu", dtype=torch.float64).reshape(-1).numpy()
    m_acc, s_acc, m_add, s_add, p = fused_add_params_np(s, f32(addend_scale), f32(out_scale), march, dtype)
    dev = acc_scale.device
    return FusedAddParams(torch.from_numpy(m_acc).to(dev), torch.from_numpy(s_acc).to(dev), m_add, s_add, p)


def fused_add_params_np(
    acc_scale: np.ndarray, addend_scale: float, out_scale: float, march: object, dtype: DTypeLike
) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """:func:`fused_add_params` of a float64 numpy array of accumulator scales, on the host:
    ``(acc_multiplier, acc_shift, add_multiplier, add_shift, extra_bits)``, the arrays int64."""
    check_out_dtype(march, dtype, "fused conv + add")
    max_m, max_s = FUSED_ADD_MID_MAX_MULTIPLIER, FUSED_ADD_MID_MAX_SHIFT
    # the float32 values of the scales, as f32 gives them (numpy: no torch call per training step)
    so, sa = float(np.float32(out_scale)), float(np.float32(addend_scale))
    r_acc = np.asarray(acc_scale, dtype=np.float64).reshape(-1) / so
    r_add = sa / so
    top = max(float(r_acc.max()), r_add)
    p = FUSED_ADD_MAX_EXTRA_BITS
    while p >= 0 and top * 2.0**p >= max_m + 0.5:
        p -= 1
    if p < 0:
        raise ValueError(
            f"fused conv + add: output scale {so:.6g} is too small for the addend scale {sa:.6g} "
            f"or the accumulator scale {float(np.max(acc_scale)):.6g} (ratio above {max_m}); "
            "the output fake quant must observe a wider range"
        )
    m_acc, s_acc = multiplier_shift_np(r_acc * 2.0**p, max_m, max_s)
    m_add, s_add = multiplier_shift_np(np.array(r_add * 2.0**p), max_m, max_s)
    return np.ascontiguousarray(m_acc), np.ascontiguousarray(s_acc), int(m_add), int(s_add), p


def fused_add_int(
    acc: torch.Tensor,
    addend: torch.Tensor,
    acc_multiplier: torch.Tensor,
    acc_shift: torch.Tensor,
    add_multiplier: int,
    add_shift: int,
    extra_bits: int,
    out_dtype: DTypeLike,
    axis: int,
) -> torch.Tensor:
    """``sat((requant(acc) + requant(addend) + 2**(p-1)) >> p)``: the fused conv + add in int64.

    ``acc`` is the int32 accumulator (bias included) with per-channel parameters along
    ``axis``; the two requantized terms are int32 values at ``s_out / 2**p``.
    """
    wide = fused_add_wide(acc, addend, acc_multiplier, acc_shift, add_multiplier, add_shift, extra_bits, axis)
    return saturate(wide, out_dtype)


def fused_add_wide(
    acc: torch.Tensor,
    addend: torch.Tensor,
    acc_multiplier: torch.Tensor,
    acc_shift: torch.Tensor,
    add_multiplier: int,
    add_shift: int,
    extra_bits: int,
    axis: int,
) -> torch.Tensor:
    """:func:`fused_add_int` before its final saturation (int64): the QAT forward's straight-through
    gradient passes where this value is inside the output's clamp, so a code exactly at the dtype's
    limit is told apart from a saturated one."""
    mid = requantize(acc, acc_multiplier, acc_shift, "qint32", axis=axis).to(torch.int64)
    mid = mid + requantize(addend, add_multiplier, add_shift, "qint32").to(torch.int64)
    return shift_right_half_up(mid, extra_bits)


# ---------------------------------------------------------------------------------------------
# Average pooling
# ---------------------------------------------------------------------------------------------


def avg_pool_params(
    in_scale: float, out_scale: float, max_divisor: int, march: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(multiplier[d-1], shift[d-1])`` for ``d = 1 .. max_divisor``: ratio ``s_in / (d * s_out)``.

    An average pool sums its window exactly in int64 and requantizes the sum with the
    parameters of its window's divisor ``d`` (one multiplier folds the reciprocal of the
    window size and the scale change).
    """
    if max_divisor < 1:
        raise ValueError(f"pool divisor must be positive, got {max_divisor}")
    d = torch.arange(1, max_divisor + 1, dtype=torch.float64)
    return ratio_params(f32(in_scale) / (d * f32(out_scale)), march)


def avg_pool_divisor(
    h: int,
    w: int,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """torch's ``avg_pool2d`` divisor of every output position, (OH, OW) float64: the window size,
    the count of real elements (``count_include_pad=False``), or ``divisor_override``."""
    ones = torch.ones(1, 1, h, w, dtype=torch.float64, device=device)
    valid = F.avg_pool2d(ones, kernel_size, stride, padding, ceil_mode, True, 1)
    if divisor_override is not None:
        return torch.full_like(valid[0, 0], float(divisor_override))
    frac = F.avg_pool2d(ones, kernel_size, stride, padding, ceil_mode, count_include_pad)
    return torch.round(valid / frac)[0, 0]


def adaptive_pool_counts(h: int, w: int, oh: int, ow: int, device: torch.device | None = None) -> torch.Tensor:
    """Element count of every window of torch's ``adaptive_avg_pool2d`` from (h, w) to (oh, ow), float64."""

    def bounds(size: int, out: int) -> tuple[list[int], list[int]]:
        return [(i * size) // out for i in range(out)], [-((-(i + 1) * size) // out) for i in range(out)]

    hs, he = bounds(h, oh)
    ws, we = bounds(w, ow)
    return torch.tensor(
        [[(he[i] - hs[i]) * (we[j] - ws[j]) for j in range(ow)] for i in range(oh)], dtype=torch.float64, device=device
    )


# ---------------------------------------------------------------------------------------------
# Bilinear interpolation
# ---------------------------------------------------------------------------------------------


def bilinear_weight_bits(in_dtype: torch.dtype) -> int:
    """Fraction bits ``B`` of the bilinear weights: 12 for int8 input, 15 for int16.

    ``B = 15`` keeps the requantization in int64: ``|acc| <= 2**15 * 2**30``, times a 15-bit
    multiplier is ``2**60``, and the rounding term of a shift up to ``31 + 30`` is ``2**60``.
    """
    return 12 if in_dtype == torch.int8 else 15


def bilinear_taps(
    in_size: int, out_size: int, scale: float | None, align_corners: bool, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source indices ``i0, i1`` and integer weights ``w0, w1`` (``w0 + w1 = 2**bits``) along one axis.

    Source coordinates follow torch's ``interpolate(mode="bilinear")``: with
    ``align_corners`` ``src = dst * (in - 1) / (out - 1)``, else
    ``src = max((dst + 1/2) * r - 1/2, 0)`` where ``r = 1 / scale`` when a scale factor is
    used and ``in / out`` otherwise; computed in float64. ``w1 = round(frac(src) * 2**bits)``
    (half up), ``w0 = 2**bits - w1``.
    """
    dst = torch.arange(out_size, dtype=torch.float64)
    if align_corners:
        r = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
        src = dst * r
    else:
        r = 1.0 / scale if scale is not None and scale > 0 else in_size / out_size
        src = ((dst + 0.5) * r - 0.5).clamp(min=0.0)
    i0 = torch.floor(src).to(torch.int64).clamp(max=in_size - 1)
    i1 = (i0 + 1).clamp(max=in_size - 1)
    one = 1 << bits
    w1 = round_half_up((src - i0.to(torch.float64)) * one).to(torch.int64).clamp(0, one)
    return i0, i1, one - w1, w1


# ---------------------------------------------------------------------------------------------
# Division
# ---------------------------------------------------------------------------------------------


def resize_out_size(
    h: int, w: int, size: Any, scale_factor: Any, recompute_scale_factor: bool | None
) -> tuple[int, int, float | None, float | None]:
    """A resize's output size and the scale factors its bilinear taps use (None: from the sizes).

    ``size`` (an int or a sequence whose last two entries are used; a run-time size wins over
    the layer's own) or else ``scale_factor`` (one or a pair), as ``F.interpolate`` reads them.
    """
    if size is not None:
        oh, ow = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        return int(oh), int(ow), None, None
    if scale_factor is None:
        raise ValueError(
            "quantized Interpolate was built without size= or scale_factor=: pass the output size at the call"
        )
    fh, fw = (scale_factor, scale_factor) if isinstance(scale_factor, (int, float)) else scale_factor
    oh, ow = math.floor(h * float(fh)), math.floor(w * float(fw))
    if recompute_scale_factor:
        return oh, ow, None, None
    return oh, ow, float(fh), float(fw)


def div_params(x_scale: float, y_scale: float, out_scale: float, march: object) -> tuple[int, int]:
    """``(multiplier, shift)`` of ``s_x / (s_y * s_out)`` for :func:`div_int`."""
    m, s = ratio_params(f32(x_scale) / (f32(y_scale) * f32(out_scale)), march)
    return int(m), int(s)


def div_int(x: torch.Tensor, y: torch.Tensor, multiplier: int, shift: int, out_dtype: DTypeLike) -> torch.Tensor:
    """``sat(round_half_up(x * M / (y * 2**shift)))`` in exact int64 arithmetic.

    ``y == 0`` gives the saturated sign of ``x`` (``0`` for ``0 / 0``), like a float
    ``±inf`` that is then quantized.
    """
    qd = qdtype(out_dtype)
    lo, hi = qd.qrange
    num = x.to(torch.int64) * multiplier
    den = y.to(torch.int64) << shift
    sign = torch.where(den < 0, -1, 1)
    num, den = num * sign, den * sign
    zero = den == 0
    safe = torch.where(zero, torch.ones_like(den), den)
    # floor((2n + d) / 2d) == floor(n/d + 1/2) for d > 0: half up, exactly.
    q = torch.div(2 * num + safe, 2 * safe, rounding_mode="floor")
    inf = torch.where(num > 0, hi, torch.where(num < 0, lo, 0)).to(torch.int64)
    return saturate(torch.where(zero, inf, q), qd)


#: A number operand of add_scalar / mul_scalar is coded as ``±SCALAR_CODE`` at scale ``|c| / SCALAR_CODE``.
SCALAR_CODE = 127


def scalar_operand(c: float) -> tuple[int, float]:
    """``(code, scale)`` of the nonzero number ``c`` as a quantized operand."""
    return (SCALAR_CODE if c > 0 else -SCALAR_CODE), abs(float(c)) / SCALAR_CODE


def _number(y: object, what: str) -> float:
    if isinstance(y, bool) or not isinstance(y, (int, float)):
        raise TypeError(f"{what}: the number operand must be an int or a float, got {type(y).__name__}")
    v = float(y)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{what}: the number operand is {v}; it has no quantized form")
    return v


def mul_scalar_int(
    x: torch.Tensor, y: object, in_scale: float, out_scale: float, march: object, dtype: DTypeLike
) -> torch.Tensor:
    """``x * y`` for codes ``x`` at ``in_scale`` and a number ``y``, as codes at ``out_scale``:
    the exact product with ``y``'s code, requantized like a conv's accumulator (0 gives zeros)."""
    v = _number(y, "mul_scalar")
    if v == 0.0:
        return torch.zeros_like(x, dtype=qdtype(dtype).to_torch())
    code, s_c = scalar_operand(v)
    m, s = conv_requant_params(in_scale, s_c, out_scale, march, dtype)
    return requantize(x.to(torch.int64) * code, m.reshape(()), s.reshape(()), dtype)


def add_scalar_int(
    x: torch.Tensor, y: object, in_scale: float, out_scale: float, march: object, dtype: DTypeLike
) -> torch.Tensor:
    """``x + y`` for codes ``x`` at ``in_scale`` and a number ``y``, as codes at ``out_scale``:
    the add rule with ``y``'s code as the second operand (0 requantizes ``x`` alone)."""
    v = _number(y, "add_scalar")
    if v == 0.0:
        if f32(in_scale) == f32(out_scale):
            return saturate(x.to(torch.int64), dtype)
        m, s = requant_params(in_scale, out_scale, march, dtype)
        return requantize(x, m, s, dtype)
    code, s_c = scalar_operand(v)
    p = add_params(in_scale, s_c, out_scale, march, dtype)
    return add_int(x, torch.full_like(x, code, dtype=torch.int64), p, dtype)
