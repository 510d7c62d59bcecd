"""Integer sampling layers: grid sample, RoIAlign, multi-scale RoIAlign and the anchor generator.

* ``qgrid_sample``: ``(input, grid)`` codes; source coordinates in fixed point from the grid
  codes, nearest (codes copied, the input's scale and dtype kept) or bilinear (integer weights,
  one requantization with ``multiplier`` / ``shift``; docs/semantics.md "Grid sample");
* ``qroi_align``: ``(input, boxes...)``: codes and float boxes, one ``(K, 5)`` tensor or, with
  ``box_list``, one ``(K_i, 4)`` tensor per image; integer sampling weights, the exact mean,
  one requantization (docs/semantics.md "RoIAlign");
* ``qmulti_scale_roi_align``: ``(features..., boxes...)``: the feature dict's values in order
  (``feature_names`` are its keys), the per-image box tensors; ``image_shapes`` is a constant of
  the call; each level requantized with its ``multipliers[i]`` / ``shifts[i]``;
* ``qanchor_generator``: ``(images, feature maps...)``: float32 anchors that depend on shapes
  only (docs/semantics.md "AnchorGenerator"); the result is a list, one tensor per image.

None holds integer state: every parameter is an attribute. Evaluating one rebuilds its
integer module (``qir.nn.quantized`` registers the builders) and calls it with the structure
the attributes record (a box list, a feature dict), so the interpreter and emit equal the
converted model.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from qir.ir.graph import Value
from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import vision as float_ops
from qir.ir.ops.integer import IntegerModuleOp, _floats
from qir.ir.ops.integer_codes import check_int, check_scales, code_dtype, per_tensor_scale
from qir.ir.types import DType, QuantSpec, SequenceType, TensorType, Type

__all__ = [
    "QAnchorGenerator",
    "QGridSample",
    "QMultiScaleRoIAlign",
    "QRoIAlign",
    "bind_multi_scale_call",
    "bind_anchor_call",
    "bind_roi_align_call",
    "check_anchor_levels",
]

_GRID_MODES = ("nearest", "bilinear")
_GRID_PADDING = ("zeros", "border")
#: fraction bits of grid coordinates (backends/common/sampling_rules.py): the bilinear shift
#: carries the taps' 2**-2B, and int64 holds the shifted sum only below 2**62
_GRID_BITS = 15
#: fraction bits RoIAlign's exact mean keeps (backends/common/roi_rules.py), folded into the shift
_ROI_MEAN_BITS = 8
_MAX_OUTPUT_SIDE = 4096


def _pair(v: Any) -> tuple[int, int]:
    t = (v, v) if isinstance(v, int) else tuple(v)
    if len(t) != 2:
        raise IRError(f"output_size must be an int or a pair of ints, got {v!r}")
    return int(t[0]), int(t[1])


def _ints(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _strs(v: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in v)


def _shapes(v: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(s[0]), int(s[1])) for s in v)


def _numbers(v: Any) -> tuple[tuple[float, ...], ...]:
    """Per level, the numbers as the user wrote them (ints stay ints: the text form keeps them)."""
    return tuple(tuple(x if type(x) in (int, float) else float(x) for x in level) for level in v)


def _values(op: str, what: str, v: Any) -> list[Value]:
    """``v`` as a list of graph values (one value, or a list / tuple of them)."""
    items = list(v) if isinstance(v, (list, tuple)) else [v]
    if not items or not all(isinstance(x, Value) for x in items):
        raise IRError(f"op {op!r}: {what} must be graph values, got {v!r:.80}")
    return items


def _bind(op: str, names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    if len(args) > len(names) or set(kwargs) - set(names):
        raise IRError(f"op {op!r} binds forward({', '.join(names)}), got {len(args)} args and {sorted(kwargs)}")
    return dict(zip(names, args, strict=False)) | kwargs


def _output_size(op: str, size: tuple[int, int]) -> None:
    if not all(1 <= s <= _MAX_OUTPUT_SIDE for s in size):
        raise IRError(f"op {op!r}: output_size must be two integers in [1, {_MAX_OUTPUT_SIDE}], got {size}")


def _float_boxes(op: str, types: Sequence[Type], width: int) -> None:
    for t in types:
        if not isinstance(t, TensorType) or not t.dtype.is_float or t.rank != 2 or t.shape[1] != width:
            raise IRError(f"op {op!r}: boxes must be float (K, {width}) tensors, got {t}")


def _torchvision_class(module: str, name: str) -> type | None:
    """A torchvision class the operator tables list, when torchvision is loaded (qir never imports it)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


