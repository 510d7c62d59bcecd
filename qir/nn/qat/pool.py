"""QAT pooling: max pool keeps its input's scale; average pools have their own output fake quant."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.integer_grid import avg_pool_forward
from qir.quantization.qconfig import QConfig

__all__ = ["AdaptiveAvgPool2d", "AvgPool2d", "MaxPool2d"]


class MaxPool2d(QATModule, nn.MaxPool2d):
    """Max pool on fake-quantized input; no own fake quant (a max of grid values is on the grid)."""

    scale_preserving: ClassVar[bool] = True

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> MaxPool2d:
        if not isinstance(mod, nn.MaxPool2d):
            raise TypeError(f"MaxPool2d.from_float takes an nn.MaxPool2d, got {type(mod).__name__}")
        if mod.return_indices:
            raise NotImplementedError("MaxPool2d(return_indices=True) is not supported in quantized models")
        new = cls(mod.kernel_size, mod.stride, mod.padding, mod.dilation, False, mod.ceil_mode)
        new.activation_post_process = None
        new.train(mod.training)
        return new


class AvgPool2d(QATModule, nn.AvgPool2d):
    """``fq(avg_pool2d(x))``; on the integer grid when prepare_qat_fx bound it."""

    grid_inputs: ClassVar[int] = 1

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> AvgPool2d:
        if not isinstance(mod, nn.AvgPool2d):
            raise TypeError(f"AvgPool2d.from_float takes an nn.AvgPool2d, got {type(mod).__name__}")
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        new = cls(mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode, mod.count_include_pad, mod.divisor_override)
        new.activation_post_process = make_activation_fq(qc, cls.__name__, required=True)
        new.train(mod.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on_grid = avg_pool_forward(self, x, adaptive=False)
        if on_grid is not None:
            return on_grid
        fq: FakeQuantize | None = self.activation_post_process
        assert fq is not None
        return fq(super().forward(x))


class AdaptiveAvgPool2d(QATModule, nn.AdaptiveAvgPool2d):
    """``fq(adaptive_avg_pool2d(x))``; on the integer grid when prepare_qat_fx bound it."""

    grid_inputs: ClassVar[int] = 1

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> AdaptiveAvgPool2d:
        if not isinstance(mod, nn.AdaptiveAvgPool2d):
            raise TypeError(f"AdaptiveAvgPool2d.from_float takes an nn.AdaptiveAvgPool2d, got {type(mod).__name__}")
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        new = cls(mod.output_size)
        new.activation_post_process = make_activation_fq(qc, cls.__name__, required=True)
        new.train(mod.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on_grid = avg_pool_forward(self, x, adaptive=True)
        if on_grid is not None:
            return on_grid
        fq: FakeQuantize | None = self.activation_post_process
        assert fq is not None
        return fq(super().forward(x))
