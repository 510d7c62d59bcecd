"""Integer ops for the converted model's boundary stubs: QuantStub (float -> codes) and
DeQuantStub (codes -> float).

They are ops of their own rather than the IR's ``quantize`` / ``dequantize``: emitting them
must rebuild the stub modules (their ``scale`` / ``input_scale_0`` buffers keep the
state-dict keys), and the operator tables list them under torch's stub classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from qir.ir.op import IRError, register_op
from qir.ir.ops.integer import IntegerModuleOp, _floats
from qir.ir.ops.integer_codes import check_scales, code_dtype, per_tensor_scale, shaped_like
from qir.ir.types import DType, QuantSpec, TensorType, Type

__all__ = ["QDequantStub", "QQuantStub"]


@register_op
@attrs.frozen
class QQuantStub(IntegerModuleOp):
    """Float to codes: ``saturate(floor(x / scale + 0.5))`` at ``out`` (docs/semantics.md)."""

    name: ClassVar[str] = "qquant_stub"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out: QuantSpec

    def __attrs_post_init__(self) -> None:
        if self.out.axis is not None or self.out.dtype not in (DType.qint8, DType.qint16):
            raise IRError(f"qquant_stub: out must be a per-tensor qint8 / qint16 spec, got {self.out}")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return shaped_like(self.name, operand_types[0], self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "out scales", self.out.scale)
        x = operand_types[0]
        if not isinstance(x, TensorType) or not x.dtype.is_float:
            raise IRError(f"qquant_stub takes a float tensor, got {x}")

    def float_op(self) -> type:
        from torch.ao.quantization import QuantStub

        return QuantStub

    @classmethod
    def from_module(cls, m: Any) -> QQuantStub:
        return cls(out=QuantSpec((per_tensor_scale(m, "scale"),), m.dtype))


@register_op
@attrs.frozen
class QDequantStub(IntegerModuleOp):
    """Codes to float32: ``code * scale``, per tensor or (a high-precision qint32 output) per
    channel along ``axis``: negative, as the module stores it (``-scale.dim()``), and taken
    modulo the input's rank."""

    name: ClassVar[str] = "qdequant_stub"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    in_scales: tuple[float, ...] = attrs.field(converter=_floats)
    axis: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.in_scales or any(not 0.0 < s < float("inf") for s in self.in_scales):
            raise IRError(f"qdequant_stub: in_scales must be positive and finite, got {self.in_scales[:4]}")
        if self.axis is None and len(self.in_scales) != 1:
            raise IRError(f"qdequant_stub: {len(self.in_scales)} scales need a channel axis")
        if self.axis is not None and self.axis >= 0:
            raise IRError(f"qdequant_stub: axis counts from the last dim (negative), got {self.axis}")

    def result_type(self, shape: Sequence[int]) -> TensorType:
        return TensorType(tuple(shape), DType.float32)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return shaped_like(self.name, operand_types[0], None)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "in_scales", self.in_scales)
        x = operand_types[0]
        code_dtype(self.name, x)
        assert isinstance(x, TensorType)
        if self.axis is not None:
            # the axis wraps modulo the rank, as the stub applies it: a (C, 1, 1) scale (axis -3)
            # also fits a flattened (N, C) output
            if x.rank == 0 or x.shape[self.axis % x.rank] != len(self.in_scales):
                raise IRError(f"qdequant_stub: {len(self.in_scales)} scales along axis {self.axis} do not fit {x}")

    def float_op(self) -> type:
        from torch.ao.quantization import DeQuantStub

        return DeQuantStub

    @classmethod
    def from_module(cls, m: Any) -> QDequantStub:
        if getattr(m, "scale_from_input", False):
            raise IRError(
                f"{type(m).__name__} has no scale of its own: each call dequantizes with its operand's (from_call)"
            )
        return cls(in_scales=tuple(m.scale.detach().reshape(-1).tolist()), axis=m.axis)

    @classmethod
    def from_call(cls, m: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> QDequantStub:
        """The op of one call of stub ``m``: a stub that dequantizes with its input's scale
        (``scale_from_input``, one DeQuantStub shared by outputs of different scales) takes the
        scale its operand's type carries; any other stub its own."""
        if not getattr(m, "scale_from_input", False):
            return cls.from_module(m)
        x = args[0] if len(args) == 1 and not kwargs else None
        t = getattr(x, "type", None)
        q = t.quant if isinstance(t, TensorType) else None
        if q is None:
            raise IRError(
                f"a call of {type(m).__name__} '{getattr(m, 'path', '')}' dequantizes with its operand's scale, and "
                f"its operand ({t}) carries none; give this output its own DeQuantStub"
            )
        assert isinstance(t, TensorType)
        axis = None if q.axis is None else (q.axis % t.rank) - t.rank  # stored negative, as the module does
        return cls(in_scales=q.scale, axis=axis)
