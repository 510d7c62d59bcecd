"""Quantized QuantStub (float -> codes) and DeQuantStub (codes -> float)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from backends.common import numerics
from qir.nn.qat.stubs import DeQuantStub as QATDeQuantStub
from qir.nn.qat.stubs import QuantStub as QATQuantStub
from qir.nn.quantized._base import QuantizedModule, check_qat, output_fq
from qir.qtensor import QTensor

__all__ = ["DeQuantStub", "QuantStub"]


class QuantStub(QuantizedModule):
    """``quantize(x, scale, dtype)``: half-up, saturating. ``scale`` is a buffer read at every call,
    so ``stub.scale.fill_(1.0)`` re-targets it (raw centered YUV input, docs/modules.md)."""

    num_inputs: ClassVar[int] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.dtype is not None
        if isinstance(x, QTensor) and x.is_quantized:
            return self._codes_of(x)
        if not x.is_floating_point():
            raise TypeError(f"QuantStub takes a float tensor (or a QTensor of codes at its scale), got {x.dtype}")
        return numerics.quantize(x, self.scale, self.dtype)

    def _codes_of(self, x: QTensor) -> torch.Tensor:
        """The plugin's multi-subnet input: codes already at this stub's scale and dtype pass through."""
        assert self.dtype is not None
        same_scale = x.q_per_channel_axis() == -1 and torch.equal(
            x.q_scale().to(torch.float32), self.scale.reshape(-1).to(x.q_scale().device)
        )
        if not same_scale or x.qdtype != self.dtype.name:
            raise ValueError(
                f"QuantStub got a QTensor of {x.qdtype} codes at scale {x.q_scale().tolist()} but quantizes to "
                f"{self.dtype.name} at scale {self.scale.reshape(-1).tolist()}; pass x.dequantize() to requantize"
            )
        return x.int_repr()

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any] = (), march: Any = None) -> QuantStub:
        """``input_scales`` must be empty (the input is float); ``march`` is unused."""
        check_qat(cls, qat, QATQuantStub)
        fq = output_fq(qat)
        if fq is None:
            raise ValueError("QuantStub.from_qat: the QAT stub has no activation_post_process")
        new = cls()
        new._set_scales(input_scales, fq.scale.detach(), fq.dtype)
        return new


class DeQuantStub(QuantizedModule):
    """``codes * scale`` in float32, ``scale`` being the input's scale (per channel for a qint32 output)."""

    axis: int | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            return x  # already float (a float segment feeds the stub)
        return numerics.dequantize(x, self.scale.reshape(-1), axis=self.axis)

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any = None) -> DeQuantStub:
        check_qat(cls, qat, QATDeQuantStub)
        new = cls()
        new._set_scales(input_scales, None, None)
        new.register_buffer("scale", new.input_scale_0.clone())
        # a per-channel scale is shaped to broadcast: its rank counts channel axis and the rest
        new.axis = None if new.scale.numel() == 1 else -new.scale.dim()
        return new


# ----------------------------------------------------------------------------- IR ops


def _from_qquant_stub(op: Any, tensors: dict[str, torch.Tensor]) -> QuantStub:
    """The QuantStub a ``qquant_stub`` op stands for (emit and evaluation)."""
    m = QuantStub()
    m._set_scales([], torch.tensor(op.out.scale, dtype=torch.float32), op.out.dtype)
    return m


def _from_qdequant_stub(op: Any, tensors: dict[str, torch.Tensor]) -> DeQuantStub:
    """The DeQuantStub a ``qdequant_stub`` op stands for: a per-channel scale is shaped to
    broadcast from its (negative) axis, as ``from_qat`` stores it."""
    m = DeQuantStub()
    scale = torch.tensor(op.in_scales, dtype=torch.float32)
    if op.axis is not None:
        scale = scale.reshape([len(op.in_scales)] + [1] * (-op.axis - 1))
    m._set_scales([scale], None, None)
    m.register_buffer("scale", m.input_scale_0.clone())
    m.axis = op.axis
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_stubs import QDequantStub, QQuantStub

    register_integer_module(QQuantStub, QuantStub, _from_qquant_stub)
    register_integer_module(QDequantStub, DeQuantStub, _from_qdequant_stub)


_register_ir()
