"""The ``insert-observers`` pass's rules for qir's QAT layers: float layer -> QAT op + state.

One rule for every float layer that has a QAT op: rebuild the float module (the fused conv
from its IR op and tensors, or the opaque call's module object), give it the qconfig the
pass was given (its fake quants rebuilt from their :class:`~qir.ir.ops.qat.FakeQuantSpec`),
convert it with the QAT class's own ``from_float`` (the arithmetic module swapping uses),
and read the QAT op and its state back (qir/nn/qat/ir_ops.py). The float op names and
module classes registered here are the layers ``prepare_qat_fx`` prepares by the pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.ao.quantization import DeQuantStub as TorchDeQuantStub
from torch.ao.quantization import QuantStub as TorchQuantStub

from passes.insert_observers import register_observer_rule
from qir.ir.op import Op
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp
from qir.nn.qat.conv import QAT_CONV_CLASSES, fused_float_class
from qir.quantization.fake_quant_ir import fake_quant_factory
from qir.quantization.qat_classes import qat_class_for
from qir.quantization.qconfig import QConfig
from qir.quantization.stubs import DeQuantStub, QuantStub

__all__ = ["OBSERVED_MODULES", "OBSERVED_OPS", "observe"]

#: float IR ops whose layers become ``qat_conv``
OBSERVED_OPS = ("conv1d", "conv2d", "conv3d", "conv_transpose2d", "linear")
#: opaque module classes whose calls become QAT ops: the stubs, and the fused conv / linear
#: modules a fused model holds (re-preparing a calibrated model traces its fused float model)
OBSERVED_MODULES: tuple[type, ...] = (
    QuantStub,
    DeQuantStub,
    TorchQuantStub,
    TorchDeQuantStub,
    *dict.fromkeys(fused_float_class(cls) for cls in QAT_CONV_CLASSES.values()),
)


def observe(
    op: Op,
    module: Any,
    tensors: dict[str, torch.Tensor],
    activation: FakeQuantSpec | None,
    weight: FakeQuantSpec | None,
) -> tuple[QATModuleOp, dict[str, torch.Tensor]]:
    """The QAT op of one float layer and its new state (weight, bias, fake-quant buffers) by role."""
    float_module = module if module is not None else op.to_module(tensors)  # type: ignore[attr-defined]
    cls = qat_class_for(float_module)
    if cls is None:
        raise NotImplementedError(f"{type(float_module).__name__} has no QAT class")
    qconfig = QConfig(
        activation=None if activation is None else fake_quant_factory(activation),
        weight=None if weight is None else fake_quant_factory(weight),
    )
    qat = cls.from_float(float_module, qconfig)  # type: ignore[attr-defined]
    qat_op = QATModuleOp.from_module(qat)
    state = dict(qat.named_parameters(remove_duplicate=False)) | dict(qat.named_buffers(remove_duplicate=False))
    return qat_op, {role: state[role] for role in qat_op.param_roles()}


def _register() -> None:
    for name in OBSERVED_OPS:
        register_observer_rule(name, observe)
    for cls in OBSERVED_MODULES:
        register_observer_rule(cls, observe)


_register()
