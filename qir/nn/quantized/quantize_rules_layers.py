"""The ``quantize`` pass's rules for the QAT pool, activation, table-lookup, resize and math ops.

Each rebuilds the QAT module from the op (``qir.nn.qat``'s builder, sharing the state tensors),
converts it with the quantized class module swapping uses (``QUANTIZED_MODULE_MAP``: the
:func:`~qir.nn.quantized.quantize_rules.swapped_rule` the stubs use too) and reads the
integer op from the converted module, with its integer state (average-pool multipliers, tables)
under the same state-dict prefix. A layer that keeps its input's dtype (max pool, ReLU, nearest
resize) takes it from the input codes when the pass binds the integer op to its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from passes.quantize import register_quantize_rule
from qir.ir.ops.integer import QConv
from qir.ir.ops.integer_elementwise import QDiv, QIdentity, QLut, QRelu, QRelu6
from qir.ir.ops.integer_math import QGlu, QLayerNorm, QPrelu, QSoftmax
from qir.ir.ops.integer_pool import QAdaptiveAvgPool2d, QAvgPool2d, QMaxPool2d
from qir.ir.ops.integer_resize import QInterpolate
from qir.ir.ops.integer_sampling import QAnchorGenerator, QGridSample, QMultiScaleRoIAlign, QRoIAlign
from qir.nn.quantized.conv import QUANTIZED_CONV_CLASSES
from qir.nn.quantized.quantize_rules import swapped_rule

__all__: list[str] = []


def _conv_bn(op: Any, tensors: dict[str, torch.Tensor], scales: Sequence[torch.Tensor], march: str) -> Any:
    """Fold the batch norm (as convert_fx does before tracing) and convert the folded conv."""
    folded = op.to_module(tensors).fold()  # new folded weight / bias tensors: the node's state is kept
    q = QUANTIZED_CONV_CLASSES[type(folded)].from_qat(folded, list(scales), march)
    new = QConv.from_module(q)
    return new, {role: getattr(q, role) for role in new.param_roles()}


register_quantize_rule("qat_conv_bn", _conv_bn)
for _qat, _integer in (
    ("qat_max_pool2d", QMaxPool2d),
    ("qat_avg_pool2d", QAvgPool2d),
    ("qat_adaptive_avg_pool2d", QAdaptiveAvgPool2d),
    ("qat_relu", QRelu),
    ("qat_relu6", QRelu6),
    ("qat_identity", QIdentity),
    ("qat_dropout", QIdentity),
    ("qat_lut", QLut),
    ("qat_interpolate", QInterpolate),
    ("qat_layer_norm", QLayerNorm),
    ("qat_softmax", QSoftmax),
    ("qat_glu", QGlu),
    ("qat_prelu", QPrelu),
    ("qat_div", QDiv),
    ("qat_grid_sample", QGridSample),
    ("qat_roi_align", QRoIAlign),
    ("qat_multi_scale_roi_align", QMultiScaleRoIAlign),
    ("qat_anchor_generator", QAnchorGenerator),
):
    register_quantize_rule(_qat, swapped_rule(_integer))
