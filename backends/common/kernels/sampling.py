"""Grid-sample and RoIAlign kernels on codes.

Grid sample: fixed-point source coordinates from the grid codes, integer
bilinear (or nearest) taps, exact int64 sum, one requantization.

Coordinate parameters (multiplier, shift, offset per axis) are computed at lowering for the
compiled input size; the module library's rule is ``backends.common.sampling_rules``.

RoIAlign: box corners to ``2**-12`` (half up), sampling positions by exact integer division,
torchvision's edge rules, per bin an exact int64 sum of tap products, the exact rounded mean
at ``2**-8`` of the input scale, one requantization. The module library's rule is
``backends.common.roi_rules``; this is a second, per-sample implementation of it.

MultiScaleRoIAlign: ``roi_levels`` maps each float box to its level at run time (float math,
as torchvision's LevelMapper); ``multi_scale_roi_align`` gathers each level's rows, pools them
with the RoIAlign kernel's integer rule and requantizes them to the one output scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel, requant_i64, sat_to
from backends.common.kernels.data_checks import DataError, check_finite, check_index, check_rois
from backends.common.kernels.infer import ShapeError, code, meta, tensor_arg
from backends.common.kernels.schema import (
    MAX_COUNT,
    MAX_EXTENT,
    MULT,
    MULT_OPT,
    OUT_DTYPE,
    SHIFT,
    SHIFT_OPT,
    Attr,
    KernelSchema,
    boolean,
    floating,
    integer,
    ints,
    one_of,
)
from backends.common.program import Instruction

_ROI_ATTRS = {
    "output_size": ints(1, MAX_EXTENT, 2),
    "sampling_ratio": integer(-1, 64),
    "bits": integer(0, 30),
    "mean_bits": integer(0, 30),
    "out_dtype": OUT_DTYPE,
}


def _scales_check(v: Any) -> str | None:
    ok = isinstance(v, list) and 1 <= len(v) <= 64
    ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 1e-6 <= x <= 1e6 for x in v)
    return None if ok else "must be 1 to 64 numbers in [1e-06, 1e6]"


def _sizes_check(v: Any) -> str | None:
    ok = isinstance(v, list) and 1 <= len(v) <= 64
    ok = ok and all(
        isinstance(s, list) and len(s) == 2 and all(isinstance(d, int) and 1 <= d <= MAX_COUNT for d in s) for s in v
    )
    return None if ok else f"must be 1 to 64 [H, W] pairs of integers in [1, {MAX_COUNT}]"


def _levels_match(inst: Instruction, consts: Mapping[str, torch.Tensor] | None) -> str | None:
    a = inst.attrs
    n = len(a["spatial_scales"])
    if not len(a["feature_sizes"]) == len(a["multipliers"]) == len(a["shifts"]) == n:
        return "spatial_scales, feature_sizes, multipliers and shifts must have one entry per level"
    if len(inst.inputs) < 1 + n:
        return f"takes the levels, then {n} feature map(s), then the boxes; got {len(inst.inputs)} input(s)"
    return None


def _grid_sample_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    a = inst.attrs
    x, grid = tensor_arg(args, 0, "input", rank=(4, 4)), tensor_arg(args, 1, "grid", rank=(4, 4))
    h, w = (int(v) for v in a["in_size"])
    if (int(x.shape[-2]), int(x.shape[-1])) != (h, w):
        raise ShapeError(f"compiled for input size {h}x{w}, the input is {list(x.shape)}")
    if grid.shape[0] != x.shape[0] or grid.shape[-1] < 2:
        raise ShapeError(f"a grid of shape {list(grid.shape)} for an input of shape {list(x.shape)}: (N, Ho, Wo, 2)")
    if a["mode"] == "nearest" and int(a["bits"]) < 1:
        raise ShapeError("nearest sampling needs at least 1 fraction bit")
    if a["mode"] != "nearest" and (a.get("multiplier") is None or a.get("shift") is None):
        raise ShapeError("bilinear sampling needs multiplier and shift")
    return [code((x.shape[0], x.shape[1], grid.shape[1], grid.shape[2]), a["out_dtype"])]


def _boxes(args: list[Any], first: int) -> int:
    """The number of (K_i, 4) float boxes in ``args[first:]``."""
    n = 0
    for i in range(first, len(args)):
        b = tensor_arg(args, i, "boxes", rank=(2, 2))
        if b.shape[1] != 4 or not b.is_floating_point():
            raise ShapeError(f"input {i}: boxes must be (K, 4) floats, got {list(b.shape)} {b.dtype}")
        n += int(b.shape[0])
    return n


def _roi_align_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    a = inst.attrs
    x = tensor_arg(args, 0, "input", rank=(4, 4))
    if a["box_list"]:
        k = _boxes(args, 1)
    else:
        rois = tensor_arg(args, 1, "rois", rank=(2, 2))
        if len(args) != 2 or rois.shape[1] != 5 or not rois.is_floating_point():
            raise ShapeError(f"rois must be one (K, 5) float tensor, got {list(rois.shape)} {rois.dtype}")
        k = int(rois.shape[0])
    ph, pw = (int(v) for v in a["output_size"])
    return [code((k, x.shape[1], ph, pw), a["out_dtype"])]


def _roi_levels_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    if int(inst.attrs["k_min"]) > int(inst.attrs["k_max"]):
        raise ShapeError(f"k_min {inst.attrs['k_min']} is above k_max {inst.attrs['k_max']}")
    return [meta((_boxes(args, 0),), torch.int64)]


def _multi_scale_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    a = inst.attrs
    n_lvl = len(a["spatial_scales"])
    levels = tensor_arg(args, 0, "levels", rank=(1, 1))
    feats = [tensor_arg(args, 1 + i, f"level {i}", rank=(4, 4)) for i in range(n_lvl)]
    for i, (f, size) in enumerate(zip(feats, a["feature_sizes"], strict=True)):
        if [int(f.shape[-2]), int(f.shape[-1])] != [int(v) for v in size] or f.shape[1] != feats[0].shape[1]:
            raise ShapeError(f"level {i} has shape {list(f.shape)}, compiled for {size} and one channel count")
    k = _boxes(args, 1 + n_lvl)
    if levels.shape[0] != k:
        raise ShapeError(f"{levels.shape[0]} level indices for {k} boxes")
    ph, pw = (int(v) for v in a["output_size"])
    return [code((k, feats[0].shape[1], ph, pw), a["out_dtype"])]


def _coords(g: torch.Tensor, m: int, s: int, off: int) -> torch.Tensor:
    """``round(g * m / 2**s) + off`` (half up), int64."""
    v = g.to(torch.int64) * m
    return (torch.bitwise_right_shift(v + (1 << s >> 1), s) if s else v) + off


def _axis(
    fx: torch.Tensor, size: int, bits: int, nearest: bool, border: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per tap: clamped index and weight (0 where the tap falls off the input)."""
    if border:
        fx = torch.clamp(fx, min=0, max=(size - 1) * (1 << bits))
    if nearest:
        idx = torch.div(fx + (1 << (bits - 1)), 1 << bits, rounding_mode="floor")
        inside = (idx >= 0) & (idx <= size - 1)
        return [(idx.clamp(0, size - 1), inside.long())]
    lo = torch.div(fx, 1 << bits, rounding_mode="floor")
    frac = fx - lo * (1 << bits)
    taps = []
    for idx, wt in ((lo, (1 << bits) - frac), (lo + 1, frac)):
        inside = (idx >= 0) & (idx <= size - 1)
        taps.append((idx.clamp(0, size - 1), wt * inside.long()))
    return taps


