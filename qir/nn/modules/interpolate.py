"""``Interpolate``: ``torch.nn.functional.interpolate`` as a module (the eager replacement)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

    ``forward(x, size=None)``: a ``size`` given at the call (FPN's
    ``size=lateral.shape[2:]``, a run-time value) replaces the module's own size or scale
    factor; a module built with neither must get one at every call. ``prepare_qat_fx``
    generates such modules for ``F.interpolate(x, size=y.shape[2:], mode="bilinear")``.
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
        if size is not None and scale_factor is not None:
            raise ValueError("Interpolate takes size= or scale_factor=, not both")
        if mode == "nearest" and align_corners:
            raise ValueError("Interpolate: align_corners only applies to mode='bilinear'")
        self.size = tuple(int(s) for s in size) if isinstance(size, Sequence) else size
        self.scale_factor = (
            tuple(float(s) for s in scale_factor) if isinstance(scale_factor, Sequence) else scale_factor
        )
        self.mode = mode
        self.align_corners = align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def call_size(self, size: int | Sequence[int] | None) -> tuple[Any, Any]:
        """``(size, scale_factor)`` for one call: the call's run-time ``size`` wins."""
        if size is not None:
            return (int(size) if isinstance(size, int) else tuple(int(s) for s in size)), None
        if self.size is None and self.scale_factor is None:
            raise ValueError(
                "Interpolate was built without size= or scale_factor=: pass the output size at the call, "
                "interpolate(x, size=(h, w)), or build it with one of them"
            )
        return self.size, self.scale_factor

    def forward(self, x: torch.Tensor, size: int | Sequence[int] | None = None) -> torch.Tensor:
        size_, scale_factor = self.call_size(size)
        return F.interpolate(
            x,
            size=size_,
            scale_factor=scale_factor,
            mode=self.mode,
            align_corners=self.align_corners,
            recompute_scale_factor=self.recompute_scale_factor,
        )

    def extra_repr(self) -> str:
        what = (
            f"size={self.size}"
            if self.size is not None
            else f"scale_factor={self.scale_factor}"
            if self.scale_factor is not None
            else "size given at the call"
        )
        return f"{what}, mode={self.mode!r}, align_corners={self.align_corners}"
