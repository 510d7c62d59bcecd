"""QAT math layer ops: a prepared model's LayerNorm, Softmax, GLU, PReLU and Div.

Each holds the layer's hyper-parameters as attributes and its fake quants as
:class:`~qir.ir.ops.qat.FakeQuantSpec` attributes; the state (LayerNorm's and PReLU's float
``weight`` / ``bias``, every fake quant's buffers) arrives as ``constant`` operands keyed by
state-dict name:

* ``qat_layer_norm``: ``out_fq(layer_norm(x, normalized_shape, weight, bias, eps))``;
* ``qat_softmax``: ``out_fq(e / sum(e))``, ``e = exp_fq(exp(x - max(x)))`` along ``dim`` (``exp_fq``
  the exp table's fixed scale);
* ``qat_glu``: ``out_fq(a * sigmoid_fq(sigmoid(b)))`` for the halves of the input along ``dim``;
* ``qat_prelu``: ``out_fq(prelu(x, weight))``, ``num_parameters`` slopes (one, or one per channel);
* ``qat_div``: ``out_fq(x / y)`` of two tensors (``qir.nn.Div``).

The ``quantize`` pass makes ``qlayer_norm`` / ``qsoftmax`` / ``qglu`` / ``qprelu`` / ``qdiv`` of them
(:mod:`qir.ir.ops.integer_math`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import activation as float_act
from qir.ir.ops import norm as float_norm
from qir.ir.ops.integer_codes import float_class
from qir.ir.ops.qat import FakeQuantSpec, fake_quant_roles, is_int, is_number
from qir.ir.ops.qat_layer import QATLayerOp
from qir.ir.types import TensorType, Type

__all__ = ["QATDiv", "QATGlu", "QATLayerNorm", "QATPrelu", "QATSoftmax"]


def _ints(v: Any) -> tuple[int, ...]:
    return (int(v),) if isinstance(v, int) else tuple(int(d) for d in v)


def _check_dim(op: str, t: Type, dim: int) -> TensorType:
    if not isinstance(t, TensorType):
        raise IRError(f"op {op!r} takes a tensor, got {t}")
    if not -t.rank <= dim < max(t.rank, 1):
        raise IRError(f"op {op!r}: dim {dim} is out of range for {t}")
    return t


@register_op
@attrs.frozen
class QATLayerNorm(QATLayerOp):
    """LayerNorm over the trailing ``normalized_shape``; state ``weight`` / ``bias`` (when present)
    then ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_layer_norm"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out_fq: FakeQuantSpec
    normalized_shape: tuple[int, ...] = attrs.field(converter=_ints)
    eps: float = 1e-5
    elementwise_affine: bool = True
    has_bias: bool = True

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        if not self.normalized_shape or any(d < 1 for d in self.normalized_shape):
            raise IRError(f"qat_layer_norm: normalized_shape must be positive sizes, got {self.normalized_shape}")
        if not is_number(self.eps) or not 0 < self.eps < 1:
            raise IRError(f"qat_layer_norm: eps must be a number in (0, 1), got {self.eps!r}")

    def param_roles(self) -> tuple[str, ...]:
        affine = ("weight",) if self.elementwise_affine else ()
        return affine + (("bias",) if self.has_bias else ()) + super().param_roles()

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x = operand_types[0]
        if not isinstance(x, TensorType) or tuple(x.shape[x.rank - len(self.normalized_shape) :]) != (
            self.normalized_shape
        ):
            raise IRError(f"qat_layer_norm: the input {x} does not end in normalized_shape {self.normalized_shape}")
        return x

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        for role, t in zip(self.param_roles(), operand_types[1:], strict=False):
            if role in ("weight", "bias") and (
                not isinstance(t, TensorType) or not t.dtype.is_float or tuple(t.shape) != self.normalized_shape
            ):
                raise IRError(
                    f"qat_layer_norm: {role} must be a float tensor of shape {self.normalized_shape}, got {t}"
                )

    def float_op(self) -> Op:
        ln: Any = float_norm.LayerNorm
        return ln(  # type: ignore[no-any-return]
            normalized_shape=self.normalized_shape, eps=self.eps, weight=self.elementwise_affine, bias=self.has_bias
        )


