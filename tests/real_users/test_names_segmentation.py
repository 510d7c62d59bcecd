"""A small FPN segmentation model as the plugin's users write it: ``qir.nn.Interpolate(scale_factor=2)``
relying on the plugin's bilinear default, a custom qconfig from ``fake_quantize.default_8bit_fake_quant``,
``March`` checks, and an argmax on the float output."""

import pytest
import torch
from names_flow import fx_flow
from torch import nn

import qir as horizon
from qir.march import March, march_scope, set_march
from qir.nn.quantized import FloatFunctional
from qir.quantization import DeQuantStub, QConfig, QuantStub, fake_quantize, get_default_qat_qconfig


class TinyFPNSeg(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c1 = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.c2 = nn.Sequential(nn.Conv2d(8, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.lateral = nn.Conv2d(8, 8, 1)
        self.up = horizon.nn.Interpolate(scale_factor=2)  # the plugin's default mode: bilinear
        self.up_out = horizon.nn.Interpolate(scale_factor=2)
        self.merge = FloatFunctional()
        self.head = nn.Conv2d(8, classes, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f1 = self.c1(self.quant(x))
        f2 = self.c2(f1)
        p1 = self.merge.add(self.lateral(f1), self.up(f2))
        return self.dequant(self.up_out(self.head(p1)))


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(1, 3, 16, 16),)


def test_fpn_segmentation_with_default_bilinear_upsampling() -> None:
    torch.manual_seed(0)
    qat_qconfig = QConfig(
        activation=fake_quantize.default_8bit_fake_quant,
        weight=fake_quantize.default_weight_8bit_fake_quant,
    )
    assert qat_qconfig == get_default_qat_qconfig()  # the module's defaults are the default qconfig's
    with march_scope(March.BAYES):
        result = fx_flow(TinyFPNSeg(), _inputs, qat_dict={"": qat_qconfig})
    assert result.converted.up.mode == "bilinear" and result.converted.up_out.mode == "bilinear"
    assert result.qat.up.activation_post_process is not None  # bilinear requantizes to its own scale
    lsb = float(result.qat.up_out.activation_post_process.scale)
    assert result.max_error() <= 2 * lsb
    agree = (result.integer_out.argmax(1) == result.qat_out.argmax(1)).float().mean()
    assert agree >= 0.9


def test_nash_marches_are_refused_with_the_supported_list() -> None:
    with pytest.raises(AttributeError, match=r"March\.NASH_E is not supported by qir.*bernoulli2, bayes"):
        horizon.march.March.NASH_E  # noqa: B018
    with pytest.raises(ValueError, match="not supported by qir"):
        set_march("nash-m")
