"""Small float models shared by the flow tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.ao.quantization import DeQuantStub

from qir.quantization import QuantStub


class ModelForFusion(nn.Module):
    """Seed 001's fusion example."""

    def __init__(self) -> None:
        super().__init__()
        self.quantx = QuantStub()
        self.quanty = QuantStub()
        self.conv = nn.Conv2d(3, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.quantx(x)
        y = self.quanty(y)
        x = self.conv(x)
        x = self.bn(x)
        x = x + y
        x = self.relu(x)
        return self.dequant(x)


class Block(nn.Module):
    """conv-bn-relu, conv-bn, + identity, relu: a residual block using ``+``."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu2(y + x)


class ResNetish(nn.Module):
    """Stem, two residual stages, a cat, a mean and a linear head."""

    def __init__(self, c: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.stem_bn = nn.BatchNorm2d(c)
        self.layer1 = nn.Sequential(Block(c), Block(c))
        self.pool = nn.MaxPool2d(2)
        self.side = nn.Conv2d(c, c, 1)
        self.fc = nn.Linear(2 * c, classes)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = torch.relu(self.stem_bn(self.stem(x)))
        x = self.layer1(x)
        x = self.pool(x)
        x = torch.cat([x, self.side(x)], dim=1)
        x = x.mean(dim=(2, 3))
        return self.dequant(self.fc(x))


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial batch-norm statistics, so folding is visible."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model