@register_kernel(
    "grid_sample",
    schema=KernelSchema(
        inputs=(2, 2),
        attrs={
            "in_size": ints(1, MAX_COUNT, 2),
            "bits": integer(0, 30),
            "mode": one_of("bilinear", "nearest"),
            "padding_mode": one_of("zeros", "border"),
            "coord_x": ints(-(2**62), 2**62, 3),
            "coord_y": ints(-(2**62), 2**62, 3),
            "out_dtype": OUT_DTYPE,
            "multiplier": MULT_OPT,
            "shift": SHIFT_OPT,
            "align_corners": boolean(required=False),
        },
        shape=_grid_sample_shape,
    ),
)
def grid_sample(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    x, grid = args
    a = inst.attrs
    h, w = (int(v) for v in a["in_size"])
    if (int(x.shape[-2]), int(x.shape[-1])) != (h, w):
        raise ValueError(
            f"grid_sample ({inst.source}): compiled for input size {h}x{w}, got {x.shape[-2]}x{x.shape[-1]}"
        )
    bits, nearest, border = int(a["bits"]), a["mode"] == "nearest", a["padding_mode"] == "border"
    mx, sx, ox = (int(v) for v in a["coord_x"])
    my, sy, oy = (int(v) for v in a["coord_y"])
    tx = _axis(_coords(grid[..., 0], mx, sx, ox), w, bits, nearest, border)
    ty = _axis(_coords(grid[..., 1], my, sy, oy), h, bits, nearest, border)
    n, c = int(x.shape[0]), int(x.shape[1])
    q = x.to(torch.int64)
    batch = torch.arange(n).reshape(n, 1, 1)
    acc = torch.zeros(n, c, int(grid.shape[1]), int(grid.shape[2]), dtype=torch.int64)
    for iy, wy in ty:
        for ix, wx in tx:
            # advanced indexing: (N, Ho, Wo) picks, channels last -> (N, C, Ho, Wo)
            picked = q.permute(0, 2, 3, 1)[batch, iy, ix].permute(0, 3, 1, 2)
            acc += picked * (wy * wx).unsqueeze(1)
    dt = str(a["out_dtype"])
    if nearest:
        return [sat_to(acc, dt)]
    out = requant_i64(acc, torch.tensor(int(a["multiplier"])), torch.tensor(int(a["shift"])), None)
    lo, hi = qbounds(dt)
    return [sat_to(out.clamp_(lo, hi), dt)]


def _roi_axis(
    b0: int, b1: int, size: int, pooled: int, ratio: int, aligned: bool, bits: int
) -> tuple[list[list[tuple[int, int]]], int]:
    """Per bin, the ``(index, weight)`` taps of its samples along one axis, and samples per bin."""
    one = 1 << bits
    start = b0 - (one // 2 if aligned else 0)
    roi = b1 - b0 if aligned else max(b1 - b0, one)
    g = ratio if ratio > 0 else -((-roi) // (pooled * one))
    bins: list[list[tuple[int, int]]] = [[] for _ in range(pooled)]
    for p in range(max(pooled, 0)):
        for i in range(max(g, 0)):
            num, den = roi * (2 * p * g + 2 * i + 1), 2 * pooled * g
            pos = start + (2 * num + den) // (2 * den)
            if pos < -one or pos > size * one:
                continue
            pos = max(pos, 0)
            lo = pos // one
            if lo >= size - 1:
                bins[p].append((size - 1, one))
            else:
                bins[p] += [(lo, one - (pos - lo * one)), (lo + 1, pos - lo * one)]
    return bins, max(g, 0)


def _rois(boxes: list[torch.Tensor]) -> torch.Tensor:
    """A list of (K_i, 4) boxes as one (K, 5) tensor ``(batch index, x1, y1, x2, y2)``."""
    parts = [torch.cat([torch.full_like(b[:, :1], float(i)), b], 1) for i, b in enumerate(boxes)]
    return torch.cat(parts) if parts else torch.zeros(0, 5)


def _roi_means(
    x: torch.Tensor, rois: torch.Tensor, a: Mapping[str, Any], spatial_scale: float, aligned: bool, kernel: str
) -> torch.Tensor:
    """Per RoI and output bin: exact int64 sum of tap products, exact rounded mean at ``2**-mean_bits``."""
    if rois.dim() != 2 or rois.shape[-1] != 5:
        raise DataError(f"{kernel}: the boxes must be (K, 5) rows (batch, x1, y1, x2, y2), got {list(rois.shape)}")
    bits, mean_bits = int(a["bits"]), int(a["mean_bits"])
    ph, pw = (int(v) for v in a["output_size"])
    h, w = int(x.shape[-2]), int(x.shape[-1])
    fixed = check_rois(kernel, rois, spatial_scale, int(x.shape[0]), (h, w), int(a["sampling_ratio"]), bits)
    q = x.to(torch.int64)
    out = torch.zeros(int(rois.shape[0]), int(x.shape[1]), ph, pw, dtype=torch.int64)
    for k, (r, b) in enumerate(zip(fixed.tolist(), rois[:, 0].tolist(), strict=True)):
        ybins, gh = _roi_axis(r[1], r[3], h, ph, int(a["sampling_ratio"]), aligned, bits)
        xbins, gw = _roi_axis(r[0], r[2], w, pw, int(a["sampling_ratio"]), aligned, bits)
        den = max(gh * gw, 1) << (2 * bits - mean_bits)
        img = q[int(b)]
        for i, ytaps in enumerate(ybins):
            for j, xtaps in enumerate(xbins):
                acc = torch.zeros(int(x.shape[1]), dtype=torch.int64)
                for yi, wy in ytaps:
                    for xi, wx in xtaps:
                        acc += img[:, yi, xi] * (wy * wx)
                out[k, :, i, j] = torch.div(2 * acc + den, 2 * den, rounding_mode="floor")
    return out


def _requant_sat(acc: torch.Tensor, multiplier: int, shift: int, dt: str) -> torch.Tensor:
    res = requant_i64(acc, torch.tensor(multiplier), torch.tensor(shift), None)
    lo, hi = qbounds(dt)
    return sat_to(res.clamp_(lo, hi), dt)


@register_kernel(
    "roi_align",
    schema=KernelSchema(
        inputs=(2, 1025),
        attrs={
            **_ROI_ATTRS,
            "spatial_scale": floating(1e-6, 1e6),
            "aligned": boolean(),
            "box_list": boolean(),
            "multiplier": MULT,
            "shift": SHIFT,
        },
        shape=_roi_align_shape,
    ),
)
def roi_align(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """Per RoI and output bin: exact int64 sum of tap products, exact rounded mean, one requantization."""
    a = inst.attrs
    x = args[0]
    rois = _rois(list(args[1:])) if a["box_list"] else args[1]
    out = _roi_means(x, rois, a, float(a["spatial_scale"]), bool(a["aligned"]), "roi_align")
    return [_requant_sat(out, int(a["multiplier"]), int(a["shift"]), str(a["out_dtype"]))]


@register_kernel(
    "roi_levels",
    schema=KernelSchema(
        inputs=(0, 1024),
        attrs={
            "k_min": integer(0, 64),
            "k_max": integer(0, 64),
            "canonical_scale": integer(1, 2**20),
            "canonical_level": integer(0, 64),
            "eps": floating(0.0, 1.0),
        },
        shape=_roi_levels_shape,
    ),
)
def roi_levels(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """Level index of every box at run time, in float on the float boxes (torchvision's LevelMapper, FPN eq. 1)."""
    a = inst.attrs
    cat = torch.cat(list(args)) if args else torch.zeros(0, 4)
    check_finite("roi_levels", "the box coordinates", cat)  # a NaN level would match no level
    s = torch.sqrt((cat[:, 2] - cat[:, 0]) * (cat[:, 3] - cat[:, 1]))
    eps = torch.tensor(float(a["eps"]), dtype=s.dtype)
    lvl = torch.floor(int(a["canonical_level"]) + torch.log2(s / int(a["canonical_scale"])) + eps)
    k_min, k_max = int(a["k_min"]), int(a["k_max"])
    return [torch.clamp(lvl, min=k_min, max=k_max).to(torch.int64) - k_min]


@register_kernel(
    "multi_scale_roi_align",
    schema=KernelSchema(
        inputs=(1, 2048),
        attrs={
            **_ROI_ATTRS,
            "spatial_scales": Attr(_scales_check, "list of positive numbers"),
            "feature_sizes": Attr(_sizes_check, "list of [H, W]"),
            "multipliers": ints(-(2**32), 2**32, (1, 64)),
            "shifts": ints(0, 63, (1, 64)),
        },
        extra=_levels_match,
        shape=_multi_scale_shape,
    ),
)
def multi_scale_roi_align(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``args``: levels, one feature map per level, the boxes per image. Rows of each level gathered,
    pooled as ``roi_align`` on that level's codes, requantized to the output scale, scattered back."""
    a = inst.attrs
    n_lvl = len(a["spatial_scales"])
    levels, feats, boxes = args[0], list(args[1 : 1 + n_lvl]), list(args[1 + n_lvl :])
    for f, size in zip(feats, a["feature_sizes"], strict=True):
        if [int(f.shape[-2]), int(f.shape[-1])] != [int(v) for v in size]:
            raise ValueError(
                f"multi_scale_roi_align ({inst.source}): compiled for feature sizes {a['feature_sizes']}, got "
                f"{[list(t.shape[-2:]) for t in feats]}; compile again for this input size"
            )
    rois = _rois(boxes)
    if levels.shape != (rois.shape[0],):
        raise DataError(f"multi_scale_roi_align: {list(levels.shape)} level indices for {rois.shape[0]} boxes")
    check_index("multi_scale_roi_align", "the level input", levels, n_lvl)  # a row of no level stays 0
    ph, pw = (int(v) for v in a["output_size"])
    dt = str(a["out_dtype"])
    out = sat_to(torch.zeros(int(rois.shape[0]), int(feats[0].shape[1]), ph, pw, dtype=torch.int64), dt)
    for lvl, f in enumerate(feats):
        idx = torch.where(levels == lvl)[0]
        if idx.numel():
            means = _roi_means(f, rois[idx], a, float(a["spatial_scales"][lvl]), False, "multi_scale_roi_align")
            out[idx] = _requant_sat(means, int(a["multipliers"][lvl]), int(a["shifts"][lvl]), dt)
    return [out]
