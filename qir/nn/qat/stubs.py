"""QAT QuantStub / DeQuantStub, built from qir's or torch's float stubs."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.qtensor import QTensor
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig
from qir.quantization.stubs import QuantStub as FloatQuantStub

__all__ = ["DeQuantStub", "QuantStub"]


class QuantStub(QATModule):
    """Fake-quantizes the model input: a fixed-scale fake quant when the float stub had ``scale``, else observed."""

    def __init__(self, activation_post_process: FakeQuantize, qconfig: QConfig | None = None) -> None:
        super().__init__()
        if not isinstance(activation_post_process, FakeQuantize):
            raise TypeError(f"QuantStub needs a FakeQuantize, got {type(activation_post_process).__name__}")
        self.activation_post_process = activation_post_process
        self.qconfig = qconfig

    @property
    def has_fixed_scale(self) -> bool:
        return self.activation_post_process is not None and self.activation_post_process.has_fixed_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.activation_post_process is not None
        if isinstance(x, QTensor):  # a QTensor of codes means its real values, not the codes
            x = x.dequantize()
        return self.activation_post_process(x)

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> QuantStub:
        """From ``qir.quantization.QuantStub`` (honours its fixed ``scale``) or torch's QuantStub."""
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        if isinstance(mod, FloatQuantStub):
            fq = mod.make_fake_quant(qc)
        else:
            made = make_activation_fq(qc, cls.__name__, required=True)
            assert made is not None
            fq = made
        new = cls(fq, qc)
        new.train(mod.training)
        return new


class DeQuantStub(QATModule):
    """End of quantized computation: identity in QAT (the output stays float)."""

    scale_preserving: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.activation_post_process = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> DeQuantStub:
        new = cls()
        new.train(mod.training)
        return new
