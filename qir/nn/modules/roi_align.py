"""``RoIAlign``: torchvision's ``ops.RoIAlign`` without torchvision (same constructor and call)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["RoIAlign", "roi_align_float"]


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _axis(start: float, roi: float, size: int, pooled: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """Float weight matrix ``(pooled, size)`` of one RoI along one axis (torchvision's sampling)."""
    w = torch.zeros(pooled, size, dtype=dtype)
    for p in range(pooled):
        for i in range(g):
            pos = start + (p + (i + 0.5) / g) * roi / pooled
            if pos < -1.0 or pos > size:
                continue
            pos = max(pos, 0.0)
            lo = int(pos)
            if lo >= size - 1:
                w[p, size - 1] += 1.0
                continue
            w[p, lo] += 1.0 - (pos - lo)
            w[p, lo + 1] += pos - lo
    return w


def roi_align_float(
    x: torch.Tensor,
    boxes: torch.Tensor | Sequence[torch.Tensor],
    output_size: int | Sequence[int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> torch.Tensor:
    """torchvision's ``roi_align`` written out in torch (float64 positions), (K, C, PH, PW)."""
    from backends.common.roi_rules import rois_of

    ph, pw = _pair(output_size)
    rois = rois_of(boxes)
    outs = []
    off = 0.5 if aligned else 0.0
    for r in rois.detach().to(torch.float64).tolist():
        b = int(r[0])
        x1, y1, x2, y2 = (v * spatial_scale - off for v in r[1:])
        rw, rh = x2 - x1, y2 - y1
        if not aligned:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        gh = sampling_ratio if sampling_ratio > 0 else int(torch.tensor(rh / ph).ceil())
        gw = sampling_ratio if sampling_ratio > 0 else int(torch.tensor(rw / pw).ceil())
        wy = _axis(y1, rh, int(x.shape[-2]), ph, max(gh, 0), x.dtype)
        wx = _axis(x1, rw, int(x.shape[-1]), pw, max(gw, 0), x.dtype)
        outs.append(wy @ x[b] @ wx.T / max(gh * gw, 1))
    if not outs:
        return x.new_zeros(0, x.shape[1], ph, pw)
    return torch.stack(outs)


class RoIAlign(nn.Module):
    """``RoIAlign(output_size, spatial_scale, sampling_ratio, aligned=False)(input, boxes)``.

    ``boxes``: a float (K, 5) tensor of ``(batch index, x1, y1, x2, y2)`` or a list of
    (K_i, 4) tensors, one per image, as torchvision takes them.
    """

    def __init__(
        self, output_size: int | Sequence[int], spatial_scale: float, sampling_ratio: int, aligned: bool = False
    ) -> None:
        super().__init__()
        self.output_size = _pair(output_size)
        self.spatial_scale = float(spatial_scale)
        self.sampling_ratio = int(sampling_ratio)
        self.aligned = bool(aligned)

    def forward(self, input: torch.Tensor, boxes: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        return roi_align_float(input, boxes, self.output_size, self.spatial_scale, self.sampling_ratio, self.aligned)

    def extra_repr(self) -> str:
        return (
            f"output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
            f"sampling_ratio={self.sampling_ratio}, aligned={self.aligned}"
        )
