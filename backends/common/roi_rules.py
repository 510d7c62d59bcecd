"""Integer rules of RoIAlign (docs/semantics.md, "RoIAlign").

Box corners become fixed point with ``B = 12`` fraction bits (one rounding of the float box
times ``spatial_scale``); every sampling position, tap and weight after that is integer
arithmetic, shared by the QAT module (which divides the integer weights by ``2**B``) and the
integer module. Sampling follows torchvision's ``roi_align``: per bin ``g_h x g_w`` points at
``start + (p + (i + 1/2) / g) * roi / P``, bilinear with torchvision's edge rules, averaged.

Bilinear sampling is separable, so per RoI and axis the samples of each output bin sum into
a weight matrix ``W (P, L)`` and ``acc = W_y @ q @ W_x^T``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "LEVEL_EPS",
    "ROI_BITS",
    "ROI_MEAN_BITS",
    "axis_weights",
    "div_half_up",
    "level_scales",
    "rois_of",
]

#: fraction bits of box corners, sampling positions and bilinear weights
ROI_BITS = 12
#: fraction bits the exact mean keeps before the output requantization
ROI_MEAN_BITS = 8

#: torchvision's LevelMapper epsilon
LEVEL_EPS = 1e-6


def _infer_scale(size: Sequence[int], original: Sequence[int]) -> float:
    # torchvision: 2 ** round(log2(float32(feature / image))), from the first (height) axis
    approx = float(size[0]) / float(original[0])
    return 2.0 ** float(torch.tensor(approx).log2().round())


def level_scales(
    sizes: Sequence[Sequence[int]], image_shapes: Sequence[Sequence[int]], what: str = "MultiScaleRoIAlign"
) -> tuple[list[float], int, int]:
    """``(scales, k_min, k_max)`` from the features' (H, W) and the images' (H, W), as torchvision sets them up."""
    if not image_shapes:
        raise ValueError(f"{what}: image_shapes must list the (height, width) of every image; got an empty list")
    original = (max(int(s[0]) for s in image_shapes), max(int(s[1]) for s in image_shapes))
    scales = [_infer_scale(s, original) for s in sizes]
    lvl_min = -torch.log2(torch.tensor(scales[0], dtype=torch.float32)).item()
    lvl_max = -torch.log2(torch.tensor(scales[-1], dtype=torch.float32)).item()
    return scales, int(lvl_min), int(lvl_max)


def rois_of(boxes: torch.Tensor | Sequence[torch.Tensor], what: str = "RoIAlign") -> torch.Tensor:
    """torchvision's two box forms as one float (K, 5) tensor ``(batch index, x1, y1, x2, y2)``."""
    if isinstance(boxes, torch.Tensor):
        if boxes.dim() != 2 or boxes.shape[1] != 5:
            raise ValueError(
                f"{what}: boxes as a tensor must be (K, 5) (batch index, x1, y1, x2, y2), got "
                f"{tuple(boxes.shape)}; or pass a list of (K_i, 4) tensors, one per image"
            )
        return boxes
    parts = []
    for i, b in enumerate(boxes):
        if b.dim() != 2 or b.shape[1] != 4:
            raise ValueError(f"{what}: boxes[{i}] must be (K_i, 4) (x1, y1, x2, y2), got {tuple(b.shape)}")
        parts.append(torch.cat([torch.full_like(b[:, :1], float(i)), b], dim=1))
    return torch.cat(parts) if parts else torch.zeros(0, 5)


def div_half_up(num: torch.Tensor | int, den: int) -> torch.Tensor | int:
    """``round_half_up(num / den)`` exactly, for ``den > 0``."""
    return (2 * num + den) // (2 * den)


def axis_weights(
    b0: int, b1: int, size: int, pooled: int, sampling_ratio: int, aligned: bool
) -> tuple[torch.Tensor, int]:
    """Integer weight matrix ``(pooled, size)`` of one RoI along one axis, and its samples per bin.

    Entry ``[p, j]`` sums the weights (at ``2**-B``) the bin ``p``'s samples give input index ``j``.
    """
    one = 1 << ROI_BITS
    start = b0 - (one >> 1 if aligned else 0)
    roi = b1 - b0
    if not aligned:
        roi = max(roi, one)  # torchvision's minimum RoI size of one pixel
    g = sampling_ratio if sampling_ratio > 0 else -((-roi) // (pooled * one))  # ceil(roi / pooled)
    w = torch.zeros(pooled, size, dtype=torch.int64)
    if g <= 0:
        return w, 0
    for p in range(pooled):
        for i in range(g):
            pos = start + int(div_half_up(roi * (2 * p * g + 2 * i + 1), 2 * pooled * g))
            if pos < -one or pos > size * one:  # torchvision: the sample is outside, contributes 0
                continue
            pos = max(pos, 0)
            lo = pos >> ROI_BITS
            if lo >= size - 1:
                w[p, size - 1] += one
                continue
            frac = pos - (lo << ROI_BITS)
            w[p, lo] += one - frac
            w[p, lo + 1] += frac
    return w, g
