"""A small CNN for scikit-learn's handwritten digits (8x8 images upsampled to 28x28).

Its layers cover what the BPU fuses: conv + batch norm + relu, a residual add, pooling,
and a 1x1 conv classifier (both marches support conv; Bernoulli2 has no Linear).
"""

from __future__ import annotations

import torch
from torch import nn


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int, stride: int = 1) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )


class Residual(nn.Module):
    """conv-bn -> add the input -> relu: the seeds' Conv+BN+Add+ReLU fusion pattern."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(ch)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)) + x)


class DigitsNet(nn.Module):
    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBNReLU(1, width, 3)
        self.pool = nn.MaxPool2d(2)
        self.block = Residual(width)
        self.down = ConvBNReLU(width, 2 * width, 3, stride=2)
        self.avg = nn.AvgPool2d(7)
        self.classifier = nn.Conv2d(2 * width, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stem(x))
        x = self.block(x)
        x = self.avg(self.down(x))
        return self.classifier(x).flatten(1)
