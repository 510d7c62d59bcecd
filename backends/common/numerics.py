"""The integer rules shared by the converted torch model and the compiled programs.

Every function here is the single implementation of one rule in ``docs/semantics.md``;
the converted model and each backend call these, never re-derive them, so the two agree
bit for bit. All integer arithmetic runs in int64 (no float rounding), and parameter
derivation (multipliers, shifts) runs in float64 on the float32 scale values.

The march-independent arithmetic of quantized values (quantize, dequantize, saturate,
requantize) is the IR's own (:mod:`qir.ir.numerics`) and is re-exported here; this module
adds what depends on a march's datapath (multiplier widths, shift limits, the add rule,
tables).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from qir.ir.numerics import (
    MIN_SCALE,
    DTypeLike,
    ScaleLike,
    as_scale,
    broadcast_along,
    dequantize,
    observable_qdtype,
    qdtype,
    qrange,
    quantize,
    requantize,
    round_half_up,
    saturate,
    scale_denominator,
    shift_right_half_up,
)
from qir.ir.types import DType

# ---------------------------------------------------------------------------------------------
# Requantization: acc * scale_in / scale_out  ~  (acc * multiplier + 2**(shift-1)) >> shift
# ---------------------------------------------------------------------------------------------


class RequantLimits(NamedTuple):
    """A march's requantization datapath: the multiplier magnitude and right-shift bounds."""

    max_multiplier: int
    max_shift: int
    out_dtypes: tuple[DType, ...]


# Values and reasons: docs/semantics.md, "Requantization".
REQUANT_LIMITS: dict[str, RequantLimits] = {
    "bayes": RequantLimits(max_multiplier=32767, max_shift=31, out_dtypes=(DType.qint8, DType.qint16)),
    "bernoulli2": RequantLimits(max_multiplier=255, max_shift=31, out_dtypes=(DType.qint8,)),
}


def _march_name(march: object) -> str:
    # Accept qir.march.March (a str enum) or a plain string without importing the public layer.
    name = str(getattr(march, "value", march)).lower()
    if name not in REQUANT_LIMITS:
        raise ValueError(f"march {march!r} is unknown; valid: {', '.join(sorted(REQUANT_LIMITS))}")
    return name


def requant_limits(march: object) -> RequantLimits:
    """The :class:`RequantLimits` of ``march`` (``"bayes"``, ``"bernoulli2"`` or a ``March``)."""
    return REQUANT_LIMITS[_march_name(march)]


def _ratio(in_scale: ScaleLike, out_scale: ScaleLike) -> torch.Tensor:
    ref = torch.empty(0)
    i = as_scale(in_scale, ref, torch.float32).to(torch.float64)
    o = as_scale(out_scale, ref, torch.float32).to(torch.float64)
    if bool((i <= 0).any()) or bool((o <= 0).any()) or not bool(torch.isfinite(i).all() & torch.isfinite(o).all()):
        raise ValueError("requantization scales must be positive and finite")
    return (i / o).reshape(-1) if (i.dim() or o.dim()) else i / o


