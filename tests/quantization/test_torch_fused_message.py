"""A model fused by torch.quantization.fuse_modules without fuser_func holds torch's fused modules
(torch.ao.nn.intrinsic.ConvReLU2d), which have no QAT class in qir: the error names the fuser to use."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

from qir.march import March, set_march
from qir.quantization import convert, get_default_qat_qconfig, prepare_qat
from qir.quantization.convert import ConvertError


class ConvRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.c, self.r = nn.Conv2d(4, 4, 1), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.r(self.c(self.q(x))))


def test_torch_fused_modules_are_refused_with_fuse_known_modules() -> None:
    set_march(March.BAYES)
    m = ConvRelu().eval()
    torch.quantization.fuse_modules(m, [["c", "r"]], inplace=True)  # torch's ConvReLU2d
    m.train()
    m.qconfig = get_default_qat_qconfig()
    qat = prepare_qat(m)
    qat(torch.rand(2, 4, 5, 5))
    with pytest.raises(
        ConvertError, match=r"ConvReLU2d is torch's fused module .*fuser_func=qir\.quantization\.fuse_known_modules"
    ):
        convert(qat.eval())
