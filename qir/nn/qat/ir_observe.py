"""The ``insert-observers`` pass's rules for qir's QAT layers: float layer -> QAT op + state.

One rule for every float layer that has a QAT op: rebuild the float module (the fused conv
from its IR op and tensors, or the opaque call's module object), give it the qconfig the
pass was given (its fake quants rebuilt from their :class:`~qir.ir.ops.qat.FakeQuantSpec`),
convert it with the QAT class's own ``from_float`` (the arithmetic module swapping uses),
and read the QAT op and its state back (qir/nn/qat/ir_ops*.py). The float op names and
module classes registered here are the layers ``prepare_qat_fx`` prepares by the pass; since
every rule runs the QAT class's ``from_float`` and reads its QAT op back, which layers get an
output observer (an average pool and a table lookup do; ReLU, max pool and a nearest resize keep
their input's scale) is exactly module swapping's. FloatFunctional method nodes have their rule
in :mod:`qir.nn.qat.ir_observe_functional`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from passes.insert_observers import ObserveRule, register_observer_rule
from qir.ir.op import ModuleOp, Op
from qir.ir.ops.core import Identity
from qir.ir.ops.qat import FakeQuantSpec, QATModuleOp
from qir.ir.ops.qat_sequence import QATLstmCell, QATMultiheadAttention
from qir.nn.modules.anchor_generator import AnchorGenerator as FloatAnchorGenerator
from qir.nn.modules.binary import Div as FloatDiv
from qir.nn.modules.grid_sample import GridSample as FloatGridSample
from qir.nn.modules.interpolate import Interpolate as FloatInterpolate
from qir.nn.modules.multi_scale_roi_align import MultiScaleRoIAlign as FloatMultiScaleRoIAlign
from qir.nn.modules.roi_align import RoIAlign as FloatRoIAlign
from qir.nn.modules.unary import UNARY_MODULES
from qir.nn.qat.activation import LUT_FLOAT_CLASSES
from qir.nn.qat.conv import QAT_CONV_CLASSES, fused_float_class
from qir.quantization.fake_quant_ir import fake_quant_factory
from qir.quantization.qat_classes import qat_class_for
from qir.quantization.qconfig import QConfig
from qir.quantization.stubs import FLOAT_DEQUANT_STUBS, FLOAT_QUANT_STUBS

__all__ = [
    "OBSERVED_MODULES",
    "OBSERVED_OPS",
    "OBSERVED_OPTIONAL_MODULES",
    "observe",
    "observe_keeping",
]

#: float IR ops whose layers become QAT ops, by family
OBSERVED_OPS = (
    # qat_conv
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose2d",
    "linear",
    # qat_max_pool2d / qat_avg_pool2d / qat_adaptive_avg_pool2d
    "max_pool2d",
    "avg_pool2d",
    "adaptive_avg_pool2d",
    # qat_relu / qat_relu6 / qat_identity / qat_dropout
    "relu",
    "relu6",
    "identity",
    "dropout",
    # qat_lut: torch's activations a UnaryLUT takes (LUT_FLOAT_CLASSES)
    *("sigmoid", "tanh", "silu", "hardswish", "hardsigmoid", "mish", "selu", "gelu", "elu", "celu"),
    *("leaky_relu", "softplus"),
    # qat_softmax, qat_layer_norm, qat_glu, qat_prelu, qat_interpolate (nn.Upsample)
    "softmax",
    "layer_norm",
    "glu",
    "prelu",
    "interpolate",
)
#: opaque module classes whose calls become QAT ops: the stubs, the fused conv / linear modules
#: a fused model holds (re-preparing a calibrated model traces its fused float model), qir's own
#: float modules (traced as leaves): Interpolate, Div, GridSample, the unary LUT modules, and the
#: torch modules of the op families above, which prepare generates for functional calls
#: (``torch.sigmoid`` -> ``nn.Sigmoid``, ``F.softmax`` -> ``nn.Softmax``) as opaque calls
OBSERVED_MODULES: tuple[type, ...] = (
    *FLOAT_QUANT_STUBS,
    *FLOAT_DEQUANT_STUBS,
    *dict.fromkeys(fused_float_class(cls) for cls in QAT_CONV_CLASSES.values()),
    FloatInterpolate,
    FloatDiv,
    FloatGridSample,
    FloatRoIAlign,
    FloatMultiScaleRoIAlign,
    FloatAnchorGenerator,
    *UNARY_MODULES.values(),
    *LUT_FLOAT_CLASSES,
    *(nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.ReLU, nn.ReLU6, nn.Identity, nn.Upsample),
    *(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Softmax, nn.LayerNorm, nn.GLU, nn.PReLU),
)


def _float_module(op: Op, module: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The float module the layer is: the opaque call's object, or rebuilt from the float op."""
    if module is not None:
        return module
    if isinstance(op, Identity):
        return nn.Identity()
    if not isinstance(op, ModuleOp):
        raise NotImplementedError(f"op {op.name!r} is not a module's op")
    return op.to_module(tensors)


