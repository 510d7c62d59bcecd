"""The QAT grid-sampling op: a prepared model's ``qir.nn.GridSample``.

``qat_grid_sample(input, grid)`` samples ``input`` (N, C, H, W) at the grid's (N, Ho, Wo, 2)
normalized coordinates with ``mode`` / ``padding_mode`` / ``align_corners``; bilinear
fake-quantizes the result with ``out_fq``, nearest keeps its input's scale (``out_fq`` None: the
QAT module rounds the coordinates as the integer rule does). The grid is a quantized tensor (its
producer's fake quant): the integer form reads it as codes. The ``quantize`` pass makes
``qgrid_sample`` of it; legality reads it as the ``F.grid_sample`` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs

from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import vision as float_ops
from qir.ir.ops.integer_sampling import _GRID_MODES, _GRID_PADDING
from qir.ir.ops.qat import FakeQuantSpec
from qir.ir.ops.qat_layer import QATLayerOp
from qir.ir.types import TensorType, Type

__all__ = ["QATGridSample"]


@register_op
@attrs.frozen
class QATGridSample(QATLayerOp):
    """``out_fq(grid_sample(x, grid))`` (bilinear) or the nearest sample; state ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_grid_sample"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "grid")
    legality_form: ClassVar[str] = "function"

    out_fq: FakeQuantSpec | None
    mode: str
    padding_mode: str = "zeros"
    align_corners: bool = False

    def __attrs_post_init__(self) -> None:
        if self.mode not in _GRID_MODES:
            raise IRError(f"qat_grid_sample: mode must be one of {_GRID_MODES}, got {self.mode!r}")
        if self.padding_mode not in _GRID_PADDING:
            raise IRError(f"qat_grid_sample: padding_mode must be one of {_GRID_PADDING}, got {self.padding_mode!r}")
        if not isinstance(self.align_corners, bool):
            raise IRError(f"qat_grid_sample: align_corners must be a boolean, got {self.align_corners!r}")
        if (self.out_fq is None) != (self.mode == "nearest"):
            raise IRError("qat_grid_sample: bilinear has an output fake quant (out_fq), nearest none")
        self.check_out_fq()

    def num_inputs(self) -> int:
        return 2

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x, grid = operand_types[0], operand_types[1]
        if not isinstance(x, TensorType) or x.rank != 4:
            raise IRError(f"qat_grid_sample samples an (N, C, H, W) tensor, got {x}")
        if not isinstance(grid, TensorType) or grid.rank != 4 or grid.shape[-1] != 2 or grid.shape[0] != x.shape[0]:
            raise IRError(f"qat_grid_sample: grid must be (N={x.shape[0]}, Ho, Wo, 2), got {grid}")
        return TensorType((x.shape[0], x.shape[1], grid.shape[1], grid.shape[2]), x.dtype)

    def float_op(self) -> Op:
        return float_ops.GridSample(mode=self.mode, padding_mode=self.padding_mode, align_corners=self.align_corners)
