"""Float models and the fx / eager flows the bit-exact tests compile (shared by the test files)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.ao.quantization import DeQuantStub

from qir.examples import DigitsNet
from qir.march import march_scope
from qir.quantization import QuantStub, convert_fx, get_default_qat_qconfig, prepare_qat_fx


class Stubbed(nn.Module):
    """A float model between QuantStub and DeQuantStub (DigitsNet has none: the flows need them)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.body = body
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)) + x)


def chain(spec: Sequence[tuple[str, int, int, int]], cin: int, head: str, classes: int = 5) -> nn.Module:
    """A float model from ``(kind, channels, kernel, stride)`` items: conv / convbn / convbnrelu /
    residual / maxpool / avgpool; ``head``: ``linear`` (flatten + Linear) or ``conv`` (1x1 conv + flatten)."""
    layers: list[nn.Module] = []
    c = cin
    for kind, ch, k, s in spec:
        if kind.startswith("conv"):
            layers.append(nn.Conv2d(c, ch, k, stride=s, padding=k // 2))
            if "bn" in kind:
                layers.append(nn.BatchNorm2d(ch))
            if kind.endswith("relu"):
                layers.append(nn.ReLU())
            c = ch
        elif kind == "residual":
            layers.append(Residual(c))
        elif kind == "maxpool":
            layers.append(nn.MaxPool2d(k, stride=s, padding=k // 2))
        elif kind == "avgpool":
            layers.append(nn.AvgPool2d(k, stride=s, padding=k // 2))
    layers.append(nn.AdaptiveAvgPool2d(1))
    if head == "linear":
        layers += [nn.Flatten(1), nn.Linear(c, classes)]
    else:
        layers += [nn.Conv2d(c, classes, 1), nn.Flatten(1)]
    return Stubbed(nn.Sequential(*layers))


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model


def fx_converted(
    model: nn.Module,
    shape: tuple[int, ...],
    march: str,
    batches: int = 3,
    qconfig_dict: dict | None = None,
    seed: int = 0,
) -> nn.Module:
    """prepare_qat_fx -> a few calibration batches -> convert_fx, under ``march``."""
    with march_scope(march):
        prepared = prepare_qat_fx(model, qconfig_dict or {"": get_default_qat_qconfig()})
        prepared.train()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _ in range(batches):
                prepared(torch.randn(*shape, generator=g))
        prepared.eval()
        return convert_fx(prepared)


def digits_net(width: int = 8) -> nn.Module:
    return Stubbed(randomize_bn(DigitsNet(width=width)))