@attrs.frozen
class _CallOp(IntegerModuleOp):
    """A layer whose module call has structure (a list, a dict) that the flat operands lose:
    :meth:`module_call` rebuilds it, for evaluation, emit and the lowering alike."""

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(inputs), {}

    def evaluate(self, ctx: Any, operands: Sequence[Any]) -> Any:
        module = self.to_module({})
        args, kwargs = self.module_call(self.module_inputs(operands))
        return module(*args, **kwargs)


@register_op
@attrs.frozen
class QGridSample(_CallOp):
    """``grid_sample`` on codes: ``input`` (N, C, H, W), ``grid`` (N, Ho, Wo, 2) qint8 / qint16
    codes at ``in_scales[1]``; nearest copies codes, bilinear requantizes with ``(multiplier,
    shift + 2 * 15)``."""

    name: ClassVar[str] = "qgrid_sample"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "grid")
    #: checked as the ``F.grid_sample`` call its rows describe
    legality_form: ClassVar[str] = "function"

    mode: str
    padding_mode: str
    align_corners: bool
    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    multiplier: int = 0
    shift: int = 0

    def __attrs_post_init__(self) -> None:
        if self.mode not in _GRID_MODES:
            raise IRError(f"qgrid_sample: mode must be one of {_GRID_MODES}, got {self.mode!r}")
        if self.padding_mode not in _GRID_PADDING:
            raise IRError(f"qgrid_sample: padding_mode must be one of {_GRID_PADDING}, got {self.padding_mode!r}")
        if len(self.in_scales) != 2 or self.out.axis is not None:
            raise IRError(
                f"qgrid_sample: per-tensor scales of the input and the grid and of the output, got "
                f"{self.in_scales} and {self.out}"
            )
        check_int(self.name, "multiplier", self.multiplier, -(2**31) + 1, 2**31 - 1)
        check_int(self.name, "shift", self.shift, 0, 62 - 2 * _GRID_BITS)
        if self.mode == "nearest" and self.out.scale != self.in_scales[:1]:
            raise IRError(f"qgrid_sample: nearest copies codes, so out scale {self.out.scale} must be the input's")

    def num_inputs(self) -> int:
        return 2

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QGridSample, list[Value]]:
        """Bind ``forward(x, grid)``; nearest takes its dtype from the input codes."""
        call = _bind(self.name, ("x", "grid"), args, kwargs)
        x, grid = call.get("x"), call.get("grid")
        if not isinstance(x, Value) or not isinstance(grid, Value):
            raise IRError("qgrid_sample: the input and the grid must be graph values")
        op = self
        if self.mode == "nearest":
            op = attrs.evolve(self, out=attrs.evolve(self.out, dtype=code_dtype(self.name, x.type)))
        return op, [x, grid]

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        x, grid = operand_types
        dtype = code_dtype(self.name, x)
        assert isinstance(x, TensorType)
        if x.rank != 4:
            raise IRError(f"qgrid_sample samples (N, C, H, W) codes, got {x}")
        if not isinstance(grid, TensorType) or grid.dtype not in (DType.qint8, DType.qint16, DType.int8, DType.int16):
            raise IRError(
                f"qgrid_sample: the grid must be qint8 / qint16 codes, got {grid}; quantize it with a QuantStub"
            )
        if grid.rank != 4 or grid.shape[-1] != 2 or grid.shape[0] != x.shape[0]:
            raise IRError(f"qgrid_sample: grid must be (N={x.shape[0]}, Ho, Wo, 2), got {grid}")
        if self.mode == "nearest" and dtype is not self.out.dtype:
            raise IRError(
                f"qgrid_sample: nearest keeps the input's dtype {dtype.name}, but out is {self.out.dtype.name}"
            )
        if self.mode == "bilinear" and self.out.dtype not in (DType.qint8, DType.qint16):
            raise IRError(f"qgrid_sample: bilinear requantizes to qint8 / qint16, not {self.out.dtype.name}")

    def float_op(self) -> Op:
        return float_ops.GridSample(mode=self.mode, padding_mode=self.padding_mode, align_corners=self.align_corners)

    @classmethod
    def from_module(cls, m: Any) -> QGridSample:
        bilinear = m.mode == "bilinear"
        s_in = per_tensor_scale(m, "input_scale_0")
        return cls(
            mode=str(m.mode),
            padding_mode=str(m.padding_mode),
            align_corners=bool(m.align_corners),
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype if bilinear else DType.qint8),
            in_scales=(s_in, per_tensor_scale(m, "input_scale_1")),
            multiplier=int(m.multiplier) if bilinear else 0,
            shift=int(m.shift) if bilinear else 0,
        )


