"""Seed 003's hybrid model (with its two typos fixed) and small models for the hybrid tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import DeQuantStub


class ConvBNReLU(nn.Sequential):
    def __init__(self, channels: int = 3) -> None:
        super().__init__(nn.Conv2d(channels, channels, 1), nn.BatchNorm2d(channels), nn.ReLU())


class ConvReLU(nn.Sequential):
    """The seed defines it and names ``layer1.conv`` in its hybrid_dict: it is meant for layer1."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)
        self.relu = torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = self.relu(x)
        return x


class _SeluModule(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.selu(input)


def seed_hybrid_dict() -> dict[str, list[object]]:
    """Seed 003's hybrid_dict."""
    return {"module_name": ["layer1.conv", "conv0"], "module_type": [_SeluModule]}


class HybridModel(nn.Module):
    """Seed 003's HybridModel; ``literal=True`` keeps the seed's ``layer1 = ConvBNReLU()``."""

    def __init__(self, channels: int = 3, literal: bool = False) -> None:
        super().__init__()
        self.layer0 = ConvBNReLU()
        self.layer1 = ConvBNReLU() if literal else ConvReLU()
        self.layer2 = ConvBNReLU()
        self.selu = _SeluModule()
        self.conv0 = nn.Conv2d(channels, channels, 1)
        self.conv1 = nn.Conv2d(channels, channels, 1)
        self.dequant = DeQuantStub()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.selu(input)  # the seed reads an undefined x here
        x = self.layer0(x)
        x = self.selu(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.conv0(x)
        x = self.conv1(x)
        x = self.selu(x)
        return self.dequant(x)


class NoBPUForm(nn.Module):
    """A GroupNorm module and a cumsum between convs: neither has a quantized form. No stubs at all."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gn(self.c1(x))
        return torch.cumsum(self.c2(x), 1)


class Residual(nn.Module):
    """A CPU branch joining a BPU value at an add; a sigmoid right after the CPU branch."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 3, 1)
        self.branch = ConvBNReLU()
        self.c2 = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c1(x)
        y = torch.sigmoid(self.branch(x))
        return F.relu(self.c2(x + y))
