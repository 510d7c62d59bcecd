"""QAT MultiScaleRoIAlign: each level pooled with QAT RoIAlign's rule, rows placed by level, one output fake quant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from qir.nn.modules.multi_scale_roi_align import MultiScaleRoIAlign as FloatMultiScaleRoIAlign
from qir.nn.modules.multi_scale_roi_align import level_scales, map_levels, selected_features
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.qconfig import QConfig

__all__ = ["LevelRoIAlign", "MultiScaleRoIAlign", "level_rows"]


@dataclass(frozen=True)
class LevelRoIAlign:
    """One level's RoIAlign fields, as ``roi_sample`` reads them (torchvision's multi-scale pooling is unaligned)."""

    output_size: tuple[int, int]
    spatial_scale: float
    sampling_ratio: int
    aligned: bool = False


def level_rows(
    m: Any, x: dict[str, torch.Tensor], boxes: list[torch.Tensor], image_shapes: list[tuple[int, int]]
) -> tuple[list[torch.Tensor], torch.Tensor, list[tuple[torch.Tensor, LevelRoIAlign]]]:
    """``(features, rois, per level (row indices, RoIAlign fields))`` of a multi-scale module ``m``."""
    from backends.common.kernels.data_checks import check_finite
    from backends.common.roi_rules import rois_of

    what = type(m).__name__
    feats = selected_features(x, m.featmap_names, what)
    scales, k_min, k_max = level_scales([tuple(f.shape[-2:]) for f in feats], image_shapes, what)
    rois = rois_of(boxes, what)
    check_finite(what, "the box coordinates", rois[:, 1:])  # a NaN box's level would match no level
    levels = map_levels(boxes, k_min, k_max, m.canonical_scale, m.canonical_level)
    per_level = [
        (torch.where(levels == lvl)[0], LevelRoIAlign(m.output_size, s, m.sampling_ratio))
        for lvl, s in enumerate(scales)
    ]
    return feats, rois, per_level


class MultiScaleRoIAlign(QATModule, FloatMultiScaleRoIAlign):
    """``fq(pooled rows)``: each row sampled from its level with the integer rule's positions and weights."""

    _FLOAT_MODULE: ClassVar[type[nn.Module]] = FloatMultiScaleRoIAlign
    #: the boxes stay float at every stage (convert_fx lets them in unquantized)
    float_inputs: ClassVar[tuple[int, ...]] = (1,)

    def forward(
        self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor], image_shapes: list[tuple[int, int]]
    ) -> torch.Tensor:
        from backends.common.roi_rules import ROI_BITS
        from qir.nn.qat.roi_align import roi_sample

        feats, rois, per_level = level_rows(self, x, boxes, image_shapes)
        ph, pw = self.output_size
        f0 = feats[0]
        y = f0.new_zeros(int(rois.shape[0]), int(f0.shape[1]), ph, pw)
        scale = 2.0 ** (2 * ROI_BITS)
        for f, (idx, fields) in zip(feats, per_level, strict=True):
            if not idx.numel():
                continue
            rows = [
                (wy.to(f.dtype) @ f[b] @ wx.to(f.dtype).T) / (scale * count)
                for wy, wx, b, count in roi_sample(f, rois[idx], fields, type(self).__name__)
            ]
            y = y.index_copy(0, idx, torch.stack(rows).to(y.dtype))
        assert self.activation_post_process is not None
        return self.activation_post_process(y)

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> MultiScaleRoIAlign:
        """From ``qir.nn.MultiScaleRoIAlign`` or ``torchvision.ops.MultiScaleRoIAlign`` (same fields)."""
        names = ("featmap_names", "output_size", "sampling_ratio", "canonical_scale", "canonical_level")
        if not all(hasattr(mod, n) for n in names):
            raise TypeError(
                "MultiScaleRoIAlign.from_float takes qir.nn.MultiScaleRoIAlign or "
                f"torchvision.ops.MultiScaleRoIAlign, got {type(mod).__name__}"
            )
        new = cls(
            list(mod.featmap_names),  # type: ignore[arg-type]
            tuple(mod.output_size),  # type: ignore[arg-type]
            int(mod.sampling_ratio),  # type: ignore[arg-type]
            canonical_scale=mod.canonical_scale,  # type: ignore[arg-type]
            canonical_level=mod.canonical_level,  # type: ignore[arg-type]
        )
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        new.activation_post_process = make_activation_fq(qc, cls.__name__, required=True)
        new.train(mod.training)
        return new
