"""QAT GLU: ``fq(a * fq_sigmoid(sigmoid(b)))`` for the halves ``a, b`` of the input along ``dim``."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig

__all__ = ["GLU"]


class GLU(QATModule):
    """GLU with fake quants where the integer form quantizes: the sigmoid's output
    (``sigmoid_post_process``, the table's output codes) and the product (``activation_post_process``).

    Both are built from ``qconfig.activation``.
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.GLU

    def __init__(self, dim: int, sigmoid_post_process: FakeQuantize, activation_post_process: FakeQuantize) -> None:
        super().__init__()
        self.dim = int(dim)
        self.sigmoid_post_process = sigmoid_post_process
        self.activation_post_process = activation_post_process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.activation_post_process is not None
        if x.shape[self.dim] % 2:
            raise ValueError(f"GLU: dimension {self.dim} of the input has odd size {x.shape[self.dim]}; GLU halves it")
        a, b = x.chunk(2, dim=self.dim)
        return self.activation_post_process(a * self.sigmoid_post_process(torch.sigmoid(b)))

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> GLU:
        if not isinstance(mod, nn.GLU):
            raise TypeError(f"GLU.from_float takes nn.GLU, got {type(mod).__name__}")
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        sig = make_activation_fq(qc, cls.__name__, required=True)
        out = make_activation_fq(qc, cls.__name__, required=True)
        assert sig is not None and out is not None
        new = cls(mod.dim, sig, out)
        new.train(mod.training)
        return new

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
