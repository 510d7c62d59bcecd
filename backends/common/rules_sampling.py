"""Op rules of the integer sampling layers: ``qgrid_sample``, ``qroi_align``,
``qmulti_scale_roi_align``, ``qanchor_generator``.

Each rule reads the op's attributes (no sampling layer has integer state) and fixes what the
kernels need for the compiled input size: the grid's fixed-point coordinate parameters, the
level scales of the multi-scale pooling; the kernels (``kernels/sampling.py``) recompute taps
and weights from the codes and boxes at run time. The anchors depend on shapes only: the rule
evaluates the op once on the compiled shapes and stores them as a float32 constant.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common.lower import LowerContext, LoweringError, OpRule, tensor_ref
from backends.common.program import ValueRef
from backends.common.roi_rules import LEVEL_EPS, ROI_BITS, ROI_MEAN_BITS, level_scales
from backends.common.rule_state import layer_path
from backends.common.sampling_rules import GRID_COORD_BITS, grid_axis
from qir.ir.graph import Node

__all__ = ["OP_RULES", "op_qanchor_generator", "op_qgrid_sample", "op_qmulti_scale_roi_align", "op_qroi_align"]


def op_qgrid_sample(ctx: LowerContext, node: Node, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    x, grid = tensor_ref(operands[0], node), tensor_ref(operands[1], node, "grid")
    xv, gv = ctx.values[x], ctx.values[grid]
    if gv.dtype not in (torch.int8, torch.int16):
        raise LoweringError(
            f"node '{node.name}': GridSample '{layer_path(node)}' takes a qint8 / qint16 grid, got {gv.dtype}; "
            "quantize the grid with a QuantStub"
        )
    h, w = int(xv.shape[-2]), int(xv.shape[-1])
    bits = GRID_COORD_BITS
    s_g = float(op.in_scales[1])
    ax, ay = grid_axis(w, s_g, op.align_corners, bits), grid_axis(h, s_g, op.align_corners, bits)
    attrs: dict[str, Any] = {
        "in_size": [h, w],
        "mode": op.mode,
        "padding_mode": op.padding_mode,
        "bits": bits,
        "coord_x": [ax.multiplier, ax.shift, ax.offset],
        "coord_y": [ay.multiplier, ay.shift, ay.offset],
        "out_dtype": str(xv.dtype).replace("torch.int", "qint") if op.mode == "nearest" else op.out.dtype.name,
    }
    if op.mode == "bilinear":
        # the weights' 2**-2B folds into the shift, as for bilinear resize
        attrs["multiplier"], attrs["shift"] = int(op.multiplier), int(op.shift) + 2 * bits
    return ValueRef(ctx.emit("grid_sample", [x, grid], attrs, {}, node.name, layer_path(node)))


def op_qroi_align(ctx: LowerContext, node: Node, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    x = tensor_ref(operands[0], node)
    boxes = [tensor_ref(b, node, "boxes") for b in operands[1:]]
    attrs: dict[str, Any] = {
        "output_size": list(op.output_size),
        "spatial_scale": float(op.spatial_scale),
        "sampling_ratio": int(op.sampling_ratio),
        "aligned": bool(op.aligned),
        "box_list": bool(op.box_list),
        "bits": ROI_BITS,
        "mean_bits": ROI_MEAN_BITS,
        # the mean's 2**-8 folds into the shift
        "multiplier": int(op.multiplier),
        "shift": int(op.shift) + ROI_MEAN_BITS,
        "out_dtype": op.out.dtype.name,
    }
    return ValueRef(ctx.emit("roi_align", [x, *boxes], attrs, {}, node.name, layer_path(node)))


def op_qmulti_scale_roi_align(ctx: LowerContext, node: Node, operands: list[Any]) -> ValueRef:
    """``roi_levels`` (the float level mapper on the run-time boxes) then ``multi_scale_roi_align``;
    the level scales follow from the compiled feature sizes and the op's image shapes, as the
    module infers them."""
    op: Any = node.op
    path = layer_path(node)
    n = len(op.feature_names)
    where = f"node '{node.name}': MultiScaleRoIAlign '{path}'"
    chosen = [
        (i, tensor_ref(v, node, f"x[{k!r}]"))
        for i, (k, v) in enumerate(zip(op.feature_names, operands[:n], strict=True))
        if k in op.featmap_names
    ]
    sizes = [[int(ctx.values[r].shape[-2]), int(ctx.values[r].shape[-1])] for _, r in chosen]
    try:
        scales, k_min, k_max = level_scales(sizes, op.image_shapes, where)
    except ValueError as e:
        raise LoweringError(str(e)) from None
    box_refs = [tensor_ref(b, node, "boxes") for b in operands[n:]]
    levels = ctx.emit(
        "roi_levels",
        box_refs,
        {
            "k_min": k_min,
            "k_max": k_max,
            "canonical_scale": int(op.canonical_scale),
            "canonical_level": int(op.canonical_level),
            "eps": LEVEL_EPS,
        },
        {},
        node.name,
        f"{path}.levels",
    )
    attrs: dict[str, Any] = {
        "output_size": list(op.output_size),
        "sampling_ratio": int(op.sampling_ratio),
        "spatial_scales": scales,
        "feature_sizes": sizes,
        "bits": ROI_BITS,
        "mean_bits": ROI_MEAN_BITS,
        # per level: the mean's 2**-8 folds into the shift
        "multipliers": [int(op.multipliers[i]) for i, _ in chosen],
        "shifts": [int(op.shifts[i]) + ROI_MEAN_BITS for i, _ in chosen],
        "out_dtype": op.out.dtype.name,
    }
    feats = [r for _, r in chosen]
    return ValueRef(ctx.emit("multi_scale_roi_align", [levels, *feats, *box_refs], attrs, {}, node.name, path))


def op_qanchor_generator(ctx: LowerContext, node: Node, operands: list[Any]) -> ValueRef:
    """The anchors for the compiled shapes: the op evaluated once, stored as a float32 constant."""
    op: Any = node.op
    refs = [tensor_ref(v, node, "images" if i == 0 else "feature map") for i, v in enumerate(operands)]
    anchors = op.evaluate(None, [ctx.values[r] for r in refs])
    img = ctx.values[refs[0]]
    shapes = [[int(img.shape[0]), int(img.shape[-2]), int(img.shape[-1])]]
    shapes += [[int(ctx.values[r].shape[-2]), int(ctx.values[r].shape[-1])] for r in refs[1:]]
    const = ctx.const(f"{node.name}.anchors", anchors[0])
    attrs = {"shapes": shapes, "images": len(anchors)}
    return ValueRef(ctx.emit("anchors", refs, attrs, {"anchors": const}, node.name, layer_path(node)))


#: IR op name -> its shared rule (the marches register them: backends/<march>/rules.py)
OP_RULES: dict[str, OpRule] = {
    "qgrid_sample": op_qgrid_sample,
    "qroi_align": op_qroi_align,
    "qmulti_scale_roi_align": op_qmulti_scale_roi_align,
    "qanchor_generator": op_qanchor_generator,
}
