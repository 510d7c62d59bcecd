"""QAT PReLU: ``fq(prelu(x, slope))`` with the slope a float parameter (folded into multipliers when quantized)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig

__all__ = ["PReLU"]


class PReLU(QATModule):
    """``activation_post_process(prelu(x, weight))``: one slope, or one per channel (dim 1).

    The slope is not fake-quantized: the integer form folds it into the negative side's
    requantization multiplier (docs/semantics.md, "PReLU").
    """

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = nn.PReLU

    def __init__(self, weight: torch.Tensor, activation_post_process: FakeQuantize) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.num_parameters = int(weight.numel())
        self.activation_post_process = activation_post_process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.activation_post_process is not None
        return self.activation_post_process(F.prelu(x, self.weight))

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> PReLU:
        if not isinstance(mod, nn.PReLU):
            raise TypeError(f"PReLU.from_float takes nn.PReLU, got {type(mod).__name__}")
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        fq = make_activation_fq(qc, cls.__name__, required=True)
        assert fq is not None
        new = cls(mod.weight, fq)
        new.weight.requires_grad_(mod.weight.requires_grad)
        new.train(mod.training)
        return new

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"
