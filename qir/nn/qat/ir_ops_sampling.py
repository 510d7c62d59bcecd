"""The IR's ``qat_grid_sample`` / ``qat_roi_align`` / ``qat_anchor_generator`` ops for qir's QAT
GridSample, RoIAlign and AnchorGenerator: readers (module -> op) and builders. How a RoIAlign is
called (one box tensor or a list) is the call's: the reader leaves ``box_list`` False and binding
the call sets it, as it sets an AnchorGenerator's number of feature maps."""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.ops.qat import register_qat_module
from qir.ir.ops.qat_sampling import QATAnchorGenerator, QATGridSample, QATMultiScaleRoIAlign, QATRoIAlign
from qir.nn.qat.anchor_generator import AnchorGenerator
from qir.nn.qat.grid_sample import GridSample
from qir.nn.qat.ir_ops import build_fake_quant, fake_quant_spec
from qir.nn.qat.multi_scale_roi_align import MultiScaleRoIAlign
from qir.nn.qat.roi_align import RoIAlign

__all__: list[str] = []

_FQ = "activation_post_process"


def _read(m: Any) -> QATGridSample:
    apq = m.activation_post_process
    return QATGridSample(
        out_fq=None if apq is None else fake_quant_spec(apq, f"GridSample.{_FQ}"),
        mode=str(m.mode),
        padding_mode=str(m.padding_mode),
        align_corners=bool(m.align_corners),
    )


def _build(op: Any, tensors: dict[str, torch.Tensor]) -> GridSample:
    m = GridSample(op.mode, op.padding_mode, op.align_corners)
    m.activation_post_process = None if op.out_fq is None else build_fake_quant(op.out_fq, tensors, _FQ)
    return m


register_qat_module(QATGridSample, GridSample, _read, _build)


def _read_roi_align(m: Any) -> QATRoIAlign:
    return QATRoIAlign(
        out_fq=fake_quant_spec(m.activation_post_process, f"RoIAlign.{_FQ}"),
        output_size=m.output_size,
        spatial_scale=float(m.spatial_scale),
        sampling_ratio=int(m.sampling_ratio),
        aligned=bool(m.aligned),
    )


def _build_roi_align(op: Any, tensors: dict[str, torch.Tensor]) -> RoIAlign:
    m = RoIAlign(op.output_size, op.spatial_scale, op.sampling_ratio, op.aligned)
    m.activation_post_process = build_fake_quant(op.out_fq, tensors, _FQ)
    return m


register_qat_module(QATRoIAlign, RoIAlign, _read_roi_align, _build_roi_align)


def _read_anchor_generator(m: Any) -> QATAnchorGenerator:
    return QATAnchorGenerator(sizes=m.sizes, aspect_ratios=m.aspect_ratios, num_features=len(m.sizes))


def _build_anchor_generator(op: Any, tensors: dict[str, torch.Tensor]) -> AnchorGenerator:
    return AnchorGenerator(op.sizes, op.aspect_ratios)


register_qat_module(QATAnchorGenerator, AnchorGenerator, _read_anchor_generator, _build_anchor_generator)


def _read_multi_scale(m: Any) -> QATMultiScaleRoIAlign:
    return QATMultiScaleRoIAlign(
        out_fq=fake_quant_spec(m.activation_post_process, f"MultiScaleRoIAlign.{_FQ}"),
        featmap_names=tuple(m.featmap_names),
        output_size=m.output_size,
        sampling_ratio=int(m.sampling_ratio),
        canonical_scale=int(m.canonical_scale),
        canonical_level=int(m.canonical_level),
    )


def _build_multi_scale(op: Any, tensors: dict[str, torch.Tensor]) -> MultiScaleRoIAlign:
    m = MultiScaleRoIAlign(
        list(op.featmap_names),
        op.output_size,
        op.sampling_ratio,
        canonical_scale=op.canonical_scale,
        canonical_level=op.canonical_level,
    )
    m.activation_post_process = build_fake_quant(op.out_fq, tensors, _FQ)
    return m


register_qat_module(QATMultiScaleRoIAlign, MultiScaleRoIAlign, _read_multi_scale, _build_multi_scale)
