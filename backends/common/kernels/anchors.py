"""Anchors kernel: AnchorGenerator's float32 anchors, a constant computed at compile time.

Anchors depend on the image and feature map shapes only (docs/semantics.md,
"AnchorGenerator"); the lowering rule computes them for the compiled sizes and stores them as
one float32 constant; the kernel checks the run-time shapes and returns one copy per image.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import register_kernel
from backends.common.kernels.infer import ShapeError, meta, tensor_arg
from backends.common.kernels.schema import MAX_COUNT, Attr, Const, KernelSchema, integer
from backends.common.program import Instruction


def _shapes_check(v: Any) -> str | None:
    """``[[N, H, W], [H, W], ...]``: the image batch shape, then each feature map's size."""
    if not isinstance(v, list) or not 1 <= len(v) <= 64:
        return "must be a list of 1 to 64 shapes"
    for i, s in enumerate(v):
        n = 3 if i == 0 else 2
        if not (isinstance(s, list) and len(s) == n and all(isinstance(d, int) and 0 <= d <= MAX_COUNT for d in s)):
            return f"entry {i} must be {n} integers in [0, {MAX_COUNT}]"
    return None


def _anchors_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    a = inst.attrs
    ts = [tensor_arg(args, i, rank=(2, 8)) for i in range(len(args))]
    got = [[int(t.shape[0]), int(t.shape[-2]), int(t.shape[-1])] for t in ts[:1]]
    got += [[int(t.shape[-2]), int(t.shape[-1])] for t in ts[1:]]
    if got != [list(map(int, s)) for s in a["shapes"]]:
        raise ShapeError(f"compiled for image / feature shapes {a['shapes']}, the inputs have {got}")
    one = consts[inst.consts["anchors"]]
    return [[meta(one.shape, one.dtype) for _ in range(int(a["images"]))]]


@register_kernel(
    "anchors",
    schema=KernelSchema(
        inputs=(1, 64),
        attrs={
            "shapes": Attr(_shapes_check, "list of [N, H, W] then [H, W] per feature map"),
            "images": integer(0, MAX_COUNT),
        },
        consts={"anchors": Const(("float32",), (2, 2))},
        shape=_anchors_shape,
    ),
)
def anchors(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``args``: the image batch, then the feature maps; returns ``[anchors] * images``."""
    a = inst.attrs
    got = [[int(t.shape[0]), int(t.shape[-2]), int(t.shape[-1])] for t in args[:1]]
    got += [[int(t.shape[-2]), int(t.shape[-1])] for t in args[1:]]
    want = [list(map(int, s)) for s in a["shapes"]]
    if got != want:
        raise ValueError(
            f"anchors ({inst.source}): compiled for image / feature shapes {want}, got {got}; the anchors are "
            "fixed for the compiled input size: compile again for this size"
        )
    return [[state["anchors"].clone() for _ in range(int(a["images"]))]]