def multiplier_shift(ratio: torch.Tensor, max_multiplier: int, max_shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest ``shift <= max_shift`` with ``floor(ratio * 2**shift + 0.5) <= max_multiplier``.

    The largest admissible shift gives the most multiplier bits, hence the smallest
    approximation error ``|M / 2**shift - ratio| <= 2**-(shift+1)``. ``ratio`` is float64.
    """
    # numpy on the host: the same IEEE float64 operations as torch's, without torch's per-op
    # overhead (this runs for every conv of every QAT training step on the integer grid)
    r = ratio.detach().to(device="cpu", dtype=torch.float64).numpy()
    mult, shift = multiplier_shift_np(r, max_multiplier, max_shift)
    shape = ratio.shape
    return (
        torch.from_numpy(np.ascontiguousarray(mult)).reshape(shape).to(ratio.device),
        torch.from_numpy(np.ascontiguousarray(shift)).reshape(shape).to(ratio.device),
    )


def multiplier_shift_np(r: np.ndarray, max_multiplier: int, max_shift: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`multiplier_shift` of a float64 numpy array: int64 ``(multiplier, shift)`` arrays."""
    if not bool(((r > 0) & np.isfinite(r)).all()):
        raise ValueError("requantization ratios must be positive and finite")
    too_big = r >= max_multiplier + 0.5
    if bool(too_big.any()):
        bad = float(r[too_big].reshape(-1)[0])
        raise ValueError(
            f"requantization ratio in_scale/out_scale = {bad:.6g} exceeds the multiplier limit "
            f"{max_multiplier}: the output scale is too small; it must exceed in_scale / {max_multiplier + 0.5}"
        )
    # Start from the analytic estimate, then fix float log2 error by one step either way.
    shift = np.clip(np.floor(np.log2((max_multiplier + 0.5) / r)), 0, max_shift).astype(np.int64)
    for _ in range(2):
        m = np.floor(np.ldexp(r, shift) + 0.5)
        shift = np.where(m > max_multiplier, shift - 1, shift)
    up = np.minimum(shift + 1, max_shift)
    m_up = np.floor(np.ldexp(r, up) + 0.5)
    shift = np.where((up > shift) & (m_up <= max_multiplier), up, shift)
    mult = np.floor(np.ldexp(r, shift) + 0.5).astype(np.int64)
    return mult, shift


def requant_params(
    in_scale: ScaleLike, out_scale: ScaleLike, march: object, dtype: DTypeLike = "qint8"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer ``(multiplier, shift)`` approximating ``in_scale / out_scale`` on ``march``.

    ``in_scale`` may be per-channel (1-D); the result then has one entry per channel.
    ``dtype`` is the output dtype; it must be one the march can requantize to.
    Returns int64 tensors (0-d for scalar scales).
    """
    lim = _requant_target(march, dtype)
    return multiplier_shift(_ratio(in_scale, out_scale), lim.max_multiplier, lim.max_shift)


def _requant_target(march: object, dtype: DTypeLike) -> RequantLimits:
    """The march's limits, after checking it can requantize to ``dtype``."""
    lim = requant_limits(march)
    qd = qdtype(dtype)
    if qd is DType.qint32:
        raise ValueError("qint32 is the high-precision output: it keeps the accumulator, no requantization")
    if qd not in lim.out_dtypes:
        raise ValueError(
            f"march {_march_name(march)} cannot requantize to {qd.name}; "
            f"valid output dtypes: {', '.join(d.name for d in lim.out_dtypes)}"
        )
    return lim


def accumulator_scale(input_scale: ScaleLike, weight_scale: ScaleLike) -> torch.Tensor:
    """Scale of a conv/linear int32 accumulator (and of its bias): ``input_scale * weight_scale``.

    Float64 product of the float32 values; per-channel when the weight scale is.
    This is also the dequant scale of a high-precision (qint32) output.
    """
    ref = torch.empty(0)
    i = as_scale(input_scale, ref, torch.float32).to(torch.float64)
    w = as_scale(weight_scale, ref, torch.float32).to(torch.float64)
    return i * w


def quantize_bias(bias: torch.Tensor, input_scale: ScaleLike, weight_scale: ScaleLike) -> torch.Tensor:
    """Bias as int32 at the accumulator scale (half-up, saturated), computed in float64."""
    return bias_codes(bias, accumulator_scale(input_scale, weight_scale))


def bias_codes(bias: torch.Tensor, acc_scale: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_bias` with the accumulator scale (:func:`accumulator_scale`) at hand."""
    axis = 0 if acc_scale.dim() and acc_scale.numel() > 1 else None
    s = acc_scale if axis is not None else acc_scale.reshape(())
    return quantize(bias.detach().to(torch.float64), s, DType.qint32, axis=axis)


def conv_requant_params(
    input_scale: ScaleLike, weight_scale: ScaleLike, out_scale: ScaleLike, march: object, dtype: DTypeLike = "qint8"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel ``(multiplier, shift)`` for a conv/linear with per-channel weight scales."""
    return acc_requant_params(accumulator_scale(input_scale, weight_scale), out_scale, march, dtype)


def acc_requant_params(
    acc_scale: torch.Tensor, out_scale: ScaleLike, march: object, dtype: DTypeLike = "qint8"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`conv_requant_params` with the accumulator scale (:func:`accumulator_scale`) at hand."""
    lim = _requant_target(march, dtype)
    o = as_scale(out_scale, torch.empty(0), torch.float32).to(torch.float64)
    return multiplier_shift((acc_scale / o).reshape(-1), lim.max_multiplier, lim.max_shift)


# ---------------------------------------------------------------------------------------------
# Bayes elementwise add: out = requant((x << shift) + y * qscale)
# ---------------------------------------------------------------------------------------------

ADD_MAX_QSCALE = 32767
ADD_MAX_SHIFT = {DType.qint8: 23, DType.qint16: 15}


class AddParams(NamedTuple):
    """Integer parameters of ``x + y`` (see :func:`add_params`)."""

    swap: bool  # operands exchanged so that the larger-scaled one is shifted
    shift: int  # left shift of the (possibly swapped) first operand
    qscale: int  # multiplier of the second operand, |qscale| <= 32767
    multiplier: int  # output requant multiplier
    out_shift: int  # output requant right shift, <= 31


def add_params(
    x_scale: float, y_scale: float, out_scale: float, march: object = "bayes", dtype: DTypeLike = "qint8"
) -> AddParams:
    """Choose the add's shifts and multipliers for operands of ``dtype`` and an output of ``dtype``.

    ``qscale = floor(sy * 2**shift / sx + 0.5)`` with ``shift <= 23`` (qint8) / ``15`` (qint16)
    and ``|qscale| <= 32767``; the sum has scale ``sx / 2**shift`` and is requantized to
    ``out_scale`` with :func:`requant_params`. Among admissible shifts the one with the
    smallest worst-case error (in output LSBs) wins; ties go to the larger shift.
    """
    qd = qdtype(dtype)
    if qd not in ADD_MAX_SHIFT:
        raise ValueError(f"add operands must be qint8 or qint16, got {qd.name}")
    lim = _requant_target(march, qd)
    sx, sy, so = (float(torch.tensor(float(v), dtype=torch.float32)) for v in (x_scale, y_scale, out_scale))
    if min(sx, sy, so) <= 0 or not all(math.isfinite(v) for v in (sx, sy, so)):
        raise ValueError("add scales must be positive and finite")
    swap = sy > sx
    if swap:
        sx, sy = sy, sx
    lo, hi = qd.qrange
    amax = float(max(-lo, hi))
    best: tuple[float, int, int, int, int] | None = None
    for k in range(ADD_MAX_SHIFT[qd] + 1):
        ratio_y = sy * 2.0**k / sx
        q = math.floor(ratio_y + 0.5)
        if q > ADD_MAX_QSCALE:
            break
        r2 = sx / (2.0**k * so)
        if r2 >= lim.max_multiplier + 0.5:
            continue
        m_t, s_t = multiplier_shift(torch.tensor(r2, dtype=torch.float64), lim.max_multiplier, lim.max_shift)
        m, s = int(m_t), int(s_t)
        # Worst-case pre-rounding error of the output, in output LSBs.
        err = amax * 2.0**k * abs(m / 2.0**s - r2) + amax * abs(q * m / 2.0**s - ratio_y * r2)
        if best is None or err <= best[0]:
            best = (err, k, q, m, s)
    if best is None:
        raise ValueError(
            f"add scales x={x_scale:.6g}, y={y_scale:.6g}, out={out_scale:.6g} are not representable "
            f"on {_march_name(march)}: the output scale is too small for the inputs"
        )
    _, k, q, m, s = best
    return AddParams(swap=swap, shift=k, qscale=q, multiplier=m, out_shift=s)


def add_int(x: torch.Tensor, y: torch.Tensor, params: AddParams, out_dtype: DTypeLike) -> torch.Tensor:
    """``saturate(requant((x << shift) + y * qscale))`` in int64, operands swapped if ``params.swap``."""
    a, b = (y, x) if params.swap else (x, y)
    acc = (a.to(torch.int64) << params.shift) + b.to(torch.int64) * params.qscale
    return requantize(acc, params.multiplier, params.out_shift, out_dtype)


# ---------------------------------------------------------------------------------------------
# Table lookup for nonlinear ops
# ---------------------------------------------------------------------------------------------


def lut_int8(
    fn: Callable[[torch.Tensor], torch.Tensor], in_scale: float, out_scale: float, out_dtype: DTypeLike = "qint8"
) -> torch.Tensor:
    """The 256-entry table of ``fn`` on qint8 input: entry ``i`` is for input ``i - 128``.

    ``entry = saturate(floor(fn(q * in_scale) / out_scale + 0.5))`` with ``fn`` evaluated in
    float64 on float64 inputs (``q * in_scale`` is exact there).
    """
    qd = qdtype(out_dtype)
    if qd not in (DType.qint8, DType.qint16):
        raise ValueError(f"LUT output dtype must be qint8 or qint16, got {qd.name}")
    q = torch.arange(-128, 128, dtype=torch.float64)
    s_in = float(torch.tensor(float(in_scale), dtype=torch.float32))
    s_out = float(torch.tensor(float(out_scale), dtype=torch.float32))
    y = fn(q * s_in).to(torch.float64)
    if y.shape != q.shape:
        raise ValueError(f"LUT function must be elementwise; got output shape {tuple(y.shape)} for input (256,)")
    lo, hi = qd.qrange
    # NaN (e.g. log of a negative) has no integer; it saturates like +inf would not, so reject it.
    if bool(torch.isnan(y).any()):
        raise ValueError("LUT function returned NaN on the input range; restrict its domain first")
    return round_half_up(y / s_out).clamp(lo, hi).to(qd.to_torch())


def lut_apply(table: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Look up qint8 ``q`` in a 256-entry table built by :func:`lut_int8`."""
    if table.numel() != 256:
        raise ValueError(f"an int8 table has 256 entries, got {table.numel()}")
    return table[q.to(torch.int64) + 128]


__all__ = [
    "ADD_MAX_QSCALE",
    "ADD_MAX_SHIFT",
    "AddParams",
    "MIN_SCALE",
    "REQUANT_LIMITS",
    "RequantLimits",
    "accumulator_scale",
    "acc_requant_params",
    "add_int",
    "add_params",
    "bias_codes",
    "broadcast_along",
    "conv_requant_params",
    "dequantize",
    "lut_apply",
    "lut_int8",
    "multiplier_shift",
    "multiplier_shift_np",
    "observable_qdtype",
    "qdtype",
    "qrange",
    "quantize",
    "quantize_bias",
    "requant_limits",
    "requant_params",
    "requantize",
    "round_half_up",
    "saturate",
    "scale_denominator",
    "shift_right_half_up",
]
