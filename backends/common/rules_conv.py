"""The lowering rule of the ``qconv`` op: integer conv / linear (+ fused add, + ReLU / ReLU6).

The rule body is :func:`backends.common.lower_rules.lower_conv` (engine choice, exactness
bounds, kernel attributes), which reads a conv layer's integer data by attribute name; here
that data comes from the op's attributes and its state operands, never from a module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from backends.common.lower import LowerContext, RuleNode
from backends.common.lower_rules import lower_conv
from backends.common.program import ValueRef
from qir.ir.graph import Node

__all__ = ["ConvLayer", "lower_qconv"]

_KIND = {
    "conv1d": "Conv1d",
    "conv2d": "Conv2d",
    "conv3d": "Conv3d",
    "conv_transpose2d": "ConvTranspose2d",
    "linear": "Linear",
}


class ConvLayer:
    """A ``qconv`` op's data under the attribute names the conv rule reads."""

    def __init__(self, op: Any, tensors: dict[str, torch.Tensor]) -> None:
        self.kind = _KIND[op.kind]
        self.has_add = bool(op.add)
        self.act = op.act
        self.dtype = op.out.dtype
        self.add_multiplier, self.add_shift, self.extra_bits = op.add_multiplier, op.add_shift, op.extra_bits
        self.weight = tensors["weight"]
        self.bias = tensors["bias"]
        self.multiplier = tensors["multiplier"]
        self.shift = tensors["shift"]
        self.relu6_bound = tensors["relu6_bound"]
        self.hp = op.hyper_parameters()


def lower_qconv(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    op: Any = node.op
    k = op.num_inputs()
    tensors = dict(zip(op.param_roles(), operands[k:], strict=True))
    inputs = list(operands[:k])
    return lower_conv(
        ctx, RuleNode(node.name, node.scope or node.name, tuple(inputs)), ConvLayer(op, tensors), inputs, {}
    )
