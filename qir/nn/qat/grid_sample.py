"""QAT GridSample: bilinear has its own output fake quant; nearest keeps its input's scale."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.numerics import round_half_up
from backends.common.sampling_rules import GRID_COORD_BITS
from qir.nn.modules.grid_sample import GridSample as FloatGridSample
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.qconfig import QConfig

__all__ = ["GRID_COORD_BITS", "GridSample", "grid_sample_nearest"]


def _unnormalize(g: torch.Tensor, size: int, align_corners: bool) -> torch.Tensor:
    """torch's grid_sample source coordinate of normalized ``g`` along an axis of ``size``."""
    if align_corners:
        return (g + 1) / 2 * (size - 1)
    return ((g + 1) * size - 1) / 2


def grid_sample_nearest(x: torch.Tensor, grid: torch.Tensor, padding_mode: str, align_corners: bool) -> torch.Tensor:
    """Nearest grid sampling with the integer rule's rounding points.

    The source coordinate (float64) is rounded half up to ``2**-15`` (the integer rule's
    fixed point), then half up to an index. torch's ``grid_sample(mode="nearest")`` rounds
    half to even; ties are common here (the centre of an even-sized axis without
    ``align_corners``), so QAT uses the deployed rounding. Differentiable in ``x`` (a
    gather); the grid gets no gradient, as in torch.
    """
    n, c, h, w = x.shape
    idx = []
    valid = torch.ones(grid.shape[:3], dtype=torch.bool, device=x.device)
    for k, size in ((0, w), (1, h)):
        one = float(1 << GRID_COORD_BITS)
        src = _unnormalize(grid[..., k].detach().to(torch.float64), size, align_corners)
        fixed = round_half_up(src.nan_to_num(nan=-2.0).clamp(-2.0, size + 1.0) * one)
        if padding_mode == "border":
            fixed = fixed.clamp(0, (size - 1) * one)
        i = torch.floor((fixed + one / 2) / one).to(torch.int64)
        valid &= (i >= 0) & (i < size)
        idx.append(i.clamp(0, size - 1))
    ho, wo = int(grid.shape[1]), int(grid.shape[2])
    flat_idx = (idx[1] * w + idx[0]).reshape(n, 1, ho * wo).expand(n, c, ho * wo)
    out = torch.gather(x.reshape(n, c, h * w), 2, flat_idx) * valid.reshape(n, 1, ho * wo).to(x.dtype)
    return out.reshape(n, c, ho, wo)


class GridSample(QATModule, FloatGridSample):
    """Bilinear: ``fq(grid_sample(x, grid))``; nearest: :func:`grid_sample_nearest` (no fake quant).

    The grid must be quantized (qint8 or qint16 codes at its producer's scale, e.g. a
    ``QuantStub`` with a qint16 qconfig): the integer form reads it as codes.
    """

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        if self.mode == "nearest":
            return grid_sample_nearest(x, grid, self.padding_mode, self.align_corners)
        assert self.activation_post_process is not None
        return self.activation_post_process(F.grid_sample(x, grid, "bilinear", self.padding_mode, self.align_corners))

    @property
    def is_scale_preserving(self) -> bool:
        return self.mode == "nearest"

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> GridSample:
        if not isinstance(mod, FloatGridSample):
            raise TypeError(f"GridSample.from_float takes qir.nn.GridSample, got {type(mod).__name__}")
        m: Any = mod
        new = cls(m.mode, m.padding_mode, m.align_corners)
        if new.mode == "nearest":
            new.activation_post_process = None
        else:
            qc = resolve_qconfig(mod, qconfig, cls.__name__)
            new.activation_post_process = make_activation_fq(qc, cls.__name__, required=True)
        new.train(mod.training)
        return new