@attrs.frozen
class _RoIOp(_CallOp):
    """Shared fields of the RoIAlign layers: the pooled size, the sampling and the output spec."""

    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    output_size: tuple[int, int] = attrs.field(default=(1, 1), converter=_pair)
    sampling_ratio: int = -1
    num_boxes: int = 1

    def _check_fields(self) -> None:
        if self.out.axis is not None or self.out.dtype not in (DType.qint8, DType.qint16):
            raise IRError(f"op {self.name!r}: the output is per-tensor qint8 / qint16, got {self.out}")
        _output_size(self.name, self.output_size)
        check_int(self.name, "sampling_ratio", self.sampling_ratio, -1, _MAX_OUTPUT_SIDE)
        check_int(self.name, "num_boxes", self.num_boxes, 1, 1 << 16)


@register_op
@attrs.frozen
class QRoIAlign(_RoIOp):
    """torchvision's ``roi_align`` on codes: integer weights at ``2**-12``, the exact mean, one
    requantization with ``(multiplier, shift + 8)``. Operands: ``input`` and the boxes: one
    ``(K, 5)`` tensor, or with ``box_list`` ``num_boxes`` ``(K_i, 4)`` tensors (one per image)."""

    name: ClassVar[str] = "qroi_align"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "boxes")

    spatial_scale: float = 1.0
    aligned: bool = False
    box_list: bool = False
    multiplier: int = 0
    shift: int = 0

    def __attrs_post_init__(self) -> None:
        self._check_fields()
        if len(self.in_scales) != 1:
            raise IRError(f"qroi_align: one input scale, got {self.in_scales}")
        if not self.box_list and self.num_boxes != 1:
            raise IRError(f"qroi_align: boxes as one (K, 5) tensor is one operand, got num_boxes={self.num_boxes}")
        if not 0.0 < self.spatial_scale < float("inf"):
            raise IRError(f"qroi_align: spatial_scale must be positive and finite, got {self.spatial_scale!r}")
        check_int(self.name, "multiplier", self.multiplier, -(2**31) + 1, 2**31 - 1)
        check_int(self.name, "shift", self.shift, 0, 62 - _ROI_MEAN_BITS)

    def num_inputs(self) -> int:
        return 1 + self.num_boxes

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QRoIAlign, list[Value]]:
        """Bind ``forward(x, boxes)``: boxes one tensor or a list of tensors."""
        return bind_roi_align_call(self, args, kwargs, "x")

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (inputs[0], list(inputs[1:]) if self.box_list else inputs[1]), {}

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        x = operand_types[0]
        code_dtype(self.name, x)
        if not isinstance(x, TensorType) or x.rank != 4:
            raise IRError(f"qroi_align pools (N, C, H, W) codes, got {x}")
        _float_boxes(self.name, operand_types[1:], 4 if self.box_list else 5)

    def float_op(self) -> type | None:
        return _torchvision_class("torchvision.ops", "RoIAlign") or (self.module_types or (None,))[0]

    @classmethod
    def from_module(cls, m: Any) -> QRoIAlign:
        return cls(
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=(per_tensor_scale(m, "input_scale_0"),),
            output_size=m.output_size,
            sampling_ratio=int(m.sampling_ratio),
            spatial_scale=float(m.spatial_scale),
            aligned=bool(m.aligned),
            multiplier=int(m.multiplier),
            shift=int(m.shift),
        )