def observe(
    op: Op,
    module: Any,
    tensors: dict[str, torch.Tensor],
    activation: FakeQuantSpec | None,
    weight: FakeQuantSpec | None,
) -> tuple[QATModuleOp, dict[str, torch.Tensor], nn.Module]:
    """The QAT op of one float layer, its new state (weight, bias, fake-quant buffers) by role,
    and the QAT module holding that state (emit installs it instead of building it again)."""
    float_module = _float_module(op, module, tensors)
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
    return qat_op, {role: state[role] for role in qat_op.param_roles()}, qat


def observe_keeping(qat_op_class: type[QATModuleOp], fields: Callable[[Op], dict[str, Any]]) -> ObserveRule:
    """The rule of a layer whose QAT op (of ``qat_op_class``) keeps call-site fields of the float op
    (an LSTM cell called with a state or not, an attention's masks and flags): the module is the
    same either way (its builder ignores them), so :func:`observe` builds it and ``fields(op)``
    (which raises NotImplementedError for a call it cannot take) sets them on the QAT op."""

    def rule(
        op: Op,
        module: Any,
        tensors: dict[str, torch.Tensor],
        activation: FakeQuantSpec | None,
        weight: FakeQuantSpec | None,
    ) -> tuple[QATModuleOp, dict[str, torch.Tensor], nn.Module]:
        kept = fields(op)
        qat_op, state, qat = observe(op, module, tensors, activation, weight)
        if not isinstance(qat_op, qat_op_class):
            raise TypeError(f"op {op.name!r}: expected {qat_op_class.name!r}, got {qat_op.name!r}")
        return attrs.evolve(qat_op, **kept), state, qat

    return rule


def _lstm_cell_fields(op: Op) -> dict[str, Any]:
    return {"has_state": bool(getattr(op, "has_state", False))}


def _attention_fields(op: Op) -> dict[str, Any]:
    if getattr(op, "is_causal", False):
        raise NotImplementedError("MultiheadAttention: is_causal is not implemented; pass the causal mask as attn_mask")
    flags = ("need_weights", "average_attn_weights", "key_padding_mask", "attn_mask")
    return {f: bool(getattr(op, f)) for f in flags}


#: optional libraries' module classes, by qualified name (torchvision is never imported here)
OBSERVED_OPTIONAL_MODULES = (
    "torchvision.ops.roi_align.RoIAlign",
    "torchvision.ops.poolers.MultiScaleRoIAlign",
    "torchvision.models.detection.anchor_utils.AnchorGenerator",
)


def _register() -> None:
    for name in OBSERVED_OPS:
        register_observer_rule(name, observe)
    for qualified in OBSERVED_OPTIONAL_MODULES:
        register_observer_rule(qualified, observe)
    register_observer_rule("lstm_cell", observe_keeping(QATLstmCell, _lstm_cell_fields))
    register_observer_rule("multihead_attention", observe_keeping(QATMultiheadAttention, _attention_fields))
    for cls in OBSERVED_MODULES:
        register_observer_rule(cls, observe)


_register()
