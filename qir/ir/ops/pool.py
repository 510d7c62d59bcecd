"""Pooling: max / average with windows, and adaptive pools to a fixed output size.

Fields mirror the torch module constructors and the ``F.*_pool*`` keyword names, so one
class serves the module and the functional spelling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch.nn.functional as F
from torch import nn

from qir.ir.meta_shapes import adaptive_pool_shape, pool_shape
from qir.ir.op import Op, Pure, Trait, register_op
from qir.ir.ops.torchop import TorchModuleOp
from qir.ir.types import TensorType, Type


def _tup(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


@attrs.frozen
class _Pool(TorchModuleOp):
    traits: ClassVar[frozenset[type[Trait]]] = frozenset({Pure})
    arity: ClassVar[tuple[int, int | None]] = (1, 1)

    def spatial_dims(self) -> int:
        return int(self.name[-2])  # max_pool2d, adaptive_avg_pool3d, ...

    def formula_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The result shape by formula (:mod:`qir.ir.meta_shapes`), None to ask torch's meta kernel."""
        return None

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        # torch's meta kernels for pools run Python decompositions (0.1-1 ms a call); the formula
        # gives the same shape in microseconds (tests/ir/test_meta_shapes.py compares the two)
        x = operand_types[0] if len(operand_types) == 1 else None
        if isinstance(x, TensorType) and x.dtype.is_float and x.quant is None:
            shape = self.formula_shape(tuple(x.shape))
            if shape is not None:
                return TensorType(shape, x.dtype)
        return Op.infer_type(self, operand_types)


@attrs.frozen
class MaxPoolNd(_Pool):
    """``nn.MaxPoolNd`` / ``F.max_poolNd``."""

    signature: ClassVar[tuple[str, ...]] = (
        "input",
        "kernel_size",
        "stride",
        "padding",
        "dilation",
        "ceil_mode",
        "return_indices",
    )
    module_fields: ClassVar[tuple[str, ...]] = signature[1:]

    kernel_size: Any = attrs.field(default=1, converter=_tup)
    stride: Any = attrs.field(default=None, converter=_tup)
    padding: Any = attrs.field(default=0, converter=_tup)
    dilation: Any = attrs.field(default=1, converter=_tup)
    ceil_mode: bool = False
    return_indices: bool = False

    def formula_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        if self.return_indices:
            return None
        nd = self.spatial_dims()
        return pool_shape(shape, nd, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)


@register_op
@attrs.frozen
class MaxPool1d(MaxPoolNd):
    name: ClassVar[str] = "max_pool1d"
    module_types: ClassVar[tuple[type, ...]] = (nn.MaxPool1d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.max_pool1d,)


@register_op
@attrs.frozen
class MaxPool2d(MaxPoolNd):
    name: ClassVar[str] = "max_pool2d"
    module_types: ClassVar[tuple[type, ...]] = (nn.MaxPool2d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.max_pool2d,)


@register_op
@attrs.frozen
class MaxPool3d(MaxPoolNd):
    name: ClassVar[str] = "max_pool3d"
    module_types: ClassVar[tuple[type, ...]] = (nn.MaxPool3d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.max_pool3d,)


@register_op
@attrs.frozen
class AvgPool1d(_Pool):
    """``nn.AvgPool1d`` / ``F.avg_pool1d``."""

    name: ClassVar[str] = "avg_pool1d"
    module_types: ClassVar[tuple[type, ...]] = (nn.AvgPool1d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.avg_pool1d,)
    signature: ClassVar[tuple[str, ...]] = (
        "input",
        "kernel_size",
        "stride",
        "padding",
        "ceil_mode",
        "count_include_pad",
    )
    module_fields: ClassVar[tuple[str, ...]] = signature[1:]

    kernel_size: Any = attrs.field(default=1, converter=_tup)
    stride: Any = attrs.field(default=None, converter=_tup)
    padding: Any = attrs.field(default=0, converter=_tup)
    ceil_mode: bool = False
    count_include_pad: bool = True

    def formula_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        return pool_shape(shape, self.spatial_dims(), self.kernel_size, self.stride, self.padding, 1, self.ceil_mode)


