"""Lowering rules of LSTMCell and MultiheadAttention (imported at the end of ``lower_rules``).

Neither has a kernel of its own. The cell is composed of the kernels every other module uses —
``linear`` for the two projections (the conv / linear rule, so engines and exactness proofs
are shared), ``add`` (the add rule), ``lut`` (sigmoid, tanh), ``mul`` (exact product, one
requantization), ``rescale`` (the cell state onto the qint8 tanh input) and ``shape_fn``
chunks. Attention is ``linear`` projections, ``shape_fn`` head splits, ``matmul`` (exact
product, one requantization with the 1/√D folded in), the ``softmax`` kernel, ``reduce_sum`` /
``rescale`` for the returned weights. Like every rule they read the quantized modules' buffers
and never call their forward.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch

from backends.common.lower import LowerContext, LoweringError, RuleNode, register_module_rule, shape_call, tensor_ref
from backends.common.lower_rules import lower_conv
from backends.common.numerics import AddParams
from backends.common.program import ValueRef
from backends.common.rules_functional import add_attrs
from backends.common.rules_math import emit_softmax
from qir.nn import quantized as Q

__all__ = ["lower_lstm_cell", "lower_multihead_attention"]

Node = RuleNode


class _Part(NamedTuple):
    """What ``lower_conv`` reads of a node, for a projection inside the cell."""

    name: str
    target: str


def _add(ctx: LowerContext, node: Node, ins: list[str], p: AddParams, dtype: str, hint: str) -> str:
    return ctx.emit("add", ins, add_attrs(p, dtype), {}, node.name, hint)


def _requant(ctx: LowerContext, node: Node, m: Any, key: str, ins: list[str], op: str, hint: str) -> str:
    mult, shift = m.rq[key]
    attrs = {"out_dtype": m.dtypes[key].name, "multiplier": int(mult), "shift": int(shift)}
    return ctx.emit(op, ins, attrs, {}, node.name, hint)


def _chunks(ctx: LowerContext, node: Node, x: str) -> list[str]:
    parts = shape_call(ctx, node, "chunk", [ValueRef(x), 4], {"dim": 1})
    return [shape_call(ctx, node, "getitem", [parts, k]).name for k in range(4)]


def lower_lstm_cell(
    ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]
) -> tuple[ValueRef, ValueRef]:
    tgt = str(node.target)
    x = tensor_ref(args[0], node)
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if (hx is not None) != m.has_state:
        raise LoweringError(
            f"node '{node.name}': LSTMCell '{tgt}' was converted for calls "
            f"{'with' if m.has_state else 'without'} (h, c) and is called "
            f"{'without' if hx is None else 'with'} them; use one module instance per call form"
        )
    if ctx.values[x].dim() != 2:
        raise LoweringError(f"node '{node.name}': LSTMCell '{tgt}' takes a 2-dimensional input (batch, features)")
    gates = lower_conv(ctx, cast(Node, _Part(node.name, f"{tgt}.ih")), m.ih, [ValueRef(x)], {}).name
    if hx is not None:
        h, c = tensor_ref(hx[0], node, "h"), tensor_ref(hx[1], node, "c")
        hh = lower_conv(ctx, cast(Node, _Part(node.name, f"{tgt}.hh")), m.hh, [ValueRef(h)], {}).name
        gates = _add(ctx, node, [gates, hh], m.gates_add, "qint8", f"{tgt}.gates")
    for v in (gates,):
        if ctx.values[v].dtype != torch.int8:
            raise LoweringError(f"node '{node.name}': LSTMCell '{tgt}': the gates must be qint8 codes (tables)")
    sig = ctx.emit(
        "lut",
        [gates],
        {"what": "sigmoid"},
        {"table": ctx.const(f"{tgt}.sigmoid_table", m.sigmoid_table)},
        node.name,
        f"{tgt}.sigmoid",
    )
    i, f, _, o = _chunks(ctx, node, sig)
    g_in = _chunks(ctx, node, gates)[2]
    g = ctx.emit(
        "lut",
        [g_in],
        {"what": "tanh"},
        {"table": ctx.const(f"{tgt}.tanh_g_table", m.tanh_g_table)},
        node.name,
        f"{tgt}.tanh_g",
    )
    ig = _requant(ctx, node, m, "ig", [i, g], "mul", f"{tgt}.ig")
    if hx is None:
        c_new = ig
    else:
        fc = _requant(ctx, node, m, "fc", [f, c], "mul", f"{tgt}.fc")
        c_new = _add(ctx, node, [fc, ig], m.cell_add, m.cell_dtype.name, f"{tgt}.cell")
    c8 = _requant(ctx, node, m, "c8", [c_new], "rescale", f"{tgt}.cell_tanh_input")
    tc = ctx.emit(
        "lut",
        [c8],
        {"what": "tanh"},
        {"table": ctx.const(f"{tgt}.tanh_c_table", m.tanh_c_table)},
        node.name,
        f"{tgt}.tanh_c",
    )
    h_new = _requant(ctx, node, m, "h", [o, tc], "mul", f"{tgt}.h")
    return ValueRef(h_new), ValueRef(c_new)


def _part(node: Node, what: str) -> Node:
    return cast(Node, _Part(node.name, f"{node.target}.{what}"))


def lower_multihead_attention(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    tgt = str(node.target)
    names = (
        "query",
        "key",
        "value",
        "key_padding_mask",
        "need_weights",
        "attn_mask",
        "average_attn_weights",
        "is_causal",
    )
    call = dict(zip(names, args, strict=False)) | kwargs
    if call.get("is_causal"):
        raise LoweringError(
            f"node '{node.name}': MultiheadAttention '{tgt}': is_causal is not implemented; pass the causal "
            "mask as attn_mask"
        )
    ins = [tensor_ref(call[k], node, k) for k in ("query", "key", "value")]
    if ctx.values[ins[0]].dim() != 3:
        raise LoweringError(f"node '{node.name}': MultiheadAttention '{tgt}' takes 3-dimensional inputs")
    if not m.batch_first:
        ins = [shape_call(ctx, node, "transpose", [ValueRef(x), 0, 1]).name for x in ins]
    h = int(m.num_heads)
    d = int(m.embed_dim) // h
    heads: list[ValueRef] = []
    for proj, x in zip(("q_proj", "k_proj", "v_proj"), ins, strict=True):
        y = lower_conv(ctx, _part(node, proj), getattr(m, proj), [ValueRef(x)], {})
        length = int(ctx.values[y.name].shape[1])
        y = shape_call(ctx, node, "reshape", [y, [-1, length, h, d]])  # the batch stays free
        heads.append(shape_call(ctx, node, "transpose", [y, 1, 2]))  # (N, H, L, D)
    q, k, v = heads
    kt = shape_call(ctx, node, "transpose", [k, -2, -1])
    scores = _requant(ctx, node, m, "scores", [q.name, kt.name], "matmul", f"{tgt}.scores")
    attn = _attention_softmax(
        ctx, node, m, call, scores, h, int(ctx.values[q.name].shape[2]), int(ctx.values[k.name].shape[2])
    )
    c = _requant(ctx, node, m, "context", [attn.name, v.name], "matmul", f"{tgt}.context")
    length = int(ctx.values[c].shape[2])
    merged = shape_call(
        ctx, node, "reshape", [shape_call(ctx, node, "transpose", [ValueRef(c), 1, 2]), [-1, length, int(m.embed_dim)]]
    )
    out = lower_conv(ctx, _part(node, "out_proj"), m.out_proj, [merged], {})
    if not m.batch_first:
        out = shape_call(ctx, node, "transpose", [out, 0, 1])
    if not call.get("need_weights", True):
        return out, None
    if call.get("average_attn_weights", True):
        mult, shift = m.rq["weights_mean"]
        attrs = {
            "dims": [1],
            "keepdim": False,
            "out_dtype": m.dtypes["weights_mean"].name,
            "n": h,
            "multiplier": int(mult),
            "shift": int(shift),
        }
        return out, ValueRef(ctx.emit("reduce_sum", [attn.name], attrs, {}, node.name, f"{tgt}.weights"))
    return out, ValueRef(_requant(ctx, node, m, "weights", [attn.name], "rescale", f"{tgt}.weights"))


def _attention_softmax(
    ctx: LowerContext, node: Node, m: Any, call: dict[str, Any], scores: str, h: int, lq: int, lk: int
) -> ValueRef:
    """The softmax of the scores, with the masks: finite float entries added as codes on the scores'
    grid (an exact saturating add), excluded entries (bool True, ``-inf``) left out of the softmax."""
    tgt = str(node.target)
    inputs: list[str] = []
    roles: list[str] = []
    consts: dict[str, str] = {}
    soft = False
    for role in ("attn_mask", "key_padding_mask"):
        v = call.get(role)
        if v is None:
            continue
        example = ctx.example(v)
        if not isinstance(example, torch.Tensor):
            raise LoweringError(f"node '{node.name}': MultiheadAttention '{tgt}': {role} must be a tensor")
        soft = soft or example.dtype != torch.bool
        if isinstance(v, ValueRef):
            inputs.append(v.name)
            roles.append(role)
        else:  # a constant (a buffer of the model): stored as uint8 (bool) or float32
            stored = v.to(torch.uint8) if v.dtype == torch.bool else v.to(torch.float32)
            consts[role] = ctx.const(f"{tgt}.{role}", stored)
    if not roles and not consts:
        sm = m.softmax
        dtype = sm.dtype.name
        return emit_softmax(
            ctx, node, f"{tgt}.softmax", scores, int(sm.dim), int(sm.multiplier), int(sm.shift), dtype, sm.table
        )
    attrs = {"inputs": roles, "heads": h, "lq": lq, "lk": lk}
    if soft:
        scale = float(torch.tensor(m.scores_scale, dtype=torch.float32))
        codes = ctx.emit(
            "attention_mask_codes", inputs, {**attrs, "scale": scale}, consts, node.name, f"{tgt}.mask_codes"
        )
        add = {"swap": False, "add_shift": 0, "qscale": 1, "multiplier": 1, "shift": 0, "out_dtype": "qint8"}
        scores = ctx.emit("add", [scores, codes], add, {}, node.name, f"{tgt}.masked_scores")
    masked = ctx.emit("attention_masked", inputs, attrs, consts, node.name, f"{tgt}.masked")
    sm = m.softmax
    sattrs = {"multiplier": int(sm.multiplier), "shift": int(sm.shift), "out_dtype": sm.dtype.name}
    return ValueRef(
        ctx.emit(
            "masked_softmax",
            [scores, masked],
            sattrs,
            {"table": ctx.const(f"{tgt}.softmax.table", sm.table)},
            node.name,
            f"{tgt}.softmax",
        )
    )


register_module_rule(Q.LSTMCell, lower_lstm_cell)
register_module_rule(Q.MultiheadAttention, lower_multihead_attention)
