"""Small models the seed tests share."""

from __future__ import annotations

import torch
from torch import nn
from torch.quantization import DeQuantStub

from qir.quantization import QuantStub


class FuseNet(nn.Module):
    """Seed 001's ModelForFusion (two inputs; conv-bn + y, relu)."""

    def __init__(self) -> None:
        super().__init__()
        self.quantx = QuantStub()
        self.quanty = QuantStub()
        self.conv = nn.Conv2d(3, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.quantx(x))
        return self.dequant(self.relu(self.bn(x) + self.quanty(y)))
