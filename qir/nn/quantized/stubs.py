"""Quantized QuantStub (float -> codes) and DeQuantStub (codes -> float).

``PerCallDeQuantStub`` is the eager converted form of one ``DeQuantStub`` the forward calls on
outputs of different scales (one stub for every head, the plugin's users' habit): the plugin's
quantized tensors carry their scale, and so do the converted eager model's codes, in the tensor
attribute :data:`SCALE_TAG` (written by the converted modules and passed through reshapes by
:mod:`qir.nn.quantized.scale_tags`); the stub dequantizes each call with its input's scale.
"""

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

__all__ = ["SCALE_TAG", "DeQuantStub", "PerCallDeQuantStub", "QuantStub", "scale_tag_of"]

#: tensor attribute of the codes a converted eager model computes (when one of its DeQuantStubs is
#: shared by outputs of different scales): ``(scale, axis)`` of those codes, ``axis`` as
#: :class:`DeQuantStub` stores it (None per tensor, negative per channel)
SCALE_TAG = "_qir_scale"


def scale_tag_of(x: object) -> tuple[torch.Tensor, int | None] | None:
    """The ``(scale, axis)`` tag of tensor ``x``, None when it carries none."""
    return x.__dict__.get(SCALE_TAG) if isinstance(x, torch.Tensor) else None


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


class PerCallDeQuantStub(QuantizedModule):
    """A DeQuantStub called on outputs of different scales: ``codes * scale`` with the scale each
    call's input carries (:data:`SCALE_TAG`), never one fixed scale, and never a scale chosen by the
    order of the calls (a data-dependent forward or a direct call of a submodule changes the order).
    An input of codes without a tag is refused naming the stub; a float input passes (hybrid models).
    ``compile_model`` lowers each call with the scale its operand's IR type carries."""

    num_inputs: ClassVar[int] = 0
    #: the frontend builds the ``qdequant_stub`` op of a call from its operand's type
    scale_from_input: ClassVar[bool] = True

    def __init__(self, path: str = "") -> None:
        super().__init__()
        self.path = path
        self._set_scales([], None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            return x  # already float (a float segment feeds the stub)
        tag = scale_tag_of(x)
        if tag is None:
            raise ValueError(
                f"DeQuantStub '{self.path}' is shared by outputs of different scales, so it dequantizes each call "
                f"with the scale its input carries, and this input ({x.dtype} codes of shape {tuple(x.shape)}) "
                "carries none: the scale travels from the converted modules' outputs through view / reshape / "
                "permute / getitem / flatten / contiguous (a per-channel qint32 output only through contiguous / "
                "clone / detach) while the model's forward runs. Call the stub on such a tensor inside the "
                "forward, or give this output its own DeQuantStub"
            )
        scale, axis = tag
        return numerics.dequantize(x, scale.reshape(-1), axis=axis)

    def extra_repr(self) -> str:
        return "scale=per call (its input's)"


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
    # emitting a call of the shared stub gives it a DeQuantStub of its own, at its call's scale
    register_integer_module(QDequantStub, PerCallDeQuantStub, _from_qdequant_stub)


_register_ir()