@register_op
@attrs.frozen
class QMultiScaleRoIAlign(_RoIOp):
    """torchvision's ``MultiScaleRoIAlign`` on codes: each box's level from the float box, the
    RoIAlign rule on that level's codes, the level's ``(multipliers[i], shifts[i] + 8)``.

    Operands: the feature dict's values (keys ``feature_names``, one input scale each; those in
    ``featmap_names`` are pooled), then ``num_boxes`` ``(K_i, 4)`` box tensors. ``image_shapes``
    is the call's constant ``[(H, W), ...]``."""

    name: ClassVar[str] = "qmulti_scale_roi_align"
    operand_names: ClassVar[tuple[str, ...]] = ()

    feature_names: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    featmap_names: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    canonical_scale: int = 224
    canonical_level: int = 4
    multipliers: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    shifts: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    image_shapes: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=_shapes)

    def __attrs_post_init__(self) -> None:
        self._check_fields()
        n = len(self.feature_names)
        if not n or len(set(self.feature_names)) != n:
            raise IRError(
                f"qmulti_scale_roi_align: feature_names must be distinct and not empty, got {self.feature_names}"
            )
        if not len(self.in_scales) == len(self.multipliers) == len(self.shifts) == n:
            raise IRError(
                f"qmulti_scale_roi_align: one input scale, multiplier and shift per feature ({n}), got "
                f"{len(self.in_scales)}, {len(self.multipliers)} and {len(self.shifts)}"
            )
        for m, s in zip(self.multipliers, self.shifts, strict=True):
            check_int(self.name, "multipliers", m, -(2**31) + 1, 2**31 - 1)
            check_int(self.name, "shifts", s, 0, 62 - _ROI_MEAN_BITS)
        if not self.image_shapes or any(min(s) < 1 for s in self.image_shapes):
            raise IRError(f"qmulti_scale_roi_align: image_shapes must list positive (H, W), got {self.image_shapes}")
        check_int(self.name, "canonical_scale", self.canonical_scale, 1, 1 << 20)
        check_int(self.name, "canonical_level", self.canonical_level, 0, 64)

    def num_inputs(self) -> int:
        return len(self.feature_names) + self.num_boxes

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QMultiScaleRoIAlign, list[Value]]:
        """Bind ``forward(x, boxes, image_shapes)``: ``x`` a dict of values, ``boxes`` a list of
        values, ``image_shapes`` constant ``(H, W)`` pairs (the level scales are fixed by them)."""
        return bind_multi_scale_call(self, args, kwargs, len(self.in_scales))

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        n = len(self.feature_names)
        feats = dict(zip(self.feature_names, inputs[:n], strict=True))
        return (feats, list(inputs[n:]), [tuple(s) for s in self.image_shapes]), {}

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        if not set(self.featmap_names) & set(self.feature_names):
            raise IRError(
                f"qmulti_scale_roi_align: none of featmap_names {self.featmap_names} is a feature "
                f"({self.feature_names})"
            )
        n = len(self.feature_names)
        for t in operand_types[:n]:
            code_dtype(self.name, t)
            if not isinstance(t, TensorType) or t.rank != 4:
                raise IRError(f"qmulti_scale_roi_align pools (N, C, H, W) codes, got {t}")
        _float_boxes(self.name, operand_types[n:], 4)

    def float_op(self) -> type | None:
        return _torchvision_class("torchvision.ops", "MultiScaleRoIAlign") or (self.module_types or (None,))[0]

    @classmethod
    def from_module(cls, m: Any) -> QMultiScaleRoIAlign:
        n = int(m.num_input_scales)
        return cls(
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype),
            in_scales=tuple(per_tensor_scale(m, f"input_scale_{i}") for i in range(n)),
            output_size=m.output_size,
            sampling_ratio=int(m.sampling_ratio),
            # placeholders until the call binds: one feature per input scale, the image shapes
            feature_names=tuple(f"x{i}" for i in range(n)),
            featmap_names=tuple(m.featmap_names),
            canonical_scale=int(m.canonical_scale),
            canonical_level=int(m.canonical_level),
            multipliers=tuple(m.multipliers),
            shifts=tuple(m.shifts),
            image_shapes=((1, 1),),
        )


