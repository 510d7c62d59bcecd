"""The base of the QAT layer ops whose only state is their output fake quant.

Pools, activations, table lookups and resizes of a prepared model (``qir.nn.qat``) compute their
float op and fake-quantize the result with ``activation_post_process`` — or keep their input's
scale and have none (ReLU, max pool, nearest resize). Their ops (``qat_pool``, ``qat_activation``,
``qat_resize``) hold the layer's hyper-parameters as attributes and, when the layer has one, the
output fake quant as ``out_fq`` with its state as ``activation_post_process.*`` constants; the
result type is the float op's (the fake quant keeps shape and dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from qir.ir.op import IRError, Op
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp, fake_quant_roles
from qir.ir.types import DType, TensorType, Type

__all__ = ["QATLayerOp"]


@attrs.frozen
class QATLayerOp(QATModuleOp):
    """A QAT layer: ``out_fq(float_op(x))``, or ``float_op(x)`` for one without an ``out_fq`` field."""

    def fake_quant(self) -> FakeQuantSpec | None:
        fq: FakeQuantSpec | None = getattr(self, "out_fq", None)
        return fq

    def check_out_fq(self) -> None:
        fq = self.fake_quant()
        if fq is not None and fq.observer.axis is not None:
            raise IRError(f"{self.name}: the output fake quant must be per tensor, got axis {fq.observer.axis}")

    def param_roles(self) -> tuple[str, ...]:
        return fake_quant_roles("activation_post_process", self.fake_quant())

    def compute(self, *operands: Any) -> Any:
        raise NotImplementedError(f"op {self.name!r} runs as its QAT module (evaluate)")

    def infer_type(self, operand_types: Sequence[Type]) -> Type:
        """The float op's result on a float input of the input's shape (the input's type when the
        layer keeps its shape, ``float_op`` None or a module class)."""
        x = operand_types[0]
        if not isinstance(x, TensorType):
            raise IRError(f"op {self.name!r} takes a tensor, got {x}")
        fop = self.float_op()
        if not isinstance(fop, Op):
            return x
        try:
            t = fop.infer_type([TensorType(x.shape, DType.float32)])
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            raise IRError(f"op {self.name!r} rejects its input {x}: {e}") from None
        return TensorType(t.shape, x.dtype) if isinstance(t, TensorType) else t

    def verify_(self, operand_types: Sequence[Type]) -> None:
        super().verify_(operand_types)
        self.infer_type(operand_types)
