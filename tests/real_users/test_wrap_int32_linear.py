"""Horizon's RDK quick start: mobilenet_v2 on CIFAR-10 for Bayes, with the classifier Linear at a
qint32 (high-precision) output, prepared, converted, checked and compiled as the quick start does.

The model is mobilenet_v2's structure at CIFAR size (inverted residuals with ReLU6 and residual
adds, dropout + Linear classifier), narrowed so the test runs in a second.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.quantization import DeQuantStub

from qir import qconfig as horizon_qconfig
from qir.march import March, march_scope
from qir.nn import quantized
from qir.quantization import (
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    prepare_qat_fx,
    set_fake_quantize,
)


@pytest.fixture(autouse=True)
def _bayes() -> Iterator[None]:
    torch.manual_seed(0)
    with march_scope(March.BAYES):
        yield


def conv_bn_relu6(cin: int, cout: int, stride: int = 1, groups: int = 1, k: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU6()
    )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            conv_bn_relu6(cin, hidden, k=1),
            conv_bn_relu6(hidden, hidden, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2Cifar(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.features = nn.Sequential(
            conv_bn_relu6(3, 16, stride=1),
            InvertedResidual(16, 8, 1, 1),
            InvertedResidual(8, 12, 2, 4),
            InvertedResidual(12, 12, 1, 4),
            InvertedResidual(12, 16, 2, 4),
            conv_bn_relu6(16, 64, k=1),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(64, num_classes))
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(self.quant(x)))
        return self.dequant(self.classifier(torch.flatten(x, 1)))


def _quick_start_qat() -> nn.Module:
    qat = prepare_qat_fx(
        MobileNetV2Cifar(),
        {
            "": horizon_qconfig.default_qat_8bit_fake_quant_qconfig,
            "module_name": {"classifier": horizon_qconfig.default_qat_8bit_weight_32bit_out_fake_quant_qconfig},
        },
    )
    qat.train()
    for _ in range(3):
        qat(torch.randn(8, 3, 32, 32))
    qat.eval()
    set_fake_quantize(qat, "validation")
    return qat


def test_classifier_linear_at_int32_out_compiles_on_bayes() -> None:
    qat = _quick_start_qat()
    converted = convert_fx(qat)
    fc = converted.get_submodule("classifier.1")
    assert isinstance(fc, quantized.Linear)

    x = torch.randn(4, 3, 32, 32)
    seen: list[torch.dtype] = []
    fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    logits, want = converted(x), qat(x)
    assert seen == [torch.int32]  # no requantization at the classifier: per-channel dequant scale
    assert (logits.argmax(1) == want.argmax(1)).float().mean() >= 0.75
    assert (logits - want).abs().max() <= 0.1 * want.abs().max()

    report = check_model(converted, x[:1])
    assert report.ok, str(report)
    compiled = compile_model(converted, [x[:1]], opt=1)
    assert torch.equal(compiled(x), logits)


def test_int32_linear_stays_bounded_by_the_table() -> None:
    """qint32 output is accepted; the table's other Linear limits still apply."""

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.fc = nn.Linear(8193, 4)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.fc(self.quant(x)))

    qat = prepare_qat_fx(
        Wide(),
        {
            "": horizon_qconfig.default_qat_8bit_fake_quant_qconfig,
            "module_name": {"fc": horizon_qconfig.default_qat_8bit_weight_32bit_out_fake_quant_qconfig},
        },
    )
    qat(torch.randn(2, 8193))
    qat.eval()
    report = check_model(convert_fx(qat), torch.randn(1, 8193))
    assert not report.ok
    assert [v.message for v in report.violations] == ["in_features = 8193 violates in_features <= 8192"]
