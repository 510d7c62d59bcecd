"""Integer pooling layers: max pool on codes, average pools by exact window sums.

* ``qmax_pool2d``: the window maximum of the codes (exact; scale and dtype kept);
* ``qavg_pool2d``: the exact window sum requantized with the multiplier / shift of the
  window's divisor (state operands ``multipliers`` / ``shifts``, entry ``d - 1`` for divisor
  ``d``; docs/modules.md "Average pooling");
* ``qadaptive_avg_pool2d``: torch's adaptive windows, the same sum-and-requantize rule, its
  parameters derived for ``march`` from the scales when the window sizes are known.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import pool as float_ops
from qir.ir.ops.integer import IntegerModuleOp, _floats
from qir.ir.ops.integer_codes import (
    SameScaleOp,
    check_march,
    check_scales,
    check_window,
    code_dtype,
    float_shaped,
    per_tensor_scale,
    same_scale_spec,
)
from qir.ir.ops.integer_probe import probe
from qir.ir.ops.integer_values import (
    MULTIPLIER_RANGE,
    SHIFT_RANGE,
    abs_max,
    check_fits_int64,
    check_int_values,
    code_magnitude,
)
from qir.ir.types import QuantSpec, TensorType, Type

__all__ = ["QAdaptiveAvgPool2d", "QAvgPool2d", "QMaxPool2d"]


def _plain(v: Any) -> Any:
    """A pool hyper-parameter as printable data (lists -> tuples)."""
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


@register_op
@attrs.frozen
class QMaxPool2d(SameScaleOp):
    """Max pool on codes: torch's ``max_pool2d`` windows (``kernel_size``, ``stride``, ``padding``,
    ``dilation``, ``ceil_mode`` as the module holds them)."""

    name: ClassVar[str] = "qmax_pool2d"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    kernel_size: Any = attrs.field(default=1, converter=_plain)
    stride: Any = attrs.field(default=None, converter=_plain)
    padding: Any = attrs.field(default=0, converter=_plain)
    dilation: Any = attrs.field(default=1, converter=_plain)
    ceil_mode: bool = False

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        self.verify_(operand_types)  # a window torch accepts
        return float_shaped(self, operand_types, self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_window(self.name, self.kernel_size, self.stride, self.padding, self.dilation)

    def float_op(self) -> Op:
        pool = nn.MaxPool2d(self.kernel_size, self.stride, self.padding, self.dilation, ceil_mode=self.ceil_mode)
        return float_ops.MaxPool2d.from_module(pool)

    @classmethod
    def from_module(cls, m: Any) -> QMaxPool2d:
        return cls(
            out=same_scale_spec(m),
            kernel_size=m.kernel_size,
            stride=m.stride,
            padding=m.padding,
            dilation=m.dilation,
            ceil_mode=bool(m.ceil_mode),
        )


@attrs.frozen
class _AvgPool(IntegerModuleOp):
    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)

    def __attrs_post_init__(self) -> None:
        if len(self.in_scales) != 1 or self.out.axis is not None:
            raise IRError(f"{self.name}: one per-tensor input and output scale, got {self.in_scales} and {self.out}")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        self.verify_(operand_types)
        return float_shaped(self, operand_types, self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        code_dtype(self.name, operand_types[0])


@register_op
@attrs.frozen
class QAvgPool2d(_AvgPool):
    """Average pool: exact int64 window sums (padding adds 0), each requantized with the
    parameters of torch's divisor at that position."""

    name: ClassVar[str] = "qavg_pool2d"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    state_roles: ClassVar[tuple[str, ...]] = ("multipliers", "shifts")

    kernel_size: tuple[int, int] = attrs.field(default=(1, 1), converter=_pair)
    stride: tuple[int, int] = attrs.field(default=(1, 1), converter=_pair)
    padding: tuple[int, int] = attrs.field(default=(0, 0), converter=_pair)
    ceil_mode: bool = False
    count_include_pad: bool = True
    divisor_override: int | None = None

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_window(self.name, self.kernel_size, self.stride, self.padding)
        if self.divisor_override is not None and self.divisor_override < 1:
            raise IRError(f"qavg_pool2d: divisor_override must be >= 1, got {self.divisor_override}")
        # one multiplier / shift per divisor 1 .. the largest window (or the override)
        top = self.divisor_override or self.kernel_size[0] * self.kernel_size[1]
        for role, t in zip(self.state_roles, operand_types[1:], strict=True):
            if not isinstance(t, TensorType) or t.rank != 1 or t.shape[0] < top or t.dtype.is_float:
                raise IRError(f"qavg_pool2d: {role} must hold {top} integer entries (one per divisor), got {t}")

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        """The multiplier and right shift of each divisor the windows use (the first ``top``
        entries), and a window sum times a multiplier inside int64."""
        top = self.divisor_override or self.kernel_size[0] * self.kernel_size[1]
        m = state.get("multipliers")
        if m is not None:
            check_int_values(self.name, "multipliers", m.reshape(-1)[:top], *MULTIPLIER_RANGE)
            window = self.kernel_size[0] * self.kernel_size[1] * code_magnitude(operand_types[0])
            check_fits_int64(
                self.name, "a window sum times its multiplier", window, max(abs_max(m.reshape(-1)[:top]), 1)
            )
        if "shifts" in state:
            check_int_values(self.name, "shifts", state["shifts"].reshape(-1)[:top], *SHIFT_RANGE)

    def float_op(self) -> Op:
        pool = nn.AvgPool2d(
            self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad, self.divisor_override
        )
        return float_ops.AvgPool2d.from_module(pool)

    @classmethod
    def from_module(cls, m: Any) -> QAvgPool2d:
        return cls(
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=(per_tensor_scale(m, "input_scale_0"),),
            kernel_size=m.kernel_size,
            stride=m.stride,
            padding=m.padding,
            ceil_mode=bool(m.ceil_mode),
            count_include_pad=bool(m.count_include_pad),
            divisor_override=None if m.divisor_override is None else int(m.divisor_override),
        )


@register_op
@attrs.frozen
class QAdaptiveAvgPool2d(_AvgPool):
    """Adaptive average pool to ``output_size`` (an int, or a pair whose None entries keep the
    input size); multipliers and shifts follow from the scales and the largest window for
    ``march`` (``avg_pool_params``)."""

    name: ClassVar[str] = "qadaptive_avg_pool2d"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    march: str
    output_size: Any = attrs.field(default=1, converter=_plain)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        check_march(self.name, self.march)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        o = self.output_size
        sizes = (o, o) if isinstance(o, int) else o
        if len(sizes) != 2 or any(v is not None and (not isinstance(v, int) or v < 1) for v in sizes):
            raise IRError(f"qadaptive_avg_pool2d: output_size must be an int or a pair of ints / None >= 1, got {o!r}")
        # the window sums' requantization follows from the scales at run time (the march's multiplier
        # limit on in_scale / out_scale): the module's own rule, run on a 1x1 window (the largest ratio)
        probe(self, operand_types)

    def float_op(self) -> Op:
        return float_ops.AdaptiveAvgPool2d.from_module(nn.AdaptiveAvgPool2d(self.output_size))

    @classmethod
    def from_module(cls, m: Any) -> QAdaptiveAvgPool2d:
        return cls(
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=(per_tensor_scale(m, "input_scale_0"),),
            march=str(m.march),
            output_size=m.output_size,
        )
