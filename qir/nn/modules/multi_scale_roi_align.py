"""``MultiScaleRoIAlign``: torchvision's ``ops.MultiScaleRoIAlign`` without torchvision (same constructor and call).

Each box is pooled from one feature level, chosen by torchvision's level mapper (FPN paper eq. 1)
on the float box: ``k = clamp(floor(k0 + log2(sqrt(area) / s0) + 1e-6), k_min, k_max)``. Level
scales are inferred from the feature size against the largest image size, rounded to a power
of two, as torchvision infers them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from backends.common.roi_rules import LEVEL_EPS, level_scales
from qir.nn.modules.roi_align import roi_align_float

__all__ = ["LEVEL_EPS", "MultiScaleRoIAlign", "level_scales", "map_levels", "selected_features"]


def selected_features(x: dict[str, torch.Tensor], featmap_names: Sequence[str], what: str) -> list[torch.Tensor]:
    """The feature maps named in ``featmap_names``, in the dict's order (torchvision's ``_filter_input``)."""
    if not isinstance(x, dict):
        raise TypeError(f"{what}: x must be a dict of feature maps (name -> tensor), got {type(x).__name__}")
    out = [v for k, v in x.items() if k in featmap_names]
    if not out:
        raise ValueError(f"{what}: none of featmap_names {list(featmap_names)} is in x (keys {list(x)})")
    return out


def map_levels(
    boxes: Sequence[torch.Tensor], k_min: int, k_max: int, canonical_scale: int, canonical_level: int
) -> torch.Tensor:
    """Level index (0 = ``k_min``) of every box, int64, in torchvision's float arithmetic and dtype."""
    cat = torch.cat([b for b in boxes]) if boxes else torch.zeros(0, 4)
    area = (cat[:, 2] - cat[:, 0]) * (cat[:, 3] - cat[:, 1])
    s = torch.sqrt(area)
    lvl = torch.floor(canonical_level + torch.log2(s / canonical_scale) + torch.tensor(LEVEL_EPS, dtype=s.dtype))
    lvl = torch.clamp(lvl, min=k_min, max=k_max)
    return lvl.to(torch.int64) - k_min


class MultiScaleRoIAlign(nn.Module):
    """``MultiScaleRoIAlign(featmap_names, output_size, sampling_ratio, *, canonical_scale=224,
    canonical_level=4)(x, boxes, image_shapes)``.

    ``x``: dict of (N, C, H_l, W_l) feature maps; ``boxes``: list of (K_i, 4) float boxes
    ``(x1, y1, x2, y2)`` in image pixels, one per image; ``image_shapes``: list of (H, W).
    Scales are inferred at every call (torchvision caches them from its first call; the two
    agree whenever the sizes do not change, as a deployed model requires).
    """

    def __init__(
        self,
        featmap_names: list[str],
        output_size: int | Sequence[int],
        sampling_ratio: int,
        *,
        canonical_scale: int = 224,
        canonical_level: int = 4,
    ) -> None:
        super().__init__()
        self.featmap_names = list(featmap_names)
        self.output_size = (
            (int(output_size), int(output_size))
            if isinstance(output_size, int)
            else (int(output_size[0]), int(output_size[1]))
        )
        self.sampling_ratio = int(sampling_ratio)
        self.canonical_scale = canonical_scale
        self.canonical_level = canonical_level

    def forward(
        self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor], image_shapes: list[tuple[int, int]]
    ) -> torch.Tensor:
        from backends.common.roi_rules import rois_of

        feats = selected_features(x, self.featmap_names, type(self).__name__)
        scales, k_min, k_max = level_scales([tuple(f.shape[-2:]) for f in feats], image_shapes, type(self).__name__)
        rois = rois_of(boxes, type(self).__name__)
        levels = map_levels(boxes, k_min, k_max, self.canonical_scale, self.canonical_level)
        out = feats[0].new_zeros(int(rois.shape[0]), int(feats[0].shape[1]), *self.output_size)
        for lvl, (f, s) in enumerate(zip(feats, scales, strict=False)):
            idx = torch.where(levels == lvl)[0]
            if idx.numel():
                out[idx] = roi_align_float(f, rois[idx], self.output_size, s, self.sampling_ratio, False).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (
            f"featmap_names={self.featmap_names}, output_size={self.output_size}, "
            f"sampling_ratio={self.sampling_ratio}, canonical_scale={self.canonical_scale}, "
            f"canonical_level={self.canonical_level}"
        )
