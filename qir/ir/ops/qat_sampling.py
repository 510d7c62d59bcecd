"""The QAT grid-sampling op: a prepared model's ``qir.nn.GridSample``.

``qat_grid_sample(input, grid)`` samples ``input`` (N, C, H, W) at the grid's (N, Ho, Wo, 2)
normalized coordinates with ``mode`` / ``padding_mode`` / ``align_corners``; bilinear
fake-quantizes the result with ``out_fq``, nearest keeps its input's scale (``out_fq`` None: the
QAT module rounds the coordinates as the integer rule does). The grid is a quantized tensor (its
producer's fake quant): the integer form reads it as codes. The ``quantize`` pass makes
``qgrid_sample`` of it; legality reads it as the ``F.grid_sample`` call.

``qat_roi_align(input, boxes...)`` is a prepared ``RoIAlign`` (boxes float at every stage, the
output fake-quantized) and converts to ``qroi_align``; ``qat_multi_scale_roi_align`` a prepared
``MultiScaleRoIAlign`` (``qmulti_scale_roi_align``); ``qat_anchor_generator(images, features...)``
a prepared ``AnchorGenerator`` (no state: float32 anchors from shapes), converting to
``qanchor_generator``. Legality reads the three as torchvision's modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from qir.ir.graph import Value
from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import vision as float_ops
from qir.ir.ops.integer_codes import check_int
from qir.ir.ops.integer_sampling import (
    _GRID_MODES,
    _GRID_PADDING,
    _MAX_OUTPUT_SIDE,
    _float_boxes,
    _numbers,
    _output_size,
    _pair,
    _shapes,
    _strs,
    _torchvision_class,
    anchor_float_op,
    anchor_list_type,
    bind_anchor_call,
    bind_multi_scale_call,
    bind_roi_align_call,
    check_anchor_levels,
)
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp
from qir.ir.ops.qat_layer import QATLayerOp
from qir.ir.types import TensorType, Type

__all__ = ["QATAnchorGenerator", "QATGridSample", "QATMultiScaleRoIAlign", "QATRoIAlign"]


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


@register_op
@attrs.frozen
class QATRoIAlign(QATLayerOp):
    """A prepared model's ``RoIAlign``: ``out_fq(roi_align(x, boxes))`` with the integer rule's
    sampling weights; state ``activation_post_process.*``. Operands: ``input``, then the boxes:
    one ``(K, 5)`` tensor, or with ``box_list`` ``num_boxes`` ``(K_i, 4)`` tensors (one per image).
    The boxes stay float at every stage (only ``input`` is read as codes after conversion)."""

    name: ClassVar[str] = "qat_roi_align"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "boxes")
    legality_form: ClassVar[str] = "module"

    out_fq: FakeQuantSpec
    output_size: tuple[int, int] = attrs.field(default=(1, 1), converter=_pair)
    spatial_scale: float = 1.0
    sampling_ratio: int = -1
    aligned: bool = False
    box_list: bool = False
    num_boxes: int = 1

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        _output_size(self.name, self.output_size)
        check_int(self.name, "sampling_ratio", self.sampling_ratio, -1, _MAX_OUTPUT_SIDE)
        check_int(self.name, "num_boxes", self.num_boxes, 1, 1 << 16)
        if not self.box_list and self.num_boxes != 1:
            raise IRError(f"qat_roi_align: boxes as one (K, 5) tensor is one operand, got num_boxes={self.num_boxes}")
        if not isinstance(self.spatial_scale, float) or not 0.0 < self.spatial_scale < float("inf"):
            raise IRError(f"qat_roi_align: spatial_scale must be a positive finite float, got {self.spatial_scale!r}")

    def num_inputs(self) -> int:
        return 1 + self.num_boxes

    def reads_codes_at(self, index: int) -> bool:
        return index == 0  # the boxes are float

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QATRoIAlign, list[Value]]:
        """Bind ``forward(input, boxes)``: boxes one tensor or a list of tensors."""
        return bind_roi_align_call(self, args, kwargs, "input")

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (inputs[0], list(inputs[1:]) if self.box_list else inputs[1]), {}

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x = operand_types[0]
        if not isinstance(x, TensorType) or x.rank != 4:
            raise IRError(f"qat_roi_align pools (N, C, H, W) tensors, got {x}")
        boxes = operand_types[1 : self.num_inputs()]
        _float_boxes(self.name, boxes, 4 if self.box_list else 5)
        k = sum(t.shape[0] for t in boxes if isinstance(t, TensorType))
        return TensorType((k, x.shape[1], *self.output_size), x.dtype)

    def float_op(self) -> type | None:
        return _torchvision_class("torchvision.ops", "RoIAlign") or (self.module_types or (None,))[0]


@register_op
@attrs.frozen
class QATAnchorGenerator(QATModuleOp):
    """A prepared model's ``AnchorGenerator``: float32 anchors from the shapes of ``images`` (N, C, H, W)
    and of the feature maps (one per level), one ``(anchors, 4)`` tensor per image. No state, no fake
    quant: the anchors never read values, and the result stays float32 after conversion. The images
    may be float or quantized (codes after conversion when they come from a quantized layer)."""

    name: ClassVar[str] = "qat_anchor_generator"
    makes_codes: ClassVar[bool] = False
    operand_names: ClassVar[tuple[str, ...]] = ()

    sizes: tuple[tuple[float, ...], ...] = attrs.field(converter=_numbers)
    aspect_ratios: tuple[tuple[float, ...], ...] = attrs.field(converter=_numbers)
    num_features: int = 1

    def __attrs_post_init__(self) -> None:
        check_anchor_levels(self.name, self.sizes, self.aspect_ratios, self.num_features)

    def num_inputs(self) -> int:
        return 1 + self.num_features

    def reads_codes_at(self, index: int) -> bool | None:
        return None if index == 0 else True  # the images: codes if a quantized layer made them, else float

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QATAnchorGenerator, list[Value]]:
        """Bind ``forward(image_list, feature_maps)`` (:func:`bind_anchor_call`)."""
        return bind_anchor_call(self, args, kwargs)

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (inputs[0], list(inputs[1:])), {}

    def evaluate(self, ctx: Any, operands: Sequence[Any]) -> Any:
        args, kwargs = self.module_call(self.module_inputs(operands))
        return self.to_module({})(*args, **kwargs)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return anchor_list_type(self, operand_types[: self.num_inputs()])

    def float_op(self) -> type | None:
        return anchor_float_op(self)


@register_op
@attrs.frozen
class QATMultiScaleRoIAlign(QATLayerOp):
    """A prepared model's ``MultiScaleRoIAlign``: each box pooled from its level with the integer rule's
    sampling, one output fake quant; state ``activation_post_process.*``. Operands: the feature dict's
    values (keys ``feature_names``; those in ``featmap_names`` are pooled), then ``num_boxes`` float
    ``(K_i, 4)`` box tensors; ``image_shapes`` is the call's constant ``[(H, W), ...]``."""

    name: ClassVar[str] = "qat_multi_scale_roi_align"
    operand_names: ClassVar[tuple[str, ...]] = ()
    legality_form: ClassVar[str] = "module"

    out_fq: FakeQuantSpec
    featmap_names: tuple[str, ...] = attrs.field(converter=_strs)
    output_size: tuple[int, int] = attrs.field(default=(1, 1), converter=_pair)
    sampling_ratio: int = -1
    canonical_scale: int = 224
    canonical_level: int = 4
    feature_names: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    num_boxes: int = 1
    image_shapes: tuple[tuple[int, int], ...] = attrs.field(default=((1, 1),), converter=_shapes)

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        _output_size(self.name, self.output_size)
        check_int(self.name, "sampling_ratio", self.sampling_ratio, -1, _MAX_OUTPUT_SIDE)
        check_int(self.name, "num_boxes", self.num_boxes, 1, 1 << 16)
        check_int(self.name, "canonical_scale", self.canonical_scale, 1, 1 << 20)
        check_int(self.name, "canonical_level", self.canonical_level, 0, 64)
        if not self.featmap_names:
            raise IRError("qat_multi_scale_roi_align: featmap_names must name at least one feature")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise IRError(f"qat_multi_scale_roi_align: feature_names must be distinct, got {self.feature_names}")
        if not self.image_shapes or any(min(s) < 1 for s in self.image_shapes):
            raise IRError(f"qat_multi_scale_roi_align: image_shapes must list positive (H, W), got {self.image_shapes}")

    def num_inputs(self) -> int:
        return len(self.feature_names) + self.num_boxes

    def reads_codes_at(self, index: int) -> bool:
        return index < len(self.feature_names)  # the boxes are float

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QATMultiScaleRoIAlign, list[Value]]:
        """Bind ``forward(x, boxes, image_shapes)``: ``x`` a dict of values, ``boxes`` a list of values,
        ``image_shapes`` constant ``(H, W)`` pairs (the level scales are fixed by them)."""
        return bind_multi_scale_call(self, args, kwargs, None)

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        n = len(self.feature_names)
        feats = dict(zip(self.feature_names, inputs[:n], strict=True))
        return (feats, list(inputs[n:]), [tuple(s) for s in self.image_shapes]), {}

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        n = len(self.feature_names)
        if not set(self.featmap_names) & set(self.feature_names):
            raise IRError(
                f"qat_multi_scale_roi_align: none of featmap_names {self.featmap_names} is a feature "
                f"({self.feature_names})"
            )
        feats = operand_types[:n]
        for t in feats:
            if not isinstance(t, TensorType) or t.rank != 4:
                raise IRError(f"qat_multi_scale_roi_align pools (N, C, H, W) tensors, got {t}")
        boxes = operand_types[n : self.num_inputs()]
        _float_boxes(self.name, boxes, 4)
        k = sum(t.shape[0] for t in boxes if isinstance(t, TensorType))
        x = feats[0]
        assert isinstance(x, TensorType)
        return TensorType((k, x.shape[1], *self.output_size), x.dtype)

    def float_op(self) -> type | None:
        return _torchvision_class("torchvision.ops", "MultiScaleRoIAlign") or (self.module_types or (None,))[0]
