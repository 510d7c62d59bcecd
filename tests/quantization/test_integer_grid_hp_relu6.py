"""A high-precision-output conv (get_default_qat_out_qconfig) fused with ReLU6 trains on the integer grid.

Its requantization clamps at a number below (0) and a per-channel tensor above (the code of 6.0 at the
accumulator scale): the torch path's clamp raised a TypeError on the mix before.
"""

from __future__ import annotations

import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    disable_observer,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat_fx,
)


class _ConvBnRelu6(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU6()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.act(self.bn(self.conv(self.quant(x)))))


def test_high_precision_relu6_trains_on_grid_and_equals_converted() -> None:
    torch.manual_seed(0)
    qconfig = {"": get_default_qat_qconfig(), "module_name": [("conv", get_default_qat_out_qconfig())]}
    with march_scope("bayes"):
        m = prepare_qat_fx(_ConvBnRelu6(), qconfig)
    m.train()
    x = torch.randn(2, 3, 8, 8) * 8
    y = m(x)
    y.sum().backward()
    assert integer_grid_report(m) == {"conv": "grid"}
    assert m.conv.weight.grad is not None and m.conv.weight.grad.abs().sum() > 0
    disable_observer(m)
    with torch.no_grad():
        m.conv.weight.mul_(4)  # outputs beyond 6: the per-channel upper clamp engages
        qat = m(x)
    with march_scope("bayes"):
        converted = convert_fx(m)
    out = converted(x)
    assert torch.equal(qat, out)
    assert (qat.amax() > 5.9).item() and (qat == qat.amax()).sum() > 1
