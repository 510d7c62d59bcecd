"""QAT Interpolate: nearest keeps its input's scale; bilinear has its own output fake quant."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from qir.nn.modules.interpolate import Interpolate as FloatInterpolate
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.integer_grid_functional import interpolate_forward
from qir.quantization.qconfig import QConfig

__all__ = ["Interpolate"]


class Interpolate(QATModule, FloatInterpolate):
    """``interpolate(x)``, then ``fq`` for bilinear (``activation_post_process`` is None for nearest)."""

    #: ``size`` (forward position 1) is a run-time size (ints from ``y.shape[2:]``), never codes
    float_inputs: ClassVar[tuple[int, ...]] = (1,)
    #: bilinear trains on the integer grid when its input's scale is known (qir.quantization.integer_grid)
    grid_inputs: ClassVar[int] = 1

    def float_forward(self, x: torch.Tensor, size: Any = None) -> torch.Tensor:
        """The float resize, before the output fake quant."""
        return super().forward(x, size)

    def forward(self, x: torch.Tensor, size: Any = None) -> torch.Tensor:
        grid = interpolate_forward(self, x, size)
        if grid is not None:
            return grid
        y = self.float_forward(x, size)
        return y if self.activation_post_process is None else self.activation_post_process(y)

    @property
    def is_scale_preserving(self) -> bool:
        return self.mode == "nearest"

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> Interpolate:
        """From ``qir.nn.Interpolate`` or ``torch.nn.Upsample`` (same fields)."""
        if not isinstance(mod, (FloatInterpolate, nn.Upsample)):
            raise TypeError(f"Interpolate.from_float takes qir.nn.Interpolate or nn.Upsample, got {type(mod).__name__}")
        m: Any = mod
        new = cls(m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor)
        if new.mode == "nearest":
            new.activation_post_process = None
        else:
            qc = resolve_qconfig(mod, qconfig, cls.__name__)
            new.activation_post_process = make_activation_fq(qc, cls.__name__, required=True)
        new.train(mod.training)
        return new
