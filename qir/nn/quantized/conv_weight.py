"""A conv / linear weight's conversion: its scale, its codes and their per-channel L1 norms.

Converting a layer reads its weight for the weight fake quant's observation (the scale the QAT
forward would use now), for the codes (``numerics.quantize``: division, rounding, clamp, cast) and for
the codes' L1 norms (the verifier's accumulator bound, the integer module's ``weight_l1_max``): about
ten torch passes over it, a few fresh tensors of its size each. ``native_weights.c`` makes the same
IEEE operations in one pass per output channel, while the channel is in the cache: the observer's
update and scale (for the default weight observer, a moving average with constant 1, and a running
min / max), the codes with the same half-up rounding, and the norms, which it remembers for
:func:`~qir.ir.numerics.abs_sums`. tests/nn/test_conv_weight.py compares both paths bit for bit.

Where the fused pass does not apply the torch path runs (:data:`NATIVE` off, the library unavailable
or ``QIR_NATIVE=0``, a weight that is not contiguous float32 on the CPU or not per channel along axis 0,
a NaN or infinite weight, another fake quant or observer class, an observer state the plain update
does not cover); where only the observation does not, the torch observation gives the scale and the
native pass the codes and norms. Nothing of the fake quant's state is written on either path.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.modules import module as nn_module

from backends.common import numerics
from backends.common.kernels import native
from qir.frontend.convert import scratch_buffers
from qir.ir.numerics import note_abs_sums, scale_denominator
from qir.ir.types import DType
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.observer import MinMaxObserver, MovingAveragePerChannelMinMaxObserver

__all__ = ["NATIVE", "native_weight_codes", "observed_weight_scale", "weight_codes"]

#: the fused native pass where it applies; False: the torch path everywhere (the reference the tests compare with)
NATIVE = True

_KERNEL = {
    DType.qint8: ("qir_weight_codes_rows_i8", torch.int8),
    DType.qint16: ("qir_weight_codes_rows_i16", torch.int16),
}
#: the kernel's mode: the scale given, the batch's range taken (moving average, constant 1), the range widened
_GIVEN, _TAKE, _WIDEN = 0, 1, 2


def observed_weight_scale(fq: FakeQuantize, weight: torch.Tensor, owner: str) -> tuple[torch.Tensor, DType]:
    """The scale and dtype weight fake quant ``fq`` of module class ``owner`` gives ``weight`` now:
    observed into scratch buffers, so ``fq`` keeps its state and no module is copied."""
    with torch.no_grad(), scratch_buffers(fq):
        if type(fq).forward is FakeQuantize.forward:
            fq.observe(weight.detach())  # forward's update without the fake-quantized weight it discards
        else:  # a subclass's own forward (a learnable scale) decides its scale
            fq(weight.detach())
        scale = fq.scale.detach().to(torch.float32).clone()
    if scale.numel() == 0:
        raise ValueError(
            f"{owner}: the weight fake quant has no scale (observer disabled before any batch); "
            "enable its observer or load a QAT state dict that holds weight_fake_quant.scale"
        )
    return scale, fq.dtype


def weight_codes(
    fq: FakeQuantize, weight: torch.Tensor, owner: str, weight_axis: int
) -> tuple[torch.Tensor, DType, torch.Tensor]:
    """``(scale, dtype, codes)`` of ``weight`` under its fake quant ``fq`` (module class ``owner``, output
    channels along ``weight_axis``): :func:`observed_weight_scale`, then ``numerics.quantize`` per channel
    (per tensor for a one-value scale), the codes' L1 norms remembered; one native pass where it applies."""
    weight = weight.detach()
    if NATIVE:
        fused = _observed_natively(fq, weight, weight_axis)
        if fused is not None:
            return fused
    scale, dtype = observed_weight_scale(fq, weight, owner)
    axis = weight_axis if scale.numel() > 1 else None
    codes = native_weight_codes(weight, scale, dtype, axis) if NATIVE else None
    if codes is None:
        codes = numerics.quantize(weight, scale, dtype, axis=axis, note_abs_sums=True)
    return scale, dtype, codes


