"""The IR's ``qat_functional`` op for qir's QAT FloatFunctional: reader (method call -> op) and builder.

A method call ``ff.<method>(...)`` of a prepared model's FloatFunctional becomes one
``qat_functional`` node (:mod:`qir.ir.ops.qat_functional`); the builder rebuilds the module from
the op's output fake quant, holding the node's state tensors, so every method of the rebuilt
module observes and fake-quantizes as the prepared model's does.
"""

from __future__ import annotations

from typing import Any

import torch

from qir.ir.ops.qat_functional import QATFunctional, register_qat_functional
from qir.nn.qat.functional import FloatFunctional
from qir.nn.qat.ir_ops import build_fake_quant, fake_quant_factory, fake_quant_spec
from qir.quantization.qconfig import QConfig

__all__: list[str] = []


def _read(m: Any, method: str, bound: dict[str, Any]) -> tuple[QATFunctional, list[Any]]:
    apq = m.activation_post_process
    spec = None if apq is None else fake_quant_spec(apq, f"FloatFunctional.{method}: activation_post_process")
    return QATFunctional.from_call(spec, method, bound)


def _build(op: Any, tensors: dict[str, torch.Tensor]) -> FloatFunctional:
    if op.out_fq is None:
        return FloatFunctional(None, QConfig(activation=None, weight=None))
    fq = build_fake_quant(op.out_fq, tensors, "activation_post_process")
    return FloatFunctional(fq, QConfig(activation=fake_quant_factory(op.out_fq), weight=None))


register_qat_functional(FloatFunctional, _read, _build)
