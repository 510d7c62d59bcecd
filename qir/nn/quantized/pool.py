"""Quantized pooling: exact max pool; average pools by an exact window sum and one requantization.

Average-pool rule (docs/modules.md "Average pooling"): ``sum`` is the exact int64 sum of
the window (padding contributes 0); ``d`` is torch's divisor for that output position
(window size, or the count of real elements when ``count_include_pad=False``, or
``divisor_override``); ``out = requantize(sum, M[d], shift[d])`` with ``M[d] / 2**shift[d]``
approximating ``s_in / (d * s_out)`` (:func:`backends.common.integer_rules.avg_pool_params`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import adaptive_pool_counts, avg_pool_divisor, avg_pool_params, check_out_dtype
from qir.nn.qat.pool import AdaptiveAvgPool2d as QATAdaptiveAvgPool2d
from qir.nn.qat.pool import AvgPool2d as QATAvgPool2d
from qir.nn.qat.pool import MaxPool2d as QATMaxPool2d
from qir.nn.quantized._base import QuantizedModule, check_qat, march_name, output_fq, untraced

__all__ = ["AdaptiveAvgPool2d", "AvgPool2d", "MaxPool2d"]


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _requant_windows(
    sums: torch.Tensor, divisor: torch.Tensor, mult: torch.Tensor, shift: torch.Tensor, dtype: Any
) -> torch.Tensor:
    """Requantize (N, C, OH, OW) sums with per-position parameters picked by ``divisor`` (OH, OW)."""
    n, c, oh, ow = sums.shape
    idx = (divisor.reshape(-1) - 1).to(torch.int64)
    flat = sums.reshape(n * c, oh * ow)  # positions on axis 1, so requantize's per-channel path applies
    out = numerics.requantize(flat, mult[idx], shift[idx], dtype, axis=1)
    return out.reshape(n, c, oh, ow)


def _expressible(s_in: float, s_out: float, march: str, what: str) -> None:
    """Refuse, with the fix, an output scale the march cannot requantize a pool's window sums to.

    The divisor table holds every window size from 1 up, and ``d = 1`` has the largest ratio
    ``s_in / s_out``: when that one exceeds the multiplier limit the pool fails on every input, so
    convert says so (the module path is added by convert) instead of the first run."""
    try:
        avg_pool_params(s_in, s_out, 1, march)
    except ValueError as e:
        bound = s_in / (numerics.requant_limits(march).max_multiplier + 0.5)
        raise ValueError(
            f"{what}: output scale {s_out:.6g} is too small for input scale {s_in:.6g} on {march} ({e}). The output "
            "range is far narrower than the input's, typical of an output observer that has seen only the first "
            "steps; calibrate or train until it has seen the pool's real range, or give the pool's output fake quant "
            f"a fixed scale of at least {bound:.6g}"
        ) from None


class MaxPool2d(QuantizedModule):
    """Max pool on codes (exact; the output keeps the input's scale and dtype)."""

    kernel_size: Any
    stride: Any
    padding: Any
    dilation: Any
    ceil_mode: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(
            x.to(torch.float64), self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode
        )
        return y.to(x.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any = None) -> MaxPool2d:
        check_qat(cls, qat, QATMaxPool2d)
        m: Any = qat
        new = cls()
        new._set_scales(input_scales, None, None)
        new.register_buffer("scale", new.input_scale_0.clone())
        new.kernel_size, new.stride, new.padding = m.kernel_size, m.stride, m.padding
        new.dilation, new.ceil_mode = m.dilation, m.ceil_mode
        return new


class AvgPool2d(QuantizedModule):
    """Average pool: exact window sums, requantized with the window's divisor (see the module docstring)."""

    multipliers: torch.Tensor
    shifts: torch.Tensor
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    ceil_mode: bool
    count_include_pad: bool
    divisor_override: int | None

    def _divisor(self, h: int, w: int, like: torch.Tensor) -> torch.Tensor:
        return avg_pool_divisor(
            h, w, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
            self.divisor_override, like.device,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = F.avg_pool2d(x.to(torch.float64), self.kernel_size, self.stride, self.padding, self.ceil_mode, True, 1)
        d = self._divisor(x.shape[-2], x.shape[-1], x)
        assert self.dtype is not None
        return _requant_windows(sums.to(torch.int64), d, self.multipliers, self.shifts, self.dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> AvgPool2d:
        check_qat(cls, qat, QATAvgPool2d)
        m: Any = qat
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        mname = march_name(march)
        check_out_dtype(mname, fq.dtype, cls.__name__)
        new.kernel_size, new.padding = _pair(m.kernel_size), _pair(m.padding)
        new.stride = _pair(m.stride or m.kernel_size)
        new.ceil_mode, new.count_include_pad = m.ceil_mode, m.count_include_pad
        new.divisor_override = m.divisor_override
        kh, kw = new.kernel_size
        top = int(m.divisor_override) if m.divisor_override else kh * kw
        _expressible(new.per_tensor_input(0), float(new.scale[0]), mname, cls.__name__)
        mult, sh = avg_pool_params(new.per_tensor_input(0), float(new.scale[0]), top, mname)
        new.register_buffer("multipliers", mult)
        new.register_buffer("shifts", sh)
        return new


class AdaptiveAvgPool2d(QuantizedModule):
    """Adaptive average pool: torch's adaptive windows, same sum-and-requantize rule as AvgPool2d."""

    output_size: Any
    march: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = int(x.shape[-2]), int(x.shape[-1])
        oh, ow = self._out_size(h, w)
        count = adaptive_pool_counts(h, w, oh, ow, x.device)
        avg = F.adaptive_avg_pool2d(x.to(torch.float64), (oh, ow))
        sums = torch.round(avg * count).to(torch.int64)  # exact: |sum| << 2**52
        mult, sh = self._params(int(count.max()))
        return _requant_windows(sums, count, mult, sh, self.dtype)

    def _out_size(self, h: int, w: int) -> tuple[int, int]:
        o = self.output_size
        oh, ow = (o, o) if isinstance(o, int) else (o[0], o[1])
        return (h if oh is None else int(oh)), (w if ow is None else int(ow))

    def _params(self, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = self.__dict__.setdefault("_param_cache", {})
        if top not in cache:
            s_in, s_out = self.per_tensor_input(0), float(self.scale[0])
            cache[top] = untraced(lambda: avg_pool_params(s_in, s_out, top, self.march))
        return cache[top]

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> AdaptiveAvgPool2d:
        check_qat(cls, qat, QATAdaptiveAvgPool2d)
        fq = output_fq(qat)
        assert fq is not None
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        new.march = march_name(march)
        check_out_dtype(new.march, fq.dtype, cls.__name__)
        _expressible(new.per_tensor_input(0), float(new.scale[0]), new.march, cls.__name__)
        new.output_size = getattr(qat, "output_size")  # noqa: B009
        return new


# ----------------------------------------------------------------------------- IR ops


def _from_qmax_pool2d(op: Any, tensors: dict[str, torch.Tensor]) -> MaxPool2d:
    m = MaxPool2d()
    m._set_scales([op.out.scale[0]], None, None)
    m.register_buffer("scale", m.input_scale_0.clone())
    m.kernel_size, m.stride, m.padding = op.kernel_size, op.stride, op.padding
    m.dilation, m.ceil_mode = op.dilation, op.ceil_mode
    return m


def _from_qavg_pool2d(op: Any, tensors: dict[str, torch.Tensor]) -> AvgPool2d:
    m = AvgPool2d()
    m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
    m.kernel_size, m.stride, m.padding = op.kernel_size, op.stride, op.padding
    m.ceil_mode, m.count_include_pad, m.divisor_override = op.ceil_mode, op.count_include_pad, op.divisor_override
    m.register_buffer("multipliers", tensors["multipliers"])
    m.register_buffer("shifts", tensors["shifts"])
    return m


def _from_qadaptive_avg_pool2d(op: Any, tensors: dict[str, torch.Tensor]) -> AdaptiveAvgPool2d:
    m = AdaptiveAvgPool2d()
    m._set_scales(op.in_scales, op.out.scale[0], op.out.dtype)
    m.march, m.output_size = op.march, op.output_size
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_pool import QAdaptiveAvgPool2d, QAvgPool2d, QMaxPool2d

    register_integer_module(QMaxPool2d, MaxPool2d, _from_qmax_pool2d)
    register_integer_module(QAvgPool2d, AvgPool2d, _from_qavg_pool2d)
    register_integer_module(QAdaptiveAvgPool2d, AdaptiveAvgPool2d, _from_qadaptive_avg_pool2d)


_register_ir()
