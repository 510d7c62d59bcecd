"""The ``quantize`` pass's rule for ``qat_functional``: the FloatFunctional method call converts as
module swapping converts it — ``QFunctional.from_qat`` of the rebuilt QAT module at the call's
input scales — and becomes the integer op of the method's family (``qadd``, ``qcat``, ...), read
from the converted module by that op's own ``from_call``, so both paths run the same arithmetic."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from passes.quantize import register_quantize_rule
from qir.ir.op import IRError
from qir.ir.ops.integer import integer_method_op
from qir.nn.quantized.functional import QFunctional

__all__: list[str] = []


def _functional(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
    q = QFunctional.from_qat(op.to_module(tensors), list(scales), march)
    cls = integer_method_op(q, op.method)
    if cls is None:
        raise NotImplementedError(f"QFunctional.{op.method} has no integer op")
    # stand-ins for the operands: from_call only passes the tensor arguments through, in order
    # (a run-time number of add_scalar / mul_scalar stays an operand: it is not a literal)
    operands = [object() for _ in range(op.num_inputs())]
    method, args, kwargs = op.method_call(operands)
    bound = inspect.signature(getattr(q, method)).bind(*args, **kwargs)
    bound.apply_defaults()
    new, inputs = cls.from_call(q, method, dict(bound.arguments))  # type: ignore[attr-defined]
    if [id(v) for v in inputs] != [id(v) for v in operands]:
        raise IRError(f"qat_functional ({op.method}): the integer op takes its operands in another order")
    return new, {}


register_quantize_rule("qat_functional", _functional)
