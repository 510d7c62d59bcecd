"""Lowering rules of PReLU, GLU, Softmax and LayerNorm (imported at the end of ``lower_rules``).

Like every rule, these read the quantized modules' integer buffers and fixed scales and never
call a module's forward. PReLU, Softmax and LayerNorm have their own kernels
(``kernels/prelu.py``, ``kernels/softmax.py``, ``kernels/layer_norm.py``); GLU is composed from
existing ones: ``chunk``, the sigmoid ``lut`` and ``mul`` (exact product, one requantization).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common.lower import LowerContext, LoweringError, RuleNode, register_module_rule, shape_call, tensor_ref
from backends.common.math_rules import (
    LN_EXTRA_BITS,
    LN_Z_BITS,
    SOFTMAX_MAX_LENGTH,
    LayerNormParams,
    layer_norm_eps_term,
)
from backends.common.program import ValueRef
from qir.nn import quantized as Q

__all__ = ["lower_glu", "lower_layer_norm", "lower_prelu", "lower_softmax"]

Node = RuleNode


def _dt(m: Any) -> str:
    return str(m.dtype.name)


def _int8_input(ctx: LowerContext, node: Node, x: str, what: str) -> None:
    if ctx.values[x].dtype != torch.int8:
        raise LoweringError(
            f"node '{node.name}': {what} '{node.target}' takes qint8 codes (a 256-entry table), got "
            f"{ctx.values[x].dtype}; give its producer a qint8 qconfig"
        )


def lower_prelu(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    attrs = {"pos_multiplier": int(m.pos_multiplier), "pos_shift": int(m.pos_shift), "out_dtype": _dt(m)}
    consts = {
        "neg_multiplier": ctx.const(f"{node.target}.neg_multiplier", m.neg_multiplier),
        "neg_shift": ctx.const(f"{node.target}.neg_shift", m.neg_shift),
    }
    return ValueRef(ctx.emit("prelu", [x], attrs, consts, node.name, str(node.target)))


def lower_glu(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    _int8_input(ctx, node, x, "GLU")
    halves = shape_call(ctx, node, "chunk", [args[0], 2], {"dim": int(m.dim)})
    a = shape_call(ctx, node, "getitem", [halves, 0])
    b = shape_call(ctx, node, "getitem", [halves, 1])
    table = ctx.const(f"{node.target}.table", m.table)
    sig = ctx.emit("lut", [b.name], {"what": "sigmoid"}, {"table": table}, node.name, f"{node.target}.sigmoid")
    attrs = {"out_dtype": _dt(m), "multiplier": int(m.multiplier), "shift": int(m.shift)}
    return ValueRef(ctx.emit("mul", [a.name, sig], attrs, {}, node.name, str(node.target)))


def lower_softmax(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    _int8_input(ctx, node, x, "Softmax")
    if ctx.values[x].shape[int(m.dim)] > SOFTMAX_MAX_LENGTH:
        raise LoweringError(
            f"node '{node.name}': Softmax '{node.target}' sums more than {SOFTMAX_MAX_LENGTH} "
            "entries; the int32 sum cannot hold them"
        )
    attrs = {"dim": int(m.dim), "multiplier": int(m.multiplier), "shift": int(m.shift), "out_dtype": _dt(m)}
    consts = {"table": ctx.const(f"{node.target}.table", m.table)}
    return ValueRef(ctx.emit("softmax", [x], attrs, consts, node.name, str(node.target)))


def lower_layer_norm(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    p = LayerNormParams(m.eps_terms, m.multiplier, m.shift, m.bias)
    try:
        f, e = layer_norm_eps_term(p, ctx.values[x].dtype, f"node '{node.name}'")
    except (ValueError, NotImplementedError) as err:
        raise LoweringError(str(err)) from None
    attrs = {
        "ndims": len(m.normalized_shape),
        "eps_bits": f,
        "eps_term": e,
        "z_bits": LN_Z_BITS,
        "extra_bits": LN_EXTRA_BITS,
        "out_dtype": _dt(m),
    }
    consts = {
        "multiplier": ctx.const(f"{node.target}.multiplier", m.multiplier),
        "shift": ctx.const(f"{node.target}.shift", m.shift),
        "bias": ctx.const(f"{node.target}.bias", m.bias.to(torch.int32)),
    }
    return ValueRef(ctx.emit("layer_norm", [x], attrs, consts, node.name, str(node.target)))


register_module_rule(Q.PReLU, lower_prelu)
register_module_rule(Q.GLU, lower_glu)
register_module_rule(Q.Softmax, lower_softmax)
register_module_rule(Q.LayerNorm, lower_layer_norm)
