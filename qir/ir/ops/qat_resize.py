"""The QAT resize op: a prepared model's ``qir.nn.Interpolate`` (or ``nn.Upsample``).

``qat_interpolate`` resizes with the module's ``mode`` / ``size`` / ``scale_factor`` /
``align_corners``; bilinear fake-quantizes the result with ``out_fq``, nearest keeps its input's
scale (``out_fq`` None). A size computed at run time (``self.up(x, size=y.shape[2:])``) is the
second operand (``run_time_size``). The ``quantize`` pass makes ``qinterpolate`` of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
from torch import nn

from qir.ir.graph import Value
from qir.ir.op import CannotInfer, IRError, Op, register_op
from qir.ir.ops import vision as float_ops
from qir.ir.ops.integer_pool import _plain
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp
from qir.ir.ops.qat_layer import QATLayerOp
from qir.ir.types import TensorType, Type

__all__ = ["QATInterpolate"]

_MODES = ("nearest", "bilinear")


@register_op
@attrs.frozen
class QATInterpolate(QATLayerOp):
    """``interpolate(x[, size])`` then ``out_fq`` for bilinear; state ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_interpolate"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "size")

    out_fq: FakeQuantSpec | None
    mode: str
    size: Any = attrs.field(default=None, converter=_plain)
    scale_factor: Any = attrs.field(default=None, converter=_plain)
    align_corners: bool | None = None
    recompute_scale_factor: bool | None = None
    run_time_size: bool = False

    def __attrs_post_init__(self) -> None:
        if self.mode not in _MODES:
            raise IRError(f"qat_interpolate: mode must be one of {_MODES}, got {self.mode!r}")
        if (self.out_fq is None) != (self.mode == "nearest"):
            raise IRError("qat_interpolate: bilinear has an output fake quant (out_fq), nearest none")
        self.check_out_fq()

    def num_inputs(self) -> int:
        return 2 if self.run_time_size else 1

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QATInterpolate, list[Value]]:
        """Bind ``forward(x, size=None)``: a size given at the call is a run-time operand."""
        if len(args) + len(kwargs) > 2 or len(args) > 2 or set(kwargs) - {"size"} or not args:
            raise IRError(f"qat_interpolate binds forward(x, size=None), got {len(args)} args and {sorted(kwargs)}")
        x = args[0]
        size = args[1] if len(args) > 1 else kwargs.get("size")
        if not isinstance(x, Value) or not (size is None or isinstance(size, Value)):
            raise IRError("qat_interpolate: the input and a run-time size must be graph values")
        return attrs.evolve(self, run_time_size=size is not None), [x] if size is None else [x, size]

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        if self.run_time_size:
            raise CannotInfer("qat_interpolate: the output size is a run-time value")
        return super().infer_type(operand_types)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        if not self.run_time_size and (self.size is None) == (self.scale_factor is None):
            raise IRError("qat_interpolate: give exactly one of size / scale_factor (or a run-time size operand)")
        if self.run_time_size:  # the output size is a run-time value: nothing to infer
            QATModuleOp.verify_(self, operand_types)
        else:
            super().verify_(operand_types)

    def check_input(self, index: int, t: Type) -> None:
        if index == 1:  # only with run_time_size
            if isinstance(t, TensorType):
                raise IRError(f"qat_interpolate: the run-time size is a sequence of ints, got {t}")
        elif not isinstance(t, TensorType) or not t.dtype.is_float or t.rank != 4:
            raise IRError(f"qat_interpolate resizes a float (N, C, H, W) tensor, got {t}")

    def float_op(self) -> Op:
        up = nn.Upsample(self.size, self.scale_factor, self.mode, self.align_corners)
        return float_ops.Interpolate.from_module(up)
