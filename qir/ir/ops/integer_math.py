"""Integer math layers: PReLU, GLU, Softmax and LayerNorm on codes.

* ``qprelu``: the non-negative codes requantized with ``pos_multiplier`` / ``pos_shift``, the
  negative ones with the per-channel signed ``neg_multiplier`` / ``neg_shift`` (the slope
  folded in; docs/semantics.md "PReLU");
* ``qglu``: halves along ``dim``, a 256-entry sigmoid ``table`` on the second (its output at
  the ``sigmoid`` spec), the exact product with the first, one requantization;
* ``qsoftmax``: the int16 exp ``table`` over ``q - max(q)``, an exact sum and division
  (``multiplier`` / ``shift`` ~ ``1 / s_out``; docs/semantics.md "Softmax");
* ``qlayer_norm``: the exact mean and variance over the trailing ``normalized_shape``, the
  per-element affine ``multiplier`` / ``shift`` / ``bias``, and the epsilon term per input
  dtype (``eps_terms``: ``(dtype, f, E)``; docs/semantics.md "LayerNorm").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import activation as float_act
from qir.ir.ops import norm as float_norm
from qir.ir.ops.integer import IntegerModuleOp, _floats
from qir.ir.ops.integer_codes import check_int, check_scales, code_dtype, per_tensor_scale, shaped_like
from qir.ir.ops.integer_values import (
    MULTIPLIER_RANGE,
    SHIFT_RANGE,
    check_exp_table,
    check_int_values,
)
from qir.ir.types import DType, QuantSpec, TensorType, Type

__all__ = ["QGlu", "QLayerNorm", "QPrelu", "QSoftmax"]


@attrs.frozen
class _MathOp(IntegerModuleOp):
    """One per-tensor input scale, one per-tensor output spec."""

    out: QuantSpec
    in_scales: tuple[float, ...] = attrs.field(converter=_floats)

    def __attrs_post_init__(self) -> None:
        if len(self.in_scales) != 1 or self.out.axis is not None:
            raise IRError(f"{self.name}: one per-tensor input and output scale, got {self.in_scales} and {self.out}")
        # the integer attributes the layer's requantization reads: int64 arithmetic, shifts below 63
        for name in ("multiplier", "pos_multiplier"):
            if hasattr(self, name):
                check_int(self.name, name, getattr(self, name), -(2**31) + 1, 2**31 - 1)
        for name in ("shift", "pos_shift"):
            if hasattr(self, name):
                check_int(self.name, name, getattr(self, name), 0, 62)

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        """The input's shape at ``out`` (GLU halves its ``dim``)."""
        return shaped_like(self.name, operand_types[0], self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "scales", (*self.in_scales, *self.out.scale))
        code_dtype(self.name, operand_types[0])


def _spec(m: Any) -> tuple[QuantSpec, tuple[float]]:
    return QuantSpec((per_tensor_scale(m, "scale"),), m.dtype), (per_tensor_scale(m, "input_scale_0"),)


def _int8_input(op: str, t: Type, what: str) -> None:
    if code_dtype(op, t) is not DType.qint8:
        raise IRError(f"{op}: {what} reads qint8 codes, got {t}; give the producer a qint8 qconfig")


def _table(op: str, t: Type, n: int) -> None:
    if not isinstance(t, TensorType) or t.shape != (n,) or t.dtype.is_float:
        raise IRError(f"{op}: table must hold {n} integer entries, got {t}")


@register_op
@attrs.frozen
class QPrelu(_MathOp):
    """PReLU on codes: ``requant(q)`` with ``pos_multiplier`` / ``pos_shift`` for ``q >= 0``,
    with the channel's ``neg_multiplier`` / ``neg_shift`` (dim 1) for ``q < 0``."""

    name: ClassVar[str] = "qprelu"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    state_roles: ClassVar[tuple[str, ...]] = ("neg_multiplier", "neg_shift")

    pos_multiplier: int = 0
    pos_shift: int = 0

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        x, m, s = operand_types
        assert isinstance(m, TensorType) and isinstance(s, TensorType)
        if m.rank != 1 or s.shape != m.shape:
            raise IRError(f"qprelu: neg_multiplier and neg_shift must be equal 1-d tensors, got {m} and {s}")
        c = m.shape[0]
        if c > 1 and isinstance(x, TensorType) and (x.rank < 2 or x.shape[1] != c):
            raise IRError(f"qprelu: {c} slopes need an input with {c} channels on dim 1, got {x}")

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        """The negative side's signed multipliers (the slope folded in) and right shifts."""
        if "neg_multiplier" in state:
            check_int_values(self.name, "neg_multiplier", state["neg_multiplier"], *MULTIPLIER_RANGE)
        if "neg_shift" in state:
            check_int_values(self.name, "neg_shift", state["neg_shift"], *SHIFT_RANGE)

    def float_op(self) -> Op:
        return float_act.Prelu()

    @classmethod
    def from_module(cls, m: Any) -> QPrelu:
        out, ins = _spec(m)
        return cls(out=out, in_scales=ins, pos_multiplier=int(m.pos_multiplier), pos_shift=int(m.pos_shift))


@register_op
@attrs.frozen
class QGlu(_MathOp):
    """GLU on qint8 codes: ``a, b = chunk(q, 2, dim)``, ``requant(a * table[b + 128])`` with
    ``multiplier`` / ``shift``; the table's entries are codes at the ``sigmoid`` spec."""

    name: ClassVar[str] = "qglu"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    state_roles: ClassVar[tuple[str, ...]] = ("table",)

    sigmoid: QuantSpec
    dim: int = -1
    multiplier: int = 0
    shift: int = 0

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        self.verify_(operand_types)  # dim in range, an even size
        x = operand_types[0]
        assert isinstance(x, TensorType)
        shape = list(x.shape)
        shape[self.dim] //= 2
        return TensorType(tuple(shape), self.out.dtype, self.out)

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        check_scales(self.name, "sigmoid scale", self.sigmoid.scale)
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise IRError(f"qglu: dim must be an integer, got {self.dim!r}")
        _int8_input(self.name, operand_types[0], "the 256-entry sigmoid table")
        _table(self.name, operand_types[1], 256)
        x = operand_types[0]
        if isinstance(x, TensorType):
            if not -x.rank <= self.dim < x.rank:
                raise IRError(f"qglu: dim {self.dim} is out of range for {x}")
            if x.shape[self.dim] % 2:
                raise IRError(f"qglu: dim {self.dim} of {x} must have an even size (two halves)")

    def float_op(self) -> Op:
        return float_act.Glu(dim=self.dim)

    @classmethod
    def from_module(cls, m: Any) -> QGlu:
        out, ins = _spec(m)
        sig = QuantSpec((per_tensor_scale(m, "sigmoid_scale"),), m.sigmoid_dtype)
        return cls(
            out=out, in_scales=ins, sigmoid=sig, dim=int(m.dim), multiplier=int(m.multiplier), shift=int(m.shift)
        )


@register_op
@attrs.frozen
class QSoftmax(_MathOp):
    """Softmax on qint8 codes along ``dim``: ``e = table[q - max(q) + 255]`` (int16),
    ``round(e * multiplier / (sum(e) * 2**shift))``."""

    name: ClassVar[str] = "qsoftmax"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    state_roles: ClassVar[tuple[str, ...]] = ("table",)

    dim: int = -1
    multiplier: int = 0
    shift: int = 0

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        _int8_input(self.name, operand_types[0], "the 256-entry exp table")
        _table(self.name, operand_types[1], 256)
        x = operand_types[0]
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise IRError(f"qsoftmax: dim must be an integer, got {self.dim!r}")
        if isinstance(x, TensorType) and not -x.rank <= self.dim < x.rank:
            raise IRError(f"qsoftmax: dim {self.dim} is out of range for {x}")

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        """The exp table's entries, as the division reads them (:func:`check_exp_table`)."""
        if "table" in state:
            x = operand_types[0]
            n = x.shape[self.dim] if isinstance(x, TensorType) and x.rank else 1
            check_exp_table(self.name, "table", state["table"], n, self.multiplier, self.shift)

    def float_op(self) -> Op:
        return float_act.Softmax(dim=self.dim)

    @classmethod
    def from_module(cls, m: Any) -> QSoftmax:
        out, ins = _spec(m)
        return cls(out=out, in_scales=ins, dim=int(m.dim), multiplier=int(m.multiplier), shift=int(m.shift))


def _eps_terms(v: Any) -> tuple[tuple[str, int, int], ...]:
    """``eps_terms`` as printable data: ``(dtype name, f, E)`` per input dtype, sorted."""
    if isinstance(v, dict):
        items = [(str(k).removeprefix("torch."), *fe) for k, fe in v.items()]
    else:
        items = list(v)
    return tuple(sorted((str(d), int(f), int(e)) for d, f, e in items))


@register_op
@attrs.frozen
class QLayerNorm(_MathOp):
    """LayerNorm on codes over the trailing ``normalized_shape``: int64 mean and variance, the
    epsilon term ``(f, E)`` of the input's dtype (``eps_terms``), the per-element affine
    ``multiplier`` / ``shift`` and int32 ``bias`` at ``s_out / 2**8``."""

    name: ClassVar[str] = "qlayer_norm"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)
    state_roles: ClassVar[tuple[str, ...]] = ("multiplier", "shift", "bias")

    normalized_shape: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(int(d) for d in v))
    eps: float = 1e-5
    elementwise_affine: bool = True
    has_bias: bool = True
    eps_terms: tuple[tuple[str, int, int], ...] = attrs.field(default=(), converter=_eps_terms)

    def eps_term_dict(self) -> dict[torch.dtype, tuple[int, int]]:
        """``eps_terms`` as the integer rule reads it: torch dtype -> ``(f, E)``."""
        out: dict[torch.dtype, tuple[int, int]] = {}
        for d, f, e in self.eps_terms:
            if d not in ("int8", "int16"):
                raise IRError(f"qlayer_norm: eps_terms names input dtype {d!r}; the codes it reads are int8 or int16")
            # the integer rule's ranges (docs/semantics.md "LayerNorm"): f eps bits <= 8, E below
            # 2**59 (-1: eps too large for this dtype), so the int64 variance term cannot overflow
            if not (0 <= f <= 8 and -1 <= e < 2**59):
                raise IRError(f"qlayer_norm: eps_terms for {d} must be (f in [0, 8], E in [-1, 2**59)), got ({f}, {e})")
            out[getattr(torch, d)] = (f, e)
        return out

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        self.eps_term_dict()
        x = operand_types[0]
        k = len(self.normalized_shape)
        if isinstance(x, TensorType) and tuple(x.shape[x.rank - k :]) != self.normalized_shape:
            raise IRError(f"qlayer_norm: input {x} does not end in normalized_shape {self.normalized_shape}")
        n = 1
        for d in self.normalized_shape:
            n *= d
        if not 1 <= n <= 2**20:  # the integer rule's exact sums hold at most 2**20 elements
            raise IRError(f"qlayer_norm: normalized_shape {self.normalized_shape} must hold 1 to 2**20 elements")
        for role, t in zip(self.state_roles, operand_types[1:], strict=True):
            if not isinstance(t, TensorType) or t.numel != n or t.dtype.is_float:
                raise IRError(f"qlayer_norm: {role} must hold {n} integers (one per normalized element), got {t}")

    def verify_state(self, operand_types: Sequence[Type], state: dict[str, torch.Tensor]) -> None:
        """The per-element affine requantization: multipliers, right shifts, int32 biases."""
        if "multiplier" in state:
            check_int_values(self.name, "multiplier", state["multiplier"], *MULTIPLIER_RANGE)
        if "shift" in state:
            check_int_values(self.name, "shift", state["shift"], *SHIFT_RANGE)
        if "bias" in state:
            check_int_values(self.name, "bias", state["bias"], -(2**31), 2**31 - 1, " (an int32)")

    def float_op(self) -> Op:
        ln: Any = float_norm.LayerNorm  # attrs' converter=tuple types the field as a bare Iterable
        return ln(  # type: ignore[no-any-return]
            normalized_shape=self.normalized_shape, eps=self.eps, weight=self.elementwise_affine, bias=self.has_bias
        )

    @classmethod
    def from_module(cls, m: Any) -> QLayerNorm:
        out, ins = _spec(m)
        return cls(
            out=out,
            in_scales=ins,
            normalized_shape=m.normalized_shape,
            eps=float(m.eps),
            elementwise_affine=bool(m.elementwise_affine),
            has_bias=bool(m.has_bias),
            eps_terms=m.eps_terms,
        )
