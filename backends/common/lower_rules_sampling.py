"""Lowering rules of GridSample, RoIAlign, MultiScaleRoIAlign, AnchorGenerator (imported by ``lower_rules``).

The rule reads the quantized module's scales and fixes the fixed-point coordinate
parameters for the compiled input size; the kernel (``kernels/sampling.py``) recomputes the
taps from the grid codes at run time.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common.lower import LowerContext, LoweringError, RuleNode, register_module_rule, tensor_ref
from backends.common.program import ValueRef
from backends.common.roi_rules import ROI_BITS, ROI_MEAN_BITS
from backends.common.sampling_rules import grid_axis
from qir.nn import quantized as Q
from qir.nn.qat.grid_sample import GRID_COORD_BITS

__all__ = ["lower_anchor_generator", "lower_grid_sample", "lower_multi_scale_roi_align", "lower_roi_align"]

Node = RuleNode


def lower_grid_sample(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x, grid = tensor_ref(args[0], node), tensor_ref(args[1], node, "grid")
    xv, gv = ctx.values[x], ctx.values[grid]
    if gv.is_floating_point() or gv.dtype not in (torch.int8, torch.int16):
        raise LoweringError(
            f"node '{node.name}': GridSample '{node.target}' takes a qint8 / qint16 grid, got "
            f"{gv.dtype}; quantize the grid with a QuantStub"
        )
    h, w = int(xv.shape[-2]), int(xv.shape[-1])
    bits = GRID_COORD_BITS
    s_g = m.per_tensor_input(1)
    ax, ay = grid_axis(w, s_g, m.align_corners, bits), grid_axis(h, s_g, m.align_corners, bits)
    attrs: dict[str, Any] = {
        "in_size": [h, w],
        "mode": m.mode,
        "padding_mode": m.padding_mode,
        "bits": bits,
        "coord_x": [ax.multiplier, ax.shift, ax.offset],
        "coord_y": [ay.multiplier, ay.shift, ay.offset],
        "out_dtype": str(xv.dtype).replace("torch.int", "qint") if m.mode == "nearest" else m.dtype.name,
    }
    if m.mode == "bilinear":
        # the weights' 2**-2B folds into the shift, as for bilinear resize
        attrs["multiplier"], attrs["shift"] = int(m.multiplier), int(m.shift) + 2 * bits
    return ValueRef(ctx.emit("grid_sample", [x, grid], attrs, {}, node.name, str(node.target)))


register_module_rule(Q.GridSample, lower_grid_sample)


def lower_roi_align(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    boxes = args[1] if len(args) > 1 else kwargs.get("boxes")
    if isinstance(boxes, (list, tuple)):
        box_list, names = True, [tensor_ref(b, node, "boxes") for b in boxes]
    else:
        box_list, names = False, [tensor_ref(boxes, node, "boxes")]
    attrs: dict[str, Any] = {
        "output_size": list(m.output_size),
        "spatial_scale": float(m.spatial_scale),
        "sampling_ratio": int(m.sampling_ratio),
        "aligned": bool(m.aligned),
        "box_list": box_list,
        "bits": ROI_BITS,
        "mean_bits": ROI_MEAN_BITS,
        # the mean's 2**-8 folds into the shift
        "multiplier": int(m.multiplier),
        "shift": int(m.shift) + ROI_MEAN_BITS,
        "out_dtype": m.dtype.name,
    }
    return ValueRef(ctx.emit("roi_align", [x, *names], attrs, {}, node.name, str(node.target)))


register_module_rule(Q.RoIAlign, lower_roi_align)


def lower_multi_scale_roi_align(
    ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]
) -> ValueRef:
    """``roi_levels`` (float level mapper on the run-time boxes) then ``multi_scale_roi_align``; level
    scales are inferred here from the compiled feature and image sizes, as the module infers them."""
    from qir.nn.modules.multi_scale_roi_align import LEVEL_EPS, level_scales

    call = dict(zip(("x", "boxes", "image_shapes"), args, strict=False)) | kwargs
    x, boxes, shapes = call.get("x"), call.get("boxes"), call.get("image_shapes")
    where = f"node '{node.name}': MultiScaleRoIAlign '{node.target}'"
    if not isinstance(x, dict) or not isinstance(boxes, (list, tuple)):
        raise LoweringError(f"{where} takes a dict of feature maps and a list of (K_i, 4) box tensors")
    if not isinstance(shapes, (list, tuple)) or not all(
        isinstance(s, (list, tuple)) and all(isinstance(v, int) for v in s) for s in shapes
    ):
        raise LoweringError(
            f"{where}: image_shapes must be constant (height, width) pairs to compile (the level scales are fixed "
            f"for the compiled size); got {shapes!r:.80}"
        )
    chosen = [(i, tensor_ref(v, node, f"x[{k!r}]")) for i, (k, v) in enumerate(x.items()) if k in m.featmap_names]
    sizes = [[int(ctx.values[r].shape[-2]), int(ctx.values[r].shape[-1])] for _, r in chosen]
    scales, k_min, k_max = level_scales(sizes, shapes, where)
    box_refs = [tensor_ref(b, node, "boxes") for b in boxes]
    levels = ctx.emit(
        "roi_levels",
        box_refs,
        {
            "k_min": k_min,
            "k_max": k_max,
            "canonical_scale": int(m.canonical_scale),
            "canonical_level": int(m.canonical_level),
            "eps": LEVEL_EPS,
        },
        {},
        node.name,
        f"{node.target}.levels",
    )
    attrs: dict[str, Any] = {
        "output_size": list(m.output_size),
        "sampling_ratio": int(m.sampling_ratio),
        "spatial_scales": scales,
        "feature_sizes": sizes,
        "bits": ROI_BITS,
        "mean_bits": ROI_MEAN_BITS,
        # per level: the mean's 2**-8 folds into the shift
        "multipliers": [int(m.multipliers[i]) for i, _ in chosen],
        "shifts": [int(m.shifts[i]) + ROI_MEAN_BITS for i, _ in chosen],
        "out_dtype": m.dtype.name,
    }
    feats = [r for _, r in chosen]
    return ValueRef(
        ctx.emit("multi_scale_roi_align", [levels, *feats, *box_refs], attrs, {}, node.name, str(node.target))
    )


register_module_rule(Q.MultiScaleRoIAlign, lower_multi_scale_roi_align)


def lower_anchor_generator(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    """The anchors for the compiled shapes, computed here once and stored as a float32 constant."""
    call = dict(zip(("image_list", "feature_maps"), args, strict=False)) | kwargs
    images, feats = call.get("image_list"), call.get("feature_maps")
    where = f"node '{node.name}': AnchorGenerator '{node.target}'"
    if not isinstance(images, ValueRef) or not isinstance(feats, (list, tuple)):
        raise LoweringError(
            f"{where} compiles with the batched image tensor (N, C, H, W) and a list of feature maps; an ImageList "
            "is not a graph value: pass its .tensors"
        )
    refs = [images.name, *(tensor_ref(f, node, "feature map") for f in feats)]
    anchors = m(ctx.values[images.name], [ctx.values[r] for r in refs[1:]])
    img = ctx.values[images.name]
    shapes = [[int(img.shape[0]), int(img.shape[-2]), int(img.shape[-1])]]
    shapes += [[int(ctx.values[r].shape[-2]), int(ctx.values[r].shape[-1])] for r in refs[1:]]
    const = ctx.const(f"{node.name}.anchors", anchors[0])
    attrs = {"shapes": shapes, "images": len(anchors)}
    return ValueRef(ctx.emit("anchors", refs, attrs, {"anchors": const}, node.name, str(node.target)))


register_module_rule(Q.AnchorGenerator, lower_anchor_generator)