def native_weight_codes(
    weight: torch.Tensor, scale: torch.Tensor, dtype: DType, axis: int | None
) -> torch.Tensor | None:
    """``numerics.quantize(weight, scale, dtype, axis)`` in one native pass, the L1 norms of its slices
    along axis 0 remembered; None where it does not apply (the caller quantizes with torch)."""
    if not _fits(weight, dtype) or (axis is not None and axis % weight.dim() != 0):
        return None
    rows = weight.shape[0]
    if scale.dtype != torch.float32 or scale.device.type != "cpu" or scale.numel() not in (1, rows):
        return None
    if axis is None and scale.numel() != 1:
        return None
    s = scale.detach().reshape(-1).expand(rows).contiguous()
    a = s.numpy()
    if not (np.isfinite(a).all() and (a > 0).all()):
        return None  # a zero or non-finite scale: torch's quotients decide
    out = _run(weight, _GIVEN, s, s, s, 1.0, 1.0, dtype)
    return None if out is None else out[1]


def _fits(weight: torch.Tensor, dtype: DType) -> bool:
    return (
        dtype in _KERNEL
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() >= 2
        and weight.numel() > 0
        and weight.is_contiguous()
        and native.library() is not None
    )


def _observed_natively(
    fq: FakeQuantize, weight: torch.Tensor, weight_axis: int
) -> tuple[torch.Tensor, DType, torch.Tensor] | None:
    """:func:`weight_codes` in one native pass: the observation too, where it is the plain per-channel
    update :meth:`~qir.quantization.observer.ObserverBase._fast_update` makes (its conditions, checked
    here the same way) of an observer whose update the kernel implements; else None."""
    if type(fq) is not FakeQuantize or not fq.observer_enabled or fq.has_fixed_scale:
        return None
    obs = fq.observer
    if type(obs) is MovingAveragePerChannelMinMaxObserver and obs.averaging_constant == 1.0:
        mode = _TAKE
    elif type(obs) is MinMaxObserver and obs.ch_axis is not None:
        mode = _WIDEN
    else:
        return None
    dtype = fq.dtype
    if (
        obs.dtype is not dtype
        or not _fits(weight, dtype)
        or weight_axis % weight.dim() != 0
        or obs.ch_axis is None
        or obs.ch_axis % weight.dim() != 0
    ):
        return None
    if obs.nonfinite != "skip" or (obs.sync_ranks and _ddp_world()) or _hooked(obs):
        return None
    rows = weight.shape[0]
    lo, hi = obs.min_val, obs.max_val
    if lo.numel() != rows or hi.numel() != rows or lo.dtype != torch.float32 or hi.dtype != torch.float32:
        return None
    lo, hi = lo.detach().contiguous(), hi.detach().contiguous()
    a_lo, a_hi = lo.numpy(), hi.numpy()
    if not (np.isfinite(a_lo).all() and np.isfinite(a_hi).all() and (a_hi >= a_lo).all()):
        return None  # a first batch, an empty channel: the observer's general path
    out = _run(weight, mode, lo, lo, hi, scale_denominator(dtype), float(obs.eps), dtype)
    if out is None:
        return None
    return out[0], dtype, out[1]


def _run(
    weight: torch.Tensor,
    mode: int,
    scale: torch.Tensor,
    old_lo: torch.Tensor,
    old_hi: torch.Tensor,
    den: float,
    eps: float,
    dtype: DType,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel over ``weight``'s rows: ``(scale, codes)`` with the codes' L1 norms remembered, or None
    when a row holds a NaN or an infinity or its update is not the plain one (nothing kept)."""
    name, code_dtype = _KERNEL[dtype]
    rows = weight.shape[0]
    codes = torch.empty(weight.shape, dtype=code_dtype)
    sums = torch.empty(rows, dtype=torch.int64)
    scale_out = scale if mode == _GIVEN else torch.empty(rows, dtype=torch.float32)
    p = native.ptr
    args = (
        p(weight),
        weight.numel() // rows,
        mode,
        p(scale),
        p(old_lo),
        p(old_hi),
        native.float_bits(den),
        native.float_bits(eps),
        p(scale_out),
        p(codes),
        p(sums),
    )
    if native.run(name, args, rows, weight.numel()):
        return None
    note_abs_sums(codes, 0, sums)
    return scale_out, codes


def _ddp_world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _hooked(m: torch.nn.Module) -> bool:
    """Whether calling ``m`` runs hooks (its own or global ones) the native observation would skip."""
    return bool(
        m._forward_hooks
        or m._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )
