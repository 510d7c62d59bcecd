"""``AnchorGenerator``: torchvision's ``models.detection.rpn.AnchorGenerator`` without torchvision.

Anchors depend on the image and feature map *shapes* only, never on their values: per level,
torchvision's rounded cell anchors (one per size and aspect ratio) shifted to every feature cell
by the integer stride ``image size // feature size``. They are float32 (the operator table's
output dtype) whatever the inputs are, float or integer codes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["PLUGIN_ARGUMENTS", "AnchorGenerator", "anchors_for_shapes", "cell_anchors", "image_batch_shape"]


def cell_anchors(sizes: Sequence[float], aspect_ratios: Sequence[float]) -> torch.Tensor:
    """torchvision's ``generate_anchors`` in float32: ``round([-w, -h, w, h] / 2)`` per (ratio, size)."""
    scales = torch.as_tensor(sizes, dtype=torch.float32)
    ratios = torch.as_tensor(aspect_ratios, dtype=torch.float32)
    h_ratios = torch.sqrt(ratios)
    w_ratios = 1 / h_ratios
    ws = (w_ratios[:, None] * scales[None, :]).view(-1)
    hs = (h_ratios[:, None] * scales[None, :]).view(-1)
    return (torch.stack([-ws, -hs, ws, hs], dim=1) / 2).round()


def image_batch_shape(image_list: Any, what: str) -> tuple[int, int, int]:
    """``(number of images, padded H, padded W)`` of torchvision's ``ImageList`` (``.tensors``,
    ``.image_sizes``) or of a batched image tensor (N, C, H, W)."""
    if isinstance(image_list, torch.Tensor):
        if image_list.dim() != 4:
            raise ValueError(f"{what}: images as a tensor must be (N, C, H, W), got {tuple(image_list.shape)}")
        return int(image_list.shape[0]), int(image_list.shape[-2]), int(image_list.shape[-1])
    tensors, sizes = getattr(image_list, "tensors", None), getattr(image_list, "image_sizes", None)
    if not isinstance(tensors, torch.Tensor) or sizes is None:
        raise TypeError(
            f"{what}: image_list must be torchvision's ImageList (.tensors, .image_sizes) or an (N, C, H, W) "
            f"image tensor, got {type(image_list).__name__}"
        )
    return len(sizes), int(tensors.shape[-2]), int(tensors.shape[-1])


def anchors_for_shapes(
    cells: Sequence[torch.Tensor], image_hw: tuple[int, int], grid_sizes: Sequence[tuple[int, int]], n_images: int
) -> list[torch.Tensor]:
    """Per image, the (sum_l H_l * W_l * A_l, 4) float32 anchors of all levels (torchvision's ``grid_anchors``)."""
    if len(cells) != len(grid_sizes):
        raise ValueError(
            f"AnchorGenerator: {len(grid_sizes)} feature maps for {len(cells)} anchor levels (sizes / "
            "aspect_ratios); give one feature map per level"
        )
    per_level = []
    for (gh, gw), base in zip(grid_sizes, cells, strict=True):
        sh, sw = image_hw[0] // gh, image_hw[1] // gw
        shift_y, shift_x = torch.meshgrid(
            torch.arange(0, gh, dtype=torch.int32) * torch.tensor(sh, dtype=torch.int64),
            torch.arange(0, gw, dtype=torch.int32) * torch.tensor(sw, dtype=torch.int64),
            indexing="ij",
        )
        sx, sy = shift_x.reshape(-1), shift_y.reshape(-1)
        shifts = torch.stack((sx, sy, sx, sy), dim=1)
        per_level.append((shifts.view(-1, 1, 4) + base.view(1, -1, 4)).reshape(-1, 4))
    all_levels = torch.cat(per_level)
    return [all_levels.clone() for _ in range(n_images)]


#: the keyword arguments of horizon_plugin_pytorch's own ``AnchorGenerator``, which qir does not implement
PLUGIN_ARGUMENTS = frozenset(
    {
        "feat_strides",
        "scales",
        "ratios",
        "base_sizes",
        "anchor_wh_groups",
        "legacy_bbox",
        "round_anchor",
        "feat_strides_bias",
    }
)

_SIGNATURES = (
    "qir.nn.AnchorGenerator is torchvision's AnchorGenerator(sizes=((128, 256, 512),), aspect_ratios=((0.5, 1.0, "
    "2.0),)), called (images, feature_maps) and returning one (num anchors, 4) tensor per image; "
    "horizon_plugin_pytorch's AnchorGenerator(feat_strides, scales=None, ratios=None, base_sizes=None, "
    "anchor_wh_groups=None, legacy_bbox=False, round_anchor=False, feat_strides_bias=None), called "
    "(feature_maps) and returning (N, A * 4, H, W) anchors per level, is a different module that qir does not provide"
)


def _nested(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(x, (list, tuple)) for x in v)


def _parse(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(sizes, aspect_ratios)`` of a constructor call, refusing calls written for the plugin's
    signature: its keywords, more than two positional arguments, or a flat list first (the
    plugin's ``feat_strides`` or torchvision's one size per level: the same text, two meanings)."""
    plugin = sorted(PLUGIN_ARGUMENTS & set(kwargs))
    if plugin:
        raise TypeError(f"AnchorGenerator got the plugin's argument(s) {', '.join(plugin)}: {_SIGNATURES}")
    unknown = sorted(set(kwargs) - {"sizes", "aspect_ratios"})
    if unknown:
        raise TypeError(f"AnchorGenerator got unexpected argument(s) {', '.join(unknown)}: {_SIGNATURES}")
    if len(args) > 2:
        raise TypeError(f"AnchorGenerator takes at most 2 positional arguments, got {len(args)}: {_SIGNATURES}")
    names = ("sizes", "aspect_ratios")
    for name, value in zip(names, args, strict=False):
        if name in kwargs:
            raise TypeError(f"AnchorGenerator got {name} both by position and by keyword")
        kwargs[name] = value
    if args and not _nested(args[0]):
        raise TypeError(
            f"AnchorGenerator({args[0]!r}, ...) is ambiguous: a flat list first is the plugin's feat_strides or "
            f"torchvision's sizes with one size per level. {_SIGNATURES}. For torchvision's meaning write the "
            f"sizes nested, AnchorGenerator({tuple((s,) for s in args[0])!r}, ...), or by keyword, "
            f"AnchorGenerator(sizes={tuple(args[0])!r}, ...)"
        )
    return kwargs.get("sizes", ((128, 256, 512),)), kwargs.get("aspect_ratios", ((0.5, 1.0, 2.0),))


class AnchorGenerator(nn.Module):
    """``AnchorGenerator(sizes=((128, 256, 512),), aspect_ratios=((0.5, 1.0, 2.0),))(image_list, feature_maps)``.

    ``image_list``: torchvision's ``ImageList`` or the batched image tensor (N, C, H, W) (a graph
    input qir can trace); ``feature_maps``: one (N, C, H_l, W_l) tensor per level. Returns one float32
    (num anchors, 4) tensor per image, as torchvision does.

    The plugin's own ``AnchorGenerator(feat_strides, scales, ratios, ...)`` is another module
    (docs/migration.md): its keywords, and a flat list given as the first positional argument
    (which both signatures accept with different meanings), raise ``TypeError`` naming both.
    Flat sizes by keyword (``sizes=(32, 64)``: one size per level) are torchvision's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        sizes, aspect_ratios = _parse(args, dict(kwargs))
        if not isinstance(sizes[0], (list, tuple)):
            sizes = tuple((s,) for s in sizes)
        if not isinstance(aspect_ratios[0], (list, tuple)):
            aspect_ratios = (aspect_ratios,) * len(sizes)
        self.sizes = tuple(tuple(s) for s in sizes)
        self.aspect_ratios = tuple(tuple(a) for a in aspect_ratios)
        self.cell_anchors = [cell_anchors(s, a) for s, a in zip(self.sizes, self.aspect_ratios, strict=True)]

    def num_anchors_per_location(self) -> list[int]:
        return [len(s) * len(a) for s, a in zip(self.sizes, self.aspect_ratios, strict=True)]

    def forward(self, image_list: Any, feature_maps: list[torch.Tensor]) -> list[torch.Tensor]:
        n, h, w = image_batch_shape(image_list, type(self).__name__)
        grid = [(int(f.shape[-2]), int(f.shape[-1])) for f in feature_maps]
        return anchors_for_shapes(self.cell_anchors, (h, w), grid, n)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, aspect_ratios={self.aspect_ratios}"