@register_op
@attrs.frozen
class QATSoftmax(QATLayerOp):
    """Softmax along ``dim``; state ``exp_post_process.*`` then ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_softmax"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out_fq: FakeQuantSpec
    exp_fq: FakeQuantSpec
    dim: int = -1

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        if not is_int(self.dim):
            raise IRError(f"qat_softmax: dim must be an integer, got {self.dim!r}")
        if self.exp_fq.observer.observer != "fixed_scale":
            raise IRError(f"qat_softmax: exp_fq is the exp table's fixed scale, got observer {self.exp_fq.observer}")

    def param_roles(self) -> tuple[str, ...]:
        return fake_quant_roles("exp_post_process", self.exp_fq) + super().param_roles()

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        return _check_dim(self.name, operand_types[0], self.dim)

    def float_op(self) -> Op:
        return float_act.Softmax(dim=self.dim)


@register_op
@attrs.frozen
class QATGlu(QATLayerOp):
    """GLU along ``dim``; state ``sigmoid_post_process.*`` then ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_glu"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out_fq: FakeQuantSpec
    sigmoid_fq: FakeQuantSpec
    dim: int = -1

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        if not is_int(self.dim):
            raise IRError(f"qat_glu: dim must be an integer, got {self.dim!r}")
        if self.sigmoid_fq.observer.axis is not None:
            raise IRError(f"qat_glu: sigmoid_fq must be per tensor, got axis {self.sigmoid_fq.observer.axis}")

    def param_roles(self) -> tuple[str, ...]:
        return fake_quant_roles("sigmoid_post_process", self.sigmoid_fq) + super().param_roles()

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x = _check_dim(self.name, operand_types[0], self.dim)
        d = self.dim % x.rank
        if x.shape[d] % 2:
            raise IRError(f"qat_glu: dimension {self.dim} of {x} has odd size; GLU halves it")
        return TensorType(tuple(s // 2 if i == d else s for i, s in enumerate(x.shape)), x.dtype)

    def float_op(self) -> Op:
        return float_act.Glu(dim=self.dim)


@register_op
@attrs.frozen
class QATPrelu(QATLayerOp):
    """PReLU with ``num_parameters`` slopes; state ``weight`` then ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_prelu"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out_fq: FakeQuantSpec
    num_parameters: int = 1

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        if not is_int(self.num_parameters) or self.num_parameters < 1:
            raise IRError(f"qat_prelu: num_parameters must be an integer >= 1, got {self.num_parameters!r}")

    def param_roles(self) -> tuple[str, ...]:
        return ("weight", *super().param_roles())

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x = operand_types[0]
        if not isinstance(x, TensorType):
            raise IRError(f"qat_prelu takes a tensor, got {x}")
        c = self.num_parameters
        if c > 1 and (x.rank < 2 or x.shape[1] != c):
            raise IRError(f"qat_prelu: {c} slopes need an input with {c} channels on dim 1, got {x}")
        return x

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        w = operand_types[1]
        if not isinstance(w, TensorType) or not w.dtype.is_float or tuple(w.shape) != (self.num_parameters,):
            raise IRError(f"qat_prelu: weight must be a float tensor of shape ({self.num_parameters},), got {w}")

    def float_op(self) -> Op:
        return float_act.Prelu()


@register_op
@attrs.frozen
class QATDiv(QATLayerOp):
    """``out_fq(x / y)``; state ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_div"
    operand_names: ClassVar[tuple[str, ...]] = ("x", "y")

    out_fq: FakeQuantSpec

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()

    def num_inputs(self) -> int:
        return 2

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        x, y = operand_types[0], operand_types[1]
        if not isinstance(x, TensorType) or not isinstance(y, TensorType):
            raise IRError(f"qat_div divides two tensors, got {x} and {y}")
        try:
            shape = torch.broadcast_shapes(tuple(x.shape), tuple(y.shape))
        except RuntimeError as e:
            raise IRError(f"qat_div: its inputs do not broadcast: {e}") from None
        return TensorType(tuple(shape), x.dtype)

    def float_op(self) -> type | None:
        return float_class("Div")