def bind_multi_scale_call(
    op: Any, args: Sequence[Any], kwargs: dict[str, Any], levels: int | None
) -> tuple[Any, list[Value]]:
    """Bind a QAT or integer MultiScaleRoIAlign's ``forward(x, boxes, image_shapes)``: ``x`` a dict of
    feature-map values (``levels`` of them when given, else at least one), ``boxes`` a list of values,
    ``image_shapes`` constant ``(H, W)`` pairs (the level scales are fixed by them)."""
    call = _bind(op.name, ("x", "boxes", "image_shapes"), args, kwargs)
    x, boxes, shapes = call.get("x"), call.get("boxes"), call.get("image_shapes")
    if not isinstance(x, dict) or not x or (levels is not None and len(x) != levels):
        count = f"{levels} " if levels is not None else ""
        raise IRError(f"{op.name}: x must be a dict of {count}feature maps")
    feats = _values(op.name, "feature maps", list(x.values()))
    if not isinstance(boxes, (list, tuple)):
        raise IRError(f"{op.name}: boxes must be a list of (K_i, 4) tensors")
    box_values = _values(op.name, "boxes", boxes)
    if not isinstance(shapes, (list, tuple)) or not all(
        isinstance(s, (list, tuple)) and len(s) == 2 and all(type(v) is int for v in s) for s in shapes
    ):
        raise IRError(
            f"{op.name}: image_shapes must be constant (height, width) pairs (the level scales are fixed for the "
            f"compiled size); got {shapes!r:.80}"
        )
    bound = attrs.evolve(op, feature_names=tuple(x), num_boxes=len(box_values), image_shapes=shapes)
    return bound, [*feats, *box_values]


def bind_roi_align_call(
    op: Any, args: Sequence[Any], kwargs: dict[str, Any], input_name: str
) -> tuple[Any, list[Value]]:
    """Bind a QAT or integer RoIAlign's ``forward(<input_name>, boxes)`` (the QAT module names its
    input ``input``, the integer one ``x``): boxes one tensor or a list of tensors."""
    call = _bind(op.name, (input_name, "boxes"), args, kwargs)
    x, boxes = call.get(input_name), call.get("boxes")
    if not isinstance(x, Value):
        raise IRError(f"{op.name}: the input must be a graph value")
    values = _values(op.name, "boxes", boxes)
    return attrs.evolve(op, box_list=isinstance(boxes, (list, tuple)), num_boxes=len(values)), [x, *values]


def bind_anchor_call(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, list[Value]]:
    """Bind a QAT or integer AnchorGenerator's ``forward(image_list, feature_maps)``: the batched
    image tensor (an ImageList is not a graph value) and one feature map per anchor level."""
    call = _bind(op.name, ("image_list", "feature_maps"), args, kwargs)
    images, feats = call.get("image_list"), call.get("feature_maps")
    if not isinstance(images, Value) or not isinstance(feats, (list, tuple)):
        raise IRError(
            f"{op.name} binds the batched image tensor (N, C, H, W) and a list of feature maps; an "
            "ImageList is not a graph value: pass its .tensors"
        )
    values = _values(op.name, "feature maps", feats)
    if len(values) != len(op.sizes):
        raise IRError(f"{op.name}: {len(values)} feature maps for {len(op.sizes)} anchor levels")
    return attrs.evolve(op, num_features=len(values)), [images, *values]


