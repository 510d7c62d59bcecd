"""``GridSample``: ``torch.nn.functional.grid_sample`` as a module (what prepare generates for the call)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GridSample"]

_MODES = ("bilinear", "nearest")
_PADDING = ("zeros", "border")


class GridSample(nn.Module):
    """Sample a 4-D (N, C, H, W) input at a (N, Ho, Wo, 2) grid of normalized (x, y) in [-1, 1].

    ``mode`` "bilinear" or "nearest", ``padding_mode`` "zeros" or "border": the BPU's
    choices. ``align_corners=None`` is torch's default, False.
    """

    def __init__(self, mode: str = "bilinear", padding_mode: str = "zeros", align_corners: bool | None = None) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"GridSample mode must be one of {', '.join(_MODES)}, got {mode!r}")
        if padding_mode not in _PADDING:
            raise ValueError(f"GridSample padding_mode must be one of {', '.join(_PADDING)}, got {padding_mode!r}")
        self.mode = mode
        self.padding_mode = padding_mode
        self.align_corners = bool(align_corners)

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return F.grid_sample(x, grid, self.mode, self.padding_mode, self.align_corners)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, padding_mode={self.padding_mode!r}, align_corners={self.align_corners}"
