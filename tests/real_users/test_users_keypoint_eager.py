"""A SimpleBaseline keypoint model in eager mode, as Horizon users write it: conv + bn + relu
stems and ``ConvTranspose2d`` + bn + relu upsampling fused with
``torch.quantization.fuse_modules(..., fuser_func=fuse_known_modules)`` from a ``fuse_model()``
method, qconfigs from ``set_qconfig()`` (a high-precision heatmap conv), eager ``prepare_qat``,
QAT, ``convert``, check, compile, run, and the argmax decode of the heatmaps."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from names_flow import finish
from torch import nn

from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert,
    fuse_known_modules,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat,
    set_fake_quantize,
)


class SimpleBaseline(nn.Module):
    def __init__(self, joints: int = 5) -> None:
        super().__init__()
        self.quant = QuantStub(scale=1 / 128)
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(True)
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(16, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(True)
        layers: list[nn.Module] = []
        cin = 32
        for _ in range(2):
            layers += [
                nn.ConvTranspose2d(cin, 16, 4, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(16),
                nn.ReLU(True),
            ]
            cin = 16
        self.deconv_layers = nn.Sequential(*layers)
        self.final_layer = nn.Conv2d(16, joints, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(self.quant(x))))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.dequant(self.final_layer(self.deconv_layers(x)))

    def fuse_model(self) -> None:
        groups = [["conv1", "bn1", "relu1"], ["conv2", "bn2", "relu2"]]
        groups += [[f"deconv_layers.{i}", f"deconv_layers.{i + 1}", f"deconv_layers.{i + 2}"] for i in (0, 3)]
        torch.quantization.fuse_modules(self, groups, inplace=True, fuser_func=fuse_known_modules)

    def set_qconfig(self) -> None:
        self.qconfig = get_default_qat_qconfig()
        self.final_layer.qconfig = get_default_qat_out_qconfig()


def _images() -> torch.Tensor:
    return torch.rand(2, 3, 32, 32) * 2 - 1


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_the_deconv_head_fuses_trains_converts_compiles_and_decodes() -> None:
    model = SimpleBaseline()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    model.eval()
    x = _images()
    with torch.no_grad():
        ref = model(x)
        model.fuse_model()
        assert type(model.deconv_layers[0]).__name__ == "ConvTransposeReLU2d"
        assert isinstance(model.deconv_layers[1], nn.Identity) and isinstance(model.deconv_layers[2], nn.Identity)
        assert torch.allclose(model(x), ref, atol=1e-5)
    model.set_qconfig()
    model.train()
    qat = prepare_qat(model)
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for _ in range(3):
        loss = qat(_images()).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    result = finish(qat, convert(qat), (x,))
    heatmaps = result.integer_out
    assert heatmaps.shape == (2, 5, 32, 32)
    # eager QAT still simulates in float (docs/semantics.md), so the integer model differs by less
    # than an LSB of the deconv output (measured: 0.001)
    lsb = float(qat.deconv_layers[3].activation_post_process.scale)
    assert result.max_error() <= lsb
    peaks = heatmaps.flatten(2).argmax(-1)
    assert torch.equal(peaks, result.qat_out.flatten(2).argmax(-1))
