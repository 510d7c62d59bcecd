"""Integer arithmetic of the IR's quantized types: quantize, dequantize, saturate, requantize.

``real = code * scale`` with symmetric scales (zero point 0). These functions are the single
implementation of the rounding rules in ``docs/semantics.md`` (half up, saturating); the
IR's quantization ops, the module library and every backend call them. Parameter
derivation that depends on a march (multiplier widths, shift limits) lives in
:mod:`backends.common.numerics`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch

from qir.ir.types import DType

ScaleLike: TypeAlias = "torch.Tensor | float | Sequence[float]"
DTypeLike: TypeAlias = "DType | str | torch.dtype"

#: Smallest scale an observer produces (float32 machine epsilon, 2**-23). See docs/semantics.md.
MIN_SCALE = 2.0**-23

_TORCH_QDTYPES = {torch.qint8: DType.qint8, torch.qint32: DType.qint32}
_OBSERVABLE = (DType.qint8, DType.qint16)


def qdtype(dtype: DTypeLike) -> DType:
    """Normalise a quantized dtype given as ``"qint8"``, ``DType.qint8`` or ``torch.qint8``."""
    if isinstance(dtype, DType):
        out = dtype
    elif isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_QDTYPES:
            raise ValueError(f"dtype {dtype} is not a quantized dtype; use 'qint8', 'qint16' or 'qint32'")
        out = _TORCH_QDTYPES[dtype]
    elif isinstance(dtype, str):
        try:
            out = DType.parse(dtype.strip().lower())
        except ValueError:
            raise ValueError(f"dtype {dtype!r} is unknown; use 'qint8', 'qint16' or 'qint32'") from None
    else:
        raise TypeError(f"dtype must be a str, qir DType or torch dtype, got {type(dtype).__name__}")
    if out not in (DType.qint8, DType.qint16, DType.qint32):
        raise ValueError(f"dtype {out.name} is not a quantized dtype; use 'qint8', 'qint16' or 'qint32'")
    return out


def observable_qdtype(dtype: DTypeLike) -> DType:
    """Like :func:`qdtype` but only the dtypes an observer or fake quant can produce."""
    out = qdtype(dtype)
    if out not in _OBSERVABLE:
        raise ValueError(
            f"dtype {out.name} cannot be observed or fake-quantized; use 'qint8' or 'qint16' "
            "(qint32 appears only as a high-precision output, activation=None in the qconfig)"
        )
    return out


def qrange(dtype: DTypeLike) -> tuple[int, int]:
    """Inclusive integer range: qint8 (-128, 127), qint16 (-32768, 32767), qint32 (-2**31, 2**31-1)."""
    return qdtype(dtype).qrange


def scale_denominator(dtype: DTypeLike) -> float:
    """``(qmax - qmin) / 2``: the observer divides amax by this (127.5 for qint8)."""
    lo, hi = qrange(dtype)
    return (hi - lo) / 2.0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    # float64 inputs keep float64; everything narrower is computed in float32.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_scale(scale: ScaleLike, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.to(device=like.device, dtype=dtype)
    if isinstance(scale, (int, float)):
        return torch.tensor(float(scale), device=like.device, dtype=dtype)
    return torch.tensor([float(s) for s in scale], device=like.device, dtype=dtype)


def broadcast_along(t: torch.Tensor, axis: int | None, ndim: int) -> torch.Tensor:
    """Shape a per-tensor (numel 1) or per-channel (1-D) parameter to broadcast against a rank-``ndim`` tensor."""
    if axis is None:
        if t.numel() != 1:
            raise ValueError(f"per-tensor parameter must have one element, got shape {tuple(t.shape)}; pass axis")
        return t.reshape(())
    if t.dim() > 1:
        raise ValueError(f"per-channel parameter must be 1-D, got shape {tuple(t.shape)}")
    ax = axis % ndim if ndim else 0
    shape = [1] * ndim
    shape[ax] = -1
    return t.reshape(shape)


def round_half_up(v: torch.Tensor) -> torch.Tensor:
    """``floor(v + 0.5)`` evaluated exactly (float ``v + 0.5`` itself can round, e.g. 0.49999997f)."""
    f = torch.floor(v)
    # v - floor(v) is exact in IEEE arithmetic, so the tie test is exact too. In-place ops
    # keep this at four passes over memory (it sits in the fake-quant hot path).
    return f.add_((v - f).ge_(0.5))


def quantize(
    x: torch.Tensor, scale: ScaleLike, dtype: DTypeLike, axis: int | None = None, *, note_abs_sums: bool = False
) -> torch.Tensor:
    """``saturate(floor(x / scale + 0.5))`` as an integer tensor (int8/int16/int32 storage).

    ``x / scale`` is one IEEE division in float32 (float64 for float64 input, and for
    qint32, whose bounds float32 cannot hold); the scale is cast to that type first.
    ``axis`` selects per-channel scales. ``note_abs_sums``: the codes are a weight whose
    per-slice L1 norms along ``axis`` will be asked (:func:`abs_sums`): they are summed from the
    rounded values before the cast, a pass fewer than from the codes, and remembered.
    """
    qd = qdtype(dtype)
    lo, hi = qd.qrange
    ct = torch.float64 if qd is DType.qint32 else compute_dtype(x)
    s = broadcast_along(as_scale(scale, x, ct), axis, x.dim())
    v = x.to(ct) / s
    if ct == torch.float32 and v.device.type == "cpu" and not _rounds_up_wrongly(v):
        # floor(fl(v + 0.5)) in three in-place passes, where round_half_up takes five: exact here
        # (_rounds_up_wrongly says why), and twice as fast on a network's weights at conversion
        q = v.add_(0.5).floor_().clamp_(lo, hi)
    else:
        q = round_half_up(v).clamp_(lo, hi)
    codes = q.to(qd.to_torch())
    if note_abs_sums and axis is not None and codes.dim() and codes.numel():
        ax = axis % codes.dim()
        c = codes.shape[ax]
        if q.dtype == torch.float32 and _float32_exact_bound(codes, codes.numel() // c):
            # the rounded values are the codes' integers, and float32 sums them exactly in any order
            # (_abs_sums' first case): the same sums, without converting the codes back to float
            sums = q.transpose(0, ax).reshape(c, -1).abs_().sum(dim=1)
            if bool(torch.isfinite(sums).all()):  # NaN weights: their codes' sums are the codes' own
                _remember_abs_sums(codes, ax, sums.to(torch.int64))
    return codes


#: the one float32 value ``v`` below 2**22 whose ``v + 0.5`` rounds up to the next integer:
#: 0.5 - 2**-25 (the sum 1 - 2**-25 ties to 1.0)
_HALF_BELOW = np.nextafter(np.float32(0.5), np.float32(0.0))


def _rounds_up_wrongly(v: torch.Tensor) -> bool:
    """Whether float32 ``floor(v + 0.5)`` would differ from ``floor(v + 0.5)`` computed exactly
    anywhere that matters once the result is clamped to a qint8 / qint16 range.

    For ``|v| < 2**22`` the float32 sum ``v + 0.5`` is exact (both terms share ``v``'s binade grid,
    or Sterbenz's lemma applies for negative ``v``) or rounds inside one unit interval, except at
    ``v = 0.5 - 2**-25``, whose sum ties to 1.0. Beyond ``2**22`` the sum may round to a
    neighbouring integer, but so far out of the qint16 range that the clamp gives the same code.
    NaN and infinities go the same way on both paths. So that one value is all to look for (a
    numpy view of a CPU tensor: one cheap pass, where a torch comparison allocates and reduces)."""
    a = v.detach().numpy() if v.is_contiguous() else v.detach().contiguous().numpy()
    return bool(np.any(a == _HALF_BELOW))


def dequantize(q: torch.Tensor, scale: ScaleLike, axis: int | None = None) -> torch.Tensor:
    """``q * scale`` in float32 (one rounding: the product of an integer and a float32 scale)."""
    s = broadcast_along(as_scale(scale, q, torch.float32), axis, q.dim())
    return q.to(torch.float32) * s


def saturate(v: torch.Tensor, dtype: DTypeLike) -> torch.Tensor:
    """Clamp an integer tensor into ``dtype``'s range and store it in that dtype's torch type."""
    qd = qdtype(dtype)
    lo, hi = qd.qrange
    return v.clamp(lo, hi).to(qd.to_torch())


def shift_right_half_up(v: torch.Tensor, shift: torch.Tensor | int) -> torch.Tensor:
    s = torch.as_tensor(shift, dtype=torch.int64, device=v.device)
    half = (torch.ones_like(s) << s) >> 1  # 2**(shift-1), and 0 for shift 0
    # Arithmetic right shift floors, so adding half first rounds half up (also for negatives).
    return torch.bitwise_right_shift(v + half, s)


def requantize(
    acc: torch.Tensor,
    multiplier: torch.Tensor | int,
    shift: torch.Tensor | int,
    out_dtype: DTypeLike,
    axis: int | None = None,
) -> torch.Tensor:
    """``saturate((acc * multiplier + (1 << (shift - 1))) >> shift)`` in int64.

    ``multiplier``/``shift`` are scalars or, with ``axis``, per-channel 1-D tensors.
    """
    if acc.is_floating_point():
        raise TypeError("requantize takes an integer accumulator tensor, got a float tensor")
    a = acc.to(torch.int64)
    m = torch.as_tensor(multiplier, dtype=torch.int64, device=a.device)
    s = torch.as_tensor(shift, dtype=torch.int64, device=a.device)
    if axis is not None or m.dim() or s.dim():
        if axis is None:
            raise ValueError("per-channel multiplier/shift need the channel axis; pass axis")
        m = broadcast_along(m, axis, a.dim())
        s = broadcast_along(s, axis, a.dim())
    return saturate(shift_right_half_up(a * m, s), out_dtype)


__all__ = [
    "DTypeLike",
    "MIN_SCALE",
    "ScaleLike",
    "as_scale",
    "broadcast_along",
    "compute_dtype",
    "dequantize",
    "note_abs_sums",
    "observable_qdtype",
    "qdtype",
    "qrange",
    "quantize",
    "requantize",
    "round_half_up",
    "saturate",
    "scale_denominator",
    "shift_right_half_up",
]


def abs_sums(codes: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """``sum |codes|`` over each slice along ``axis`` (a conv's per-output-channel weight L1
    norms: they bound its accumulators by ``max|x|``), exactly, as int64.

    Integer codes are summed in float32 when no sum can reach 2**24 (integers below it are exact
    in float32 whatever the summation order), else in float64 below 2**53, else in int64: the
    float reductions are about ten times faster than torch's integer ones on the CPU. Float
    tensors are truncated to int64 first."""
    c = codes.shape[axis] if codes.dim() else 1
    if codes.numel() == 0:
        return torch.zeros(c, dtype=torch.int64)
    # conversion asks twice per layer (the verifier's accumulator bound, then the integer module's
    # weight_l1_max): the second time a tensor unchanged since (same object, same version) is not read
    hit = _ABS_SUMS.get(_abs_sums_key(codes, axis))
    if hit is not None and hit[0]() is codes:
        return hit[1].clone()
    sums = _abs_sums(codes, axis, c)
    _remember_abs_sums(codes, axis, sums)
    return sums


def note_abs_sums(codes: torch.Tensor, axis: int, sums: torch.Tensor) -> None:
    """Remember ``sums`` as :func:`abs_sums` of ``codes`` along ``axis`` (int64, computed exactly by the
    caller, e.g. in the pass that made the codes) until ``codes`` changes."""
    _remember_abs_sums(codes, axis % codes.dim() if codes.dim() else 0, sums)


def _abs_sums_key(codes: torch.Tensor, axis: int) -> tuple[int, int, int, tuple[int, ...]]:
    return (id(codes), codes._version, axis, tuple(codes.shape))


def _remember_abs_sums(codes: torch.Tensor, axis: int, sums: torch.Tensor) -> None:
    if len(_ABS_SUMS) >= 256:
        _ABS_SUMS.clear()
    _ABS_SUMS[_abs_sums_key(codes, axis)] = (weakref.ref(codes), sums.clone())


#: abs_sums results by (tensor id, version, axis, shape), with the tensor weakly (a dead tensor's id may be reused)
_ABS_SUMS: dict[tuple[int, int, int, tuple[int, ...]], tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def _row_sum_bound(codes: torch.Tensor, row: int) -> int:
    """The largest possible ``sum |codes|`` over ``row`` integer codes (0 for float or bool codes)."""
    if codes.is_floating_point() or codes.dtype is torch.bool:
        return 0
    return (int(torch.iinfo(codes.dtype).max) + 1) * row


def _float32_exact_bound(codes: torch.Tensor, row: int) -> bool:
    """Whether float32 sums ``|codes|`` over rows of ``row`` entries exactly: integer codes whose
    largest possible row sum stays below 2**24."""
    return 0 < _row_sum_bound(codes, row) < 2**24


def _abs_sums(codes: torch.Tensor, axis: int, c: int) -> torch.Tensor:
    rows = codes.transpose(0, axis).reshape(c, -1) if codes.dim() else codes.reshape(1, 1)
    bound = _row_sum_bound(codes, rows.shape[1])
    if 0 < bound < 2**24:  # exact in float32 (see _float32_exact_bound)
        return rows.to(torch.float32).abs_().sum(dim=1).to(torch.int64)
    if 0 < bound < 2**53:
        return rows.to(torch.float64).abs_().sum(dim=1).to(torch.int64)
    return rows.to(torch.int64).abs().sum(dim=1)


def abs_sum_max(codes: torch.Tensor, axis: int = 0) -> int:
    """``max`` of :func:`abs_sums` (0 for no slices): a conv's largest per-channel weight L1 norm."""
    sums = abs_sums(codes, axis)
    return int(sums.max()) if sums.numel() else 0
