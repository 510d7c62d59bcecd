"""Integer resize: ``qinterpolate``, nearest (codes copied, scale and dtype kept) or bilinear
(fixed-point taps, one requantization with ``multiplier`` / ``shift``; docs/modules.md
"Bilinear interpolation").

The output size comes from ``size`` / ``scale_factor`` as the module holds them, or from a
run-time ``size`` operand (FPN's ``interpolate(x, size=lateral.shape[2:])``): then
``run_time_size`` is set and the op takes that value as its second operand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
from torch import nn

from qir.ir.graph import Value
from qir.ir.op import CannotInfer, IRError, Op, register_op
from qir.ir.ops import vision as float_ops
from qir.ir.ops.integer import IntegerModuleOp, _floats
from qir.ir.ops.integer_codes import check_int, check_scales, code_dtype, float_shaped, per_tensor_scale
from qir.ir.types import DType, QuantSpec, TensorType, Type
from qir.ir.unknown_dims import stand_in_size

__all__ = ["QInterpolate"]

_MODES = ("nearest", "bilinear")
#: largest output a resize may allocate (the layout functions' bound, docs/security.md)
_MAX_ELEMENTS = 2**28


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


@register_op
@attrs.frozen
class QInterpolate(IntegerModuleOp):
    """Resize (N, C, H, W) codes: ``mode`` nearest or bilinear (see the module docstring)."""

    name: ClassVar[str] = "qinterpolate"
    operand_names: ClassVar[tuple[str, ...]] = ("input", "size")

    mode: str
    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    size: Any = attrs.field(default=None, converter=_plain)
    scale_factor: Any = attrs.field(default=None, converter=_plain)
    align_corners: bool | None = None
    recompute_scale_factor: bool | None = None
    multiplier: int = 0
    shift: int = 0
    run_time_size: bool = False

    def __attrs_post_init__(self) -> None:
        if self.mode not in _MODES:
            raise IRError(f"qinterpolate: mode must be one of {_MODES}, got {self.mode!r}")
        check_int(self.name, "multiplier", self.multiplier, -(2**31) + 1, 2**31 - 1)
        check_int(self.name, "shift", self.shift, 0, 62 - 2 * 15)  # the taps' 2**-2B folds into it
        if len(self.in_scales) != 1 or self.out.axis is not None:
            raise IRError(f"qinterpolate: one per-tensor input and output scale, got {self.in_scales} and {self.out}")
        if self.mode == "nearest" and self.out.scale != self.in_scales:
            raise IRError(f"qinterpolate: nearest copies codes, so out scale {self.out.scale} must be {self.in_scales}")

    def num_inputs(self) -> int:
        return 2 if self.run_time_size else 1

    def bind_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[QInterpolate, list[Value]]:
        """Bind ``forward(x, size=None)``; nearest takes its dtype from the input codes."""
        if len(args) + len(kwargs) > 2 or len(args) > 2 or set(kwargs) - {"size"} or not args:
            raise IRError(f"qinterpolate binds forward(x, size=None), got {len(args)} args and {sorted(kwargs)}")
        x = args[0]
        size = args[1] if len(args) > 1 else kwargs.get("size")
        if not isinstance(x, Value) or not (size is None or isinstance(size, Value)):
            raise IRError("qinterpolate: the input and a run-time size must be graph values")
        op = attrs.evolve(self, run_time_size=size is not None)
        if self.mode == "nearest":
            op = attrs.evolve(op, out=attrs.evolve(self.out, dtype=code_dtype(self.name, x.type)))
        return op, [x] if size is None else [x, size]

    def module_call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (inputs[0],), ({"size": inputs[1]} if self.run_time_size else {})

    def evaluate(self, ctx: Any, operands: Sequence[Any]) -> Any:
        module = self.to_module({})
        args, kwargs = self.module_call(self.module_inputs(operands))
        return module(*args, **kwargs)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        if self.run_time_size:
            raise CannotInfer("qinterpolate: the output size is a run-time value")
        self.verify_(operand_types)  # an output size that is not empty nor huge
        return float_shaped(self, operand_types, self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        if not self.run_time_size and (self.size is None) == (self.scale_factor is None):
            raise IRError("qinterpolate: give exactly one of size / scale_factor (or a run-time size operand)")
        x = operand_types[0]
        if isinstance(x, TensorType) and x.rank != 4:
            raise IRError(f"qinterpolate resizes (N, C, H, W) codes, got {x}")
        if isinstance(x, TensorType) and not self.run_time_size:
            self._check_out_size(x)
        dtype = code_dtype(self.name, operand_types[0])
        if self.mode == "nearest" and dtype is not self.out.dtype:
            raise IRError(
                f"qinterpolate: nearest keeps the input's dtype {dtype.name}, but out is {self.out.dtype.name}"
            )
        if self.run_time_size and isinstance(operand_types[1], TensorType):
            raise IRError(f"qinterpolate: the run-time size is a sequence of ints, got {operand_types[1]}")
        if self.mode == "bilinear" and self.out.dtype is DType.qint32:
            raise IRError("qinterpolate: bilinear requantizes to qint8 / qint16, not qint32")

    def _check_out_size(self, x: TensorType) -> None:
        """A positive output size of at most 2**28 elements (a hostile scale factor allocates nothing)."""
        n, c, h, w = x.shape
        unknown = stand_in_size()  # with unknown input sizes the cap bounds the output per unit of them
        if self.size is not None:
            oh, ow = (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)[-2:]
            eh, ew = float(oh), float(ow)
        else:
            sf = self.scale_factor
            fh, fw = (sf, sf) if isinstance(sf, (int, float)) else tuple(sf)
            if not (0 < float(fh) < float("inf") and 0 < float(fw) < float("inf")):
                raise IRError(f"qinterpolate: scale_factor must be positive and finite, got {sf!r}")
            oh, ow = math.floor(h * float(fh)), math.floor(w * float(fw))
            eh = float(fh) if h == unknown else float(oh)
            ew = float(fw) if w == unknown else float(ow)
        en, ec = (1 if d == unknown else d for d in (n, c))
        if int(oh) < 1 or int(ow) < 1 or en * ec * eh * ew > _MAX_ELEMENTS:
            raise IRError(f"qinterpolate: output size {oh}x{ow} of {x} is empty or over {_MAX_ELEMENTS} elements")

    def float_op(self) -> Op:
        up = nn.Upsample(self.size, self.scale_factor, self.mode, self.align_corners)
        return float_ops.Interpolate.from_module(up)

    @classmethod
    def from_module(cls, m: Any) -> QInterpolate:
        s_in = per_tensor_scale(m, "input_scale_0")
        bilinear = m.mode == "bilinear"
        if m.mode not in _MODES:
            raise NotImplementedError(f"Interpolate mode {m.mode!r} has no integer op")
        return cls(
            mode=str(m.mode),
            out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype if bilinear else DType.qint8),
            in_scales=(s_in,),
            size=m.size,
            scale_factor=m.scale_factor,
            align_corners=m.align_corners,
            recompute_scale_factor=m.recompute_scale_factor,
            multiplier=int(m.multiplier) if bilinear else 0,
            shift=int(m.shift) if bilinear else 0,
        )
