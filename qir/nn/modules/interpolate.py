"""``Interpolate``: ``torch.nn.functional.interpolate`` as a module (the eager replacement)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Interpolate"]

_MODES = ("nearest", "bilinear")


class Interpolate(nn.Module):
    """Resize a 4-D (N, C, H, W) tensor: ``mode`` "bilinear" (the default) or "nearest".

    The defaults are the plugin's (``horizon.nn.Interpolate()`` is bilinear with
    ``align_corners=None``), not ``F.interpolate``'s nearest: code written for the plugin
    that relies on the default keeps resizing bilinearly (docs/migration.md).
    """

    def __init__(
        self,
        size: int | Sequence[int] | None = None,
        scale_factor: float | Sequence[float] | None = None,
        mode: str = "bilinear",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"Interpolate mode must be one of {', '.join(_MODES)}, got {mode!r}")
        if (size is None) == (scale_factor is None):
            raise ValueError("Interpolate needs exactly one of size= and scale_factor=")
        if mode == "nearest" and align_corners:
            raise ValueError("Interpolate: align_corners only applies to mode='bilinear'")
        self.size = tuple(int(s) for s in size) if isinstance(size, Sequence) else size
        self.scale_factor = (
            tuple(float(s) for s in scale_factor) if isinstance(scale_factor, Sequence) else scale_factor
        )
        self.mode = mode
        self.align_corners = align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(
            x,
            size=self.size,
            scale_factor=self.scale_factor,
            mode=self.mode,
            align_corners=self.align_corners,
            recompute_scale_factor=self.recompute_scale_factor,
        )

    def extra_repr(self) -> str:
        what = f"size={self.size}" if self.size is not None else f"scale_factor={self.scale_factor}"
        return f"{what}, mode={self.mode!r}, align_corners={self.align_corners}"
