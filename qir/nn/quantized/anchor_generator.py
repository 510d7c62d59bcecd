"""Quantized AnchorGenerator: float32 anchors from the shapes of its (code or float) inputs.

Deployment decision (docs/semantics.md, "AnchorGenerator"): the operator tables give the output
as float32 and the anchors depend on shapes only, so they are not quantized; the compiled
program computes them once, at compile time, for the compiled input size and stores them as
a float32 constant.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from passes.legality_facts import register_module_view
from qir.nn.modules.anchor_generator import anchors_for_shapes, cell_anchors, image_batch_shape
from qir.nn.qat.anchor_generator import AnchorGenerator as QATAnchorGenerator
from qir.nn.quantized._base import QuantizedModule, check_qat

__all__ = ["AnchorGenerator"]


class AnchorGenerator(QuantizedModule):
    """``forward(image_list, feature_maps)``: one float32 (num anchors, 4) tensor per image."""

    sizes: tuple[tuple[float, ...], ...]
    aspect_ratios: tuple[tuple[float, ...], ...]

    def forward(self, image_list: Any, feature_maps: list[torch.Tensor]) -> list[torch.Tensor]:
        n, h, w = image_batch_shape(image_list, type(self).__name__)
        cells = [cell_anchors(s, a) for s, a in zip(self.sizes, self.aspect_ratios, strict=True)]
        grid = [(int(f.shape[-2]), int(f.shape[-1])) for f in feature_maps]
        return anchors_for_shapes(cells, (h, w), grid, n)

    def num_anchors_per_location(self) -> list[int]:
        return [len(s) * len(a) for s, a in zip(self.sizes, self.aspect_ratios, strict=True)]

    @classmethod
    def from_qat(cls, qat: nn.Module, input_scales: Sequence[Any], march: Any) -> AnchorGenerator:
        check_qat(cls, qat, QATAnchorGenerator)
        assert isinstance(qat, QATAnchorGenerator)
        new = cls()
        new.sizes, new.aspect_ratios = qat.sizes, qat.aspect_ratios
        # the input scales are kept for the record only: anchors never read values
        new._set_scales(input_scales, None, None, n=len(input_scales))
        return new

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, aspect_ratios={self.aspect_ratios}, output float32"


def _legality_view(m: nn.Module) -> type | None:
    """qir's AnchorGenerator modules are checked against torchvision's row when torchvision is loaded."""
    from qir.nn.modules.anchor_generator import AnchorGenerator as FloatAnchorGenerator

    if not isinstance(m, (FloatAnchorGenerator, AnchorGenerator)):
        return None
    rpn = sys.modules.get("torchvision.models.detection.rpn")
    cls = getattr(rpn, "AnchorGenerator", None)
    return cls if isinstance(cls, type) else None


register_module_view(_legality_view)


# ----------------------------------------------------------------------------- the IR's qanchor_generator op


def _from_qanchor_generator(op: Any, tensors: dict[str, torch.Tensor]) -> AnchorGenerator:
    m = AnchorGenerator()
    m.sizes, m.aspect_ratios = tuple(op.sizes), tuple(op.aspect_ratios)
    m._set_scales(op.in_scales, None, None, n=len(op.in_scales))
    return m


def _register_ir() -> None:
    from qir.ir.ops.integer import register_integer_module
    from qir.ir.ops.integer_sampling import QAnchorGenerator

    register_integer_module(QAnchorGenerator, AnchorGenerator, _from_qanchor_generator)


_register_ir()
