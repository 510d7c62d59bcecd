"""What the op rules of the integer layers read off a node: its module path and its integer state."""

from __future__ import annotations

from typing import Any

import torch

from backends.common.lower import LoweringError
from qir.ir.graph import Node

__all__ = ["layer_path", "layer_state"]


def layer_path(node: Node) -> str:
    """The instructions' hint and the constants' prefix: the layer's module path."""
    return node.scope or node.name


def layer_state(node: Node, operands: list[Any]) -> dict[str, torch.Tensor]:
    """The op's integer state by role; refuses a state operand computed at run time."""
    op: Any = node.op
    out: dict[str, torch.Tensor] = {}
    for role, v in zip(op.param_roles(), op.module_params(operands), strict=True):
        if not isinstance(v, torch.Tensor):
            raise LoweringError(
                f"node '{node.name}': {op.name} state '{role}' must be a constant, not a run-time value"
            )
        out[role] = v
    return out
