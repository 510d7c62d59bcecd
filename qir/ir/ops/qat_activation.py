"""QAT activation ops: ReLU / ReLU6 / Identity / Dropout (input's scale kept) and table lookups.

* ``qat_relu``, ``qat_relu6``, ``qat_identity``: no state; converted to ``qrelu`` / ``qrelu6`` /
  ``qidentity``;
* ``qat_dropout``: dropout with probability ``p`` of torch's ``kind`` (``Dropout``, ``Dropout2d``,
  ...) in training, the identity in eval; converted to ``qidentity``;
* ``qat_lut``: ``out_fq(f(x))`` for an elementwise ``f`` named by ``function`` (a torch activation
  class, ``Sigmoid``, or one of qir's unary modules, ``Exp``) built with ``function_args`` (its
  constructor's literal fields: ``(("negative_slope", 0.1),)``); converted to ``qlut``, whose
  tables the conversion builds from ``f``. Which names are functions is the module library's
  registration: the builder refuses any other.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from torch import nn

from qir.ir.op import IRError, Op, register_op
from qir.ir.ops import elementwise as float_ops
from qir.ir.ops.integer_codes import float_class
from qir.ir.ops.qat import FakeQuantSpec, is_number
from qir.ir.ops.qat_layer import QATLayerOp

__all__ = ["QATDropout", "QATIdentity", "QATLut", "QATRelu", "QATRelu6"]

_LITERALS = (bool, int, float, str, type(None))


@register_op
@attrs.frozen
class QATRelu(QATLayerOp):
    """``relu(x)``: keeps the input's scale."""

    name: ClassVar[str] = "qat_relu"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    def float_op(self) -> Op:
        return float_ops.Relu()


@register_op
@attrs.frozen
class QATRelu6(QATLayerOp):
    """``relu6(x)``: keeps the input's scale (converted, the bound is the code of 6.0)."""

    name: ClassVar[str] = "qat_relu6"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    def float_op(self) -> Op:
        return float_ops.Relu6()


@register_op
@attrs.frozen
class QATIdentity(QATLayerOp):
    """The identity (removed at deployment)."""

    name: ClassVar[str] = "qat_identity"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    def float_op(self) -> type:
        return nn.Identity


_DROPOUTS = ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d")


@register_op
@attrs.frozen
class QATDropout(QATLayerOp):
    """Dropout of torch's ``kind`` with probability ``p`` in training; the identity in eval."""

    name: ClassVar[str] = "qat_dropout"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    p: float = 0.5
    kind: str = "Dropout"

    def __attrs_post_init__(self) -> None:
        if self.kind not in _DROPOUTS:
            raise IRError(f"qat_dropout: kind must be one of {_DROPOUTS}, got {self.kind!r}")
        if not is_number(self.p) or not 0.0 <= self.p <= 1.0:
            raise IRError(f"qat_dropout: p must be a probability in [0, 1], got {self.p!r}")

    def float_op(self) -> type:
        cls: type = getattr(nn, self.kind)
        return cls


def _args(v: Any) -> tuple[tuple[str, Any], ...]:
    return tuple((str(k), a) for k, a in v)


@register_op
@attrs.frozen
class QATLut(QATLayerOp):
    """``out_fq(f(x))``, ``f`` the module ``function(**function_args)``; state ``activation_post_process.*``."""

    name: ClassVar[str] = "qat_lut"
    operand_names: ClassVar[tuple[str, ...]] = ("input",)

    out_fq: FakeQuantSpec
    function: str
    function_args: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_args)

    def __attrs_post_init__(self) -> None:
        self.check_out_fq()
        if not self.function.isidentifier():
            raise IRError(f"qat_lut: function must name a function module (an identifier), got {self.function!r}")
        names = [k for k, _ in self.function_args]
        if names != sorted(set(names)) or not all(k.isidentifier() for k in names):
            raise IRError(f"qat_lut: function_args must be (name, value) pairs sorted by unique name, got {names}")
        for k, v in self.function_args:
            if not isinstance(v, _LITERALS):
                raise IRError(f"qat_lut: function_args {k} must be a bool, int, float, str or None, got {v!r}")

    def float_op(self) -> type | None:
        cls = float_class(self.function) or getattr(nn, self.function, None)
        return cls if isinstance(cls, type) else None
