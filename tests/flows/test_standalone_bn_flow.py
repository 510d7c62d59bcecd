"""densenet's standalone batch norm (after a cat) through the whole flow: prepare makes it a depthwise 1x1
QAT conv at the batch norm's path, and the QAT grid, validation, the converted model and the artifact agree
bit for bit on both marches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


class DenseLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(12)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(12, 6, 1)
        self.norm2 = nn.BatchNorm2d(6)  # no relu after it: a depthwise conv of its own
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.conv0(x := self.quant(x)), self.conv1(x)], 1)
        z = self.conv2(self.relu(self.norm(y)))
        return self.dequant(self.norm2(torch.cat([z, z], 1)[:, :6]))


def _model() -> DenseLayer:
    torch.manual_seed(0)
    m = DenseLayer()
    for bn in (m.norm, m.norm2):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(-2, 2)
        bn.bias.data.uniform_(-1, 1)
    return m.eval()


@pytest.mark.filterwarnings("ignore:.*runs under eval\\(\\) in QAT fake-quant state")  # the grid check's forward
# without example inputs prepare's IR has stand-in sizes (the channel count comes from the statistics)
@pytest.mark.parametrize(("march", "examples"), [("bayes", True), ("bernoulli2", False)])
def test_a_standalone_batch_norm_trains_converts_and_compiles_bit_exact(march: str, examples: bool) -> None:
    m = _model()
    x = torch.randn(2, 3, 8, 8)
    with march_scope(march):
        calib = prepare_qat_fx(m, {"": get_default_calib_qconfig()}, (x,) if examples else None)
        calib.eval()
        calib(x)
        qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
        assert type(qat.norm).__name__ == "ConvReLU2d" and qat.norm.groups == 12  # the relu fused into it
        assert type(qat.norm2).__name__ == "Conv2d" and qat.norm2.weight.shape == (6, 1, 1, 1)
        assert not any("running_mean" in k for k in qat.state_dict())
        assert isinstance(m.norm, nn.BatchNorm2d)  # the user's model is left as it was
        qat.train()
        opt = torch.optim.SGD(qat.parameters(), lr=1e-2)
        before = qat.norm.weight.detach().clone()
        for _ in range(2):
            loss = qat(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert not torch.equal(before, qat.norm.weight.detach())  # the scale trains as the conv's weight
        qat.eval()
        with torch.no_grad():
            grid = qat(x)  # observes, then computes on the grid of the scales it leaves
            assert torch.equal(grid, convert_fx(qat)(x))
        set_fake_quantize(qat, "validation")
        with torch.no_grad():
            val = qat(x)
            converted = convert_fx(qat)
            out = converted(x)
        assert torch.equal(val, out)
        assert check_model(converted, x, march=march).ok
        compiled = compile_model(converted, [x], march=march)
        with torch.no_grad():
            assert torch.equal(compiled(x), out)
