"""QuantStub / DeQuantStub: the float model's marks where quantized computation starts and ends.

Both are identities in float. Their attribute layout is what prepare and convert read:

``QuantStub``
    ``scale``: float32 buffer of shape (1,) when the input scale is fixed
    (``QuantStub(scale=1/128)`` for camera input), else ``None`` (observed).
    ``qconfig``: an optional per-stub :class:`~qir.quantization.qconfig.QConfig`.
    :meth:`QuantStub.make_fake_quant` builds the stub's fake quant from a qconfig,
    honouring the fixed scale.
``DeQuantStub``
    ``qconfig``: optional, unused by the numerics (the output is float).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.ao.quantization import DeQuantStub as TorchDeQuantStub
from torch.ao.quantization import QuantStub as TorchQuantStub

from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig, as_qir_qconfig

__all__ = ["FLOAT_DEQUANT_STUBS", "FLOAT_QUANT_STUBS", "DeQuantStub", "QuantStub"]


class QuantStub(nn.Module):
    """Start of quantized computation; ``scale`` fixes the input scale, ``None`` observes it."""

    scale: torch.Tensor | None

    def __init__(
        self, scale: float | None = None, zero_point: int | None = None, qconfig: QConfig | None = None
    ) -> None:
        super().__init__()
        if zero_point not in (None, 0):
            raise ValueError(f"QuantStub zero_point must be 0 or None: qir quantization is symmetric, got {zero_point}")
        if scale is not None:
            value = float(scale)
            if not (value > 0.0 and math.isfinite(value)):
                raise ValueError(f"QuantStub scale must be positive and finite (e.g. 1/128), got {scale}")
            self.register_buffer("scale", torch.tensor([value], dtype=torch.float32))
        else:
            self.register_buffer("scale", None)
        self.qconfig = as_qir_qconfig(qconfig, "QuantStub qconfig")

    @property
    def has_fixed_scale(self) -> bool:
        return self.scale is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def make_fake_quant(self, qconfig: QConfig | None = None) -> FakeQuantize:
        """The fake quant for this stub's output: ``qconfig`` (else ``self.qconfig``) activation,
        with the fixed scale when one is set."""
        qc = as_qir_qconfig(qconfig if qconfig is not None else self.qconfig, "QuantStub qconfig")
        if qc is None or qc.activation is None:
            raise ValueError(
                "QuantStub needs a qconfig with an activation factory (its output is quantized); "
                "set model.qconfig = get_default_qat_qconfig() or pass qconfig="
            )
        factory = qc.activation
        if self.scale is not None:
            scale = float(self.scale[0])
            fq = factory(scale=scale)
        else:
            fq = factory()
        if not isinstance(fq, FakeQuantize):
            raise TypeError(f"QuantStub activation factory must build a FakeQuantize, got {type(fq).__name__}")
        return fq

    def extra_repr(self) -> str:
        return f"scale={float(self.scale[0]):.6g}" if self.scale is not None else ""


class DeQuantStub(nn.Module):
    """End of quantized computation: identity in float."""

    def __init__(self, qconfig: QConfig | None = None) -> None:
        super().__init__()
        self.qconfig = qconfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


#: The float stubs a user's model may hold, qir's and torch's (recognised, not replaced): one list,
#: imported wherever they are told apart from other modules.
FLOAT_QUANT_STUBS: tuple[type[nn.Module], ...] = (QuantStub, TorchQuantStub)
FLOAT_DEQUANT_STUBS: tuple[type[nn.Module], ...] = (DeQuantStub, TorchDeQuantStub)
