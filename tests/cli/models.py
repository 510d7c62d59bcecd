"""Factories the CLI tests load as ``tests/cli/models.py:NAME``."""

from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    """conv-bn-relu, max pool, 1x1-conv classifier: legal on both marches; no QuantStub."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.relu(self.bn(self.conv(x)))))


class WithLinear(nn.Module):
    """Linear and AdaptiveAvgPool2d: Bernoulli2 runs neither (illegal there), Bayes runs both."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.gap(torch.relu(self.conv(x))), 1))


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return Tiny()


def with_linear() -> nn.Module:
    torch.manual_seed(0)
    return WithLinear()


def converted() -> nn.Module:
    """A model converted in the factory: the CLI uses it as it is."""
    from qir.march import march_scope
    from qir.quantization import convert_fx, get_default_calib_qconfig, prepare_qat_fx, set_fake_quantize
    from qir.quantization.stubs import DeQuantStub, QuantStub

    model = nn.Sequential(QuantStub(), tiny(), DeQuantStub()).eval()
    with march_scope("bayes"):
        calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
        calib.eval()
        with torch.no_grad():
            calib(torch.randn(2, 3, 16, 16))
        set_fake_quantize(calib, "validation")
        return convert_fx(calib)


def raises() -> nn.Module:
    raise ValueError("weights file not found")


def not_a_module() -> int:
    return 3


instance = Tiny()


class TwoInputs(nn.Module):
    """Two inputs, two outputs (a tuple): one QuantStub per input, a DeQuantStub per output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.a(x)), self.b(y)


def two_inputs() -> nn.Module:
    torch.manual_seed(0)
    return TwoInputs()


def qat() -> nn.Module:
    """A QAT model (prepare_qat_fx result): the CLI converts it without calibrating."""
    from qir.march import march_scope
    from qir.quantization import get_default_qat_qconfig, prepare_qat_fx
    from qir.quantization.stubs import DeQuantStub, QuantStub

    model = nn.Sequential(QuantStub(), tiny(), DeQuantStub())
    with march_scope("bayes"):
        prepared = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
        prepared(torch.randn(2, 3, 16, 16))  # observers see one batch
    return prepared.eval()
