"""Op rules of the integer math layers: ``qprelu``, ``qglu``, ``qsoftmax``, ``qlayer_norm``.

Each rule reads the op's attributes and its integer state operands (constants) and never
builds a module. PReLU, Softmax and LayerNorm have their own kernels (``kernels/prelu.py``,
``kernels/softmax.py``, ``kernels/layer_norm.py``); GLU is composed from existing ones:
``chunk``, the sigmoid ``lut`` and ``mul`` (exact product, one requantization). The marches
register these under the op names (backends/<march>/rules.py).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common.lower import LowerContext, LoweringError, OpRule, shape_call, tensor_ref
from backends.common.math_rules import (
    LN_EXTRA_BITS,
    LN_Z_BITS,
    SOFTMAX_MAX_LENGTH,
    LayerNormParams,
    layer_norm_eps_term,
)
from backends.common.program import ValueRef
from backends.common.rule_state import layer_path, layer_state
from qir.ir.graph import Node

__all__ = ["OP_RULES", "emit_softmax", "op_qglu", "op_qlayer_norm", "op_qprelu", "op_qsoftmax"]


def _int8_input(ctx: LowerContext, node: Node, x: str, what: str) -> None:
    if ctx.values[x].dtype != torch.int8:
        raise LoweringError(
            f"node '{node.name}': {what} '{layer_path(node)}' takes qint8 codes (a 256-entry table), got "
            f"{ctx.values[x].dtype}; give its producer a qint8 qconfig"
        )


def op_qprelu(ctx: LowerContext, node: Node, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    x, path, state = tensor_ref(operands[0], node), layer_path(node), layer_state(node, operands)
    attrs = {"pos_multiplier": int(op.pos_multiplier), "pos_shift": int(op.pos_shift), "out_dtype": op.out.dtype.name}
    consts = {
        "neg_multiplier": ctx.const(f"{path}.neg_multiplier", state["neg_multiplier"]),
        "neg_shift": ctx.const(f"{path}.neg_shift", state["neg_shift"]),
    }
    return ValueRef(ctx.emit("prelu", [x], attrs, consts, node.name, path))


def op_qglu(ctx: LowerContext, node: Node, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    x, path, state = tensor_ref(operands[0], node), layer_path(node), layer_state(node, operands)
    _int8_input(ctx, node, x, "GLU")
    halves = shape_call(ctx, node, "chunk", [operands[0], 2], {"dim": int(op.dim)})
    a = shape_call(ctx, node, "getitem", [halves, 0])
    b = shape_call(ctx, node, "getitem", [halves, 1])
    table = ctx.const(f"{path}.table", state["table"])
    sig = ctx.emit("lut", [b.name], {"what": "sigmoid"}, {"table": table}, node.name, f"{path}.sigmoid")
    attrs = {"out_dtype": op.out.dtype.name, "multiplier": int(op.multiplier), "shift": int(op.shift)}
    return ValueRef(ctx.emit("mul", [a.name, sig], attrs, {}, node.name, path))


def emit_softmax(
    ctx: LowerContext, node: Any, path: str, x: str, dim: int, multiplier: int, shift: int, out_dtype: str, table: Any
) -> ValueRef:
    """One ``softmax`` instruction on qint8 codes ``x`` (``node``: its ``name`` is the source);
    also the attention's softmax when it has no masks (backends/common/lower_rules_sequence.py)."""
    if ctx.values[x].dtype != torch.int8:
        raise LoweringError(
            f"node '{node.name}': Softmax '{path}' takes qint8 codes (a 256-entry table), got "
            f"{ctx.values[x].dtype}; give its producer a qint8 qconfig"
        )
    if ctx.values[x].shape[dim] > SOFTMAX_MAX_LENGTH:
        raise LoweringError(
            f"node '{node.name}': Softmax '{path}' sums more than {SOFTMAX_MAX_LENGTH} "
            "entries; the int32 sum cannot hold them"
        )
    attrs = {"dim": dim, "multiplier": multiplier, "shift": shift, "out_dtype": out_dtype}
    consts = {"table": ctx.const(f"{path}.table", table)}
    return ValueRef(ctx.emit("softmax", [x], attrs, consts, node.name, path))


def op_qsoftmax(ctx: LowerContext, node: Node, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    x, state = tensor_ref(operands[0], node), layer_state(node, operands)
    return emit_softmax(
        ctx,
        node,
        layer_path(node),
        x,
        int(op.dim),
        int(op.multiplier),
        int(op.shift),
        op.out.dtype.name,
        state["table"],
    )


def op_qlayer_norm(ctx: LowerContext, node: Node, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    x, path, state = tensor_ref(operands[0], node), layer_path(node), layer_state(node, operands)
    p = LayerNormParams(op.eps_term_dict(), state["multiplier"], state["shift"], state["bias"])
    try:
        f, e = layer_norm_eps_term(p, ctx.values[x].dtype, f"node '{node.name}'")
    except (ValueError, NotImplementedError) as err:
        raise LoweringError(str(err)) from None
    attrs = {
        "ndims": len(op.normalized_shape),
        "eps_bits": f,
        "eps_term": e,
        "z_bits": LN_Z_BITS,
        "extra_bits": LN_EXTRA_BITS,
        "out_dtype": op.out.dtype.name,
    }
    consts = {
        "multiplier": ctx.const(f"{path}.multiplier", state["multiplier"]),
        "shift": ctx.const(f"{path}.shift", state["shift"]),
        "bias": ctx.const(f"{path}.bias", state["bias"].to(torch.int32)),
    }
    return ValueRef(ctx.emit("layer_norm", [x], attrs, consts, node.name, path))


#: IR op name -> its shared rule (the marches register them: backends/<march>/rules.py)
OP_RULES: dict[str, OpRule] = {
    "qprelu": op_qprelu,
    "qglu": op_qglu,
    "qsoftmax": op_qsoftmax,
    "qlayer_norm": op_qlayer_norm,
}