@attrs.frozen
class AvgPoolNd(_Pool):
    """``nn.AvgPool2d/3d`` / ``F.avg_pool2d/3d``."""

    signature: ClassVar[tuple[str, ...]] = (
        "input",
        "kernel_size",
        "stride",
        "padding",
        "ceil_mode",
        "count_include_pad",
        "divisor_override",
    )
    module_fields: ClassVar[tuple[str, ...]] = signature[1:]

    kernel_size: Any = attrs.field(default=1, converter=_tup)
    stride: Any = attrs.field(default=None, converter=_tup)
    padding: Any = attrs.field(default=0, converter=_tup)
    ceil_mode: bool = False
    count_include_pad: bool = True
    divisor_override: int | None = None

    def formula_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        return pool_shape(shape, self.spatial_dims(), self.kernel_size, self.stride, self.padding, 1, self.ceil_mode)


@register_op
@attrs.frozen
class AvgPool2d(AvgPoolNd):
    name: ClassVar[str] = "avg_pool2d"
    module_types: ClassVar[tuple[type, ...]] = (nn.AvgPool2d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.avg_pool2d,)


@register_op
@attrs.frozen
class AvgPool3d(AvgPoolNd):
    name: ClassVar[str] = "avg_pool3d"
    module_types: ClassVar[tuple[type, ...]] = (nn.AvgPool3d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.avg_pool3d,)


@attrs.frozen
class AdaptivePool(_Pool):
    """Adaptive pools: ``output_size`` per spatial dim (None keeps the input size)."""

    signature: ClassVar[tuple[str, ...]] = ("input", "output_size")
    module_fields: ClassVar[tuple[str, ...]] = ("output_size",)

    output_size: Any = attrs.field(default=1, converter=_tup)

    def formula_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        if getattr(self, "return_indices", False):
            return None
        return adaptive_pool_shape(shape, self.spatial_dims(), self.output_size)


@register_op
@attrs.frozen
class AdaptiveAvgPool1d(AdaptivePool):
    name: ClassVar[str] = "adaptive_avg_pool1d"
    module_types: ClassVar[tuple[type, ...]] = (nn.AdaptiveAvgPool1d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.adaptive_avg_pool1d,)


@register_op
@attrs.frozen
class AdaptiveAvgPool2d(AdaptivePool):
    name: ClassVar[str] = "adaptive_avg_pool2d"
    module_types: ClassVar[tuple[type, ...]] = (nn.AdaptiveAvgPool2d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.adaptive_avg_pool2d,)


@register_op
@attrs.frozen
class AdaptiveAvgPool3d(AdaptivePool):
    name: ClassVar[str] = "adaptive_avg_pool3d"
    module_types: ClassVar[tuple[type, ...]] = (nn.AdaptiveAvgPool3d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.adaptive_avg_pool3d,)


@attrs.frozen
class AdaptiveMaxPoolNd(AdaptivePool):
    signature: ClassVar[tuple[str, ...]] = ("input", "output_size", "return_indices")
    module_fields: ClassVar[tuple[str, ...]] = ("output_size", "return_indices")

    return_indices: bool = False


@register_op
@attrs.frozen
class AdaptiveMaxPool1d(AdaptiveMaxPoolNd):
    name: ClassVar[str] = "adaptive_max_pool1d"
    module_types: ClassVar[tuple[type, ...]] = (nn.AdaptiveMaxPool1d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.adaptive_max_pool1d,)


@register_op
@attrs.frozen
class AdaptiveMaxPool2d(AdaptiveMaxPoolNd):
    name: ClassVar[str] = "adaptive_max_pool2d"
    module_types: ClassVar[tuple[type, ...]] = (nn.AdaptiveMaxPool2d,)
    functions: ClassVar[tuple[Callable[..., Any], ...]] = (F.adaptive_max_pool2d,)
