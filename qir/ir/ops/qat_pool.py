"""QAT pooling ops: a prepared model's ``MaxPool2d``, ``AvgPool2d`` and ``AdaptiveAvgPool2d``.

``qat_max_pool2d`` keeps its input's scale (no fake quant: a maximum of grid values is on the
grid); the average pools fake-quantize their float result with ``out_fq``. The hyper-parameters
are the module's, as torch holds them; the ``quantize`` pass makes ``qmax_pool2d`` /
``qavg_pool2d`` / ``qadaptive_avg_pool2d`` of them (:mod:`qir.ir.ops.integer_pool`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from torch import nn

from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import pool as float_ops
from qir.ir.ops.integer_codes import check_window
from qir.ir.ops.integer_pool import _pair, _plain
from qir.ir.ops.qat import FakeQuantSpec, is_int
from qir.ir.ops.qat_layer import QATLayerOp

__all__ = ["QATAdaptiveAvgPool2d", "QATAvgPool2d", "QATMaxPool2d"]


@register_op
@attrs.frozen
class QATMaxPool2d(QATLayerOp):
    """``max_pool2d(x)`` with torch's window (``kernel_size``, ``stride``, ``padding``, ``dilation``,
    ``ceil_mode``); no state."""

    name: ClassVar[str] = "qat_max_pool2d"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    kernel_size: Any = attrs.field(default=1, converter=_plain)
    stride: Any = attrs.field(default=None, converter=_plain)
    padding: Any = attrs.field(default=0, converter=_plain)
    dilation: Any = attrs.field(default=1, converter=_plain)
    ceil_mode: bool = False

    def __attrs_post_init__(self) -> None:
        check_window(self.name, self.kernel_size, self.stride, self.padding, self.dilation)

    def float_op(self) -> Op:
        pool = nn.MaxPool2d(self.kernel_size, self.stride, self.padding, self.dilation, ceil_mode=self.ceil_mode)
        return float_ops.MaxPool2d.from_module(pool)


@register_op
@attrs.frozen
class QATAvgPool2d(QATLayerOp):
    """``out_fq(avg_pool2d(x))``; state ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_avg_pool2d"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out_fq: FakeQuantSpec
    kernel_size: tuple[int, int] = attrs.field(default=(1, 1), converter=_pair)
    stride: tuple[int, int] = attrs.field(default=(1, 1), converter=_pair)
    padding: tuple[int, int] = attrs.field(default=(0, 0), converter=_pair)
    ceil_mode: bool = False
    count_include_pad: bool = True
    divisor_override: int | None = None

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        check_window(self.name, self.kernel_size, self.stride, self.padding)
        d = self.divisor_override
        if d is not None and (not is_int(d) or d < 1):
            raise IRError(f"qat_avg_pool2d: divisor_override must be None or an int >= 1, got {d!r}")

    def float_op(self) -> Op:
        pool = nn.AvgPool2d(
            self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad, self.divisor_override
        )
        return float_ops.AvgPool2d.from_module(pool)


@register_op
@attrs.frozen
class QATAdaptiveAvgPool2d(QATLayerOp):
    """``out_fq(adaptive_avg_pool2d(x, output_size))`` (an int, or a pair whose None entries keep the
    input size); state ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_adaptive_avg_pool2d"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out_fq: FakeQuantSpec
    output_size: Any = attrs.field(default=1, converter=_plain)

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        o = self.output_size
        sizes = (o, o) if is_int(o) else o
        if (
            not isinstance(sizes, tuple)
            or len(sizes) != 2
            or any(v is not None and (not is_int(v) or v < 1) for v in sizes)
        ):
            raise IRError(f"qat_adaptive_avg_pool2d: output_size must be an int or a pair of ints / None >= 1: {o!r}")

    def float_op(self) -> Op:
        return float_ops.AdaptiveAvgPool2d.from_module(nn.AdaptiveAvgPool2d(self.output_size))