def check_anchor_levels(
    name: str, sizes: tuple[tuple[float, ...], ...], aspect_ratios: tuple[tuple[float, ...], ...], num_features: int
) -> None:
    """An anchor generator's levels: one tuple of sizes and one of aspect ratios per level, all
    positive and finite, and one feature map per level."""
    if not sizes or len(sizes) != len(aspect_ratios):
        raise IRError(
            f"{name}: one tuple of sizes and of aspect ratios per level, got {len(sizes)} and {len(aspect_ratios)}"
        )
    for v in (*sizes, *aspect_ratios):
        if not v or any(not 0.0 < float(x) < float("inf") for x in v):
            raise IRError(f"{name}: sizes and aspect ratios must be positive and finite, got {v}")
    if num_features != len(sizes):
        raise IRError(f"{name}: one feature map per anchor level ({len(sizes)}), got {num_features}")


def anchor_list_type(op: Any, operand_types: Sequence[Type]) -> SequenceType:
    """An anchor generator's result (QAT and integer): one float32 ``(anchors, 4)`` tensor per image
    of ``images`` (N, C, H, W), counting each feature map's (..., H, W) positions times its level's
    sizes and aspect ratios; wrong operand types are refused naming ``op``."""
    images, feats = operand_types[0], operand_types[1:]
    if not isinstance(images, TensorType) or images.rank != 4:
        raise IRError(f"{op.name}: images must be an (N, C, H, W) tensor, got {images}")
    count = 0
    for level, t in enumerate(feats):
        if not isinstance(t, TensorType) or t.rank < 2:
            raise IRError(f"{op.name}: feature maps must be tensors (..., H, W), got {t}")
        count += t.shape[-2] * t.shape[-1] * len(op.sizes[level]) * len(op.aspect_ratios[level])
    one = TensorType((count, 4), DType.float32)
    return SequenceType(tuple(one for _ in range(images.shape[0])), "list")


def anchor_float_op(op: Any) -> type | None:
    """The float module class an anchor generator op stands for: torchvision's when installed."""
    return _torchvision_class("torchvision.models.detection.rpn", "AnchorGenerator") or (op.module_types or (None,))[0]


@register_op
@attrs.frozen
class QAnchorGenerator(_CallOp):
    """torchvision's ``AnchorGenerator`` on the shapes of ``images`` (N, C, H, W) and of the
    feature maps (one per level): one float32 ``(anchors, 4)`` tensor per image. ``in_scales``
    are the inputs' scales as converted (the anchors never read values)."""

    name: ClassVar[str] = "qanchor_generator"
    operand_names: ClassVar[tuple[str, ...]] = ()

    sizes: tuple[tuple[float, ...], ...] = attrs.field(converter=lambda v: _numbers(v))
    aspect_ratios: tuple[tuple[float, ...], ...] = attrs.field(converter=lambda v: _numbers(v))
    in_scales: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    num_features: int = 1

    def __attrs_post_init__(self) -> None:
        check_anchor_levels(self.name, self.sizes, self.aspect_ratios, self.num_features)

    def num_inputs(self) -> int:
        return 1 + self.num_features

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QAnchorGenerator, list[Value]]:
        """Bind ``forward(image_list, feature_maps)`` (:func:`bind_anchor_call`)."""
        return bind_anchor_call(self, args, kwargs)

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (inputs[0], list(inputs[1:])), {}

    def result_type(self, shape: Sequence[int]) -> TensorType:
        return TensorType(tuple(shape), DType.float32)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        anchor_list_type(self, operand_types)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return anchor_list_type(self, operand_types)

    def float_op(self) -> type | None:
        return anchor_float_op(self)

    @classmethod
    def from_module(cls, m: Any) -> QAnchorGenerator:
        n = int(m.num_input_scales)
        return cls(
            sizes=m.sizes,
            aspect_ratios=m.aspect_ratios,
            in_scales=tuple(per_tensor_scale(m, f"input_scale_{i}") for i in range(n)),
            num_features=len(m.sizes),
        )
