"""Small converted models for the perf_model / visualize_model tests (eager flow, a few calibration batches)."""

from __future__ import annotations

import torch
from torch import nn
from torch.ao.quantization import DeQuantStub

from qir.march import march_scope
from qir.quantization import (
    QuantStub,
    convert,
    fuse_known_modules,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat,
)


class Stubbed(nn.Module):
    def __init__(self, *body: nn.Module, scale: float | None = None) -> None:
        super().__init__()
        self.quant = QuantStub(scale=scale) if scale is not None else QuantStub()
        self.body = nn.Sequential(*body)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


def eager_converted(
    model: nn.Module,
    shape: tuple[int, ...],
    march: str,
    fuse: list[list[str]] | None = None,
    out_qconfig: str | None = None,
) -> nn.Module:
    """fuse (optional) -> prepare_qat -> 2 calibration batches -> convert, under ``march``."""
    with march_scope(march):
        if fuse:
            torch.ao.quantization.fuse_modules(model, fuse, inplace=True, fuser_func=fuse_known_modules)
        model.qconfig = get_default_qat_qconfig()
        if out_qconfig is not None:
            model.get_submodule(out_qconfig).qconfig = get_default_qat_out_qconfig()
        prepare_qat(model, inplace=True)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _ in range(2):
                model(torch.rand(*shape, generator=g) * 2 - 1)
        return convert(model.eval(), inplace=False)


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__(nn.Conv2d(cin, cout, k), nn.BatchNorm2d(cout), nn.ReLU())


class Seed002Net(nn.Module):
    """Seed 002's eager-mode network, as the seed writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = ConvBNReLU(1, 10, 5)
        self.max_pool = nn.MaxPool2d(kernel_size=2)
        self.conv1 = ConvBNReLU(10, 20, 5)
        self.avg_pool = nn.AvgPool2d(kernel_size=8)
        self.classifier = nn.Conv2d(20, 10, 1)
        self.quant = QuantStub(scale=1 / 128)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = self.conv0(x)
        x = self.max_pool(x)
        x = self.conv1(x)
        x = self.avg_pool(x)
        x = self.classifier(x)
        return self.dequant(x)

    def fuse_model(self) -> None:
        for m in self.modules():
            if type(m) is ConvBNReLU:
                torch.ao.quantization.fuse_modules(m, ["0", "1", "2"], inplace=True, fuser_func=fuse_known_modules)
