"""Op rules of the integer sequence layers: ``qlstm_cell`` and ``qmultihead_attention``.

Neither has a kernel of its own. The cell is composed of the kernels every other layer uses:
``linear`` for the two projections (the conv / linear rule, so engines and exactness proofs
are shared), ``add`` (the add rule), ``lut`` (sigmoid, tanh), ``mul`` (exact product, one
requantization), ``rescale`` (the cell state onto the qint8 tanh input) and ``shape_fn``
chunks. Attention is ``linear`` projections, ``shape_fn`` head splits, ``matmul`` (exact
product, one requantization with the 1/√D folded in), the ``softmax`` kernel, ``reduce_sum`` /
``rescale`` for the returned weights. The rules read the op's attributes and its integer state
operands (constants), and return one lowered value per result, as the op's tuple.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common.lower import LowerContext, LoweringError, OpRule, RuleNode, shape_call, tensor_ref
from backends.common.lower_rules import lower_conv
from backends.common.numerics import AddParams
from backends.common.program import ValueRef
from backends.common.rule_state import layer_path, layer_state
from backends.common.rules_conv import ConvLayer
from backends.common.rules_functional import add_attrs
from backends.common.rules_math import emit_softmax
from qir.ir.graph import Node
from qir.ir.ops.integer import QConv

__all__ = ["OP_RULES", "op_qlstm_cell", "op_qmultihead_attention"]


def _linear(
    ctx: LowerContext, node: Node, proj: str, in_scale: float, out: Any, state: dict[str, torch.Tensor], x: ValueRef
) -> ValueRef:
    """One projection through the conv / linear rule, its constants named ``<path>.<proj>.*``."""
    op: Any = node.op
    lin = QConv(kind="linear", out=out, in_scales=(in_scale,), march=op.march)
    tensors = {r: state[f"{proj}.{r}"] for r in lin.param_roles()}
    target = f"{layer_path(node)}.{proj}"
    return lower_conv(ctx, RuleNode(node.name, target, (x,)), ConvLayer(lin, tensors), [x], {})


def _add(ctx: LowerContext, node: Node, ins: list[str], p: Any, dtype: str, hint: str) -> str:
    """The integer add of two codes; ``p`` is the op's ``(swap, shift, qscale, multiplier, out_shift)``."""
    return ctx.emit("add", ins, add_attrs(AddParams(*p), dtype), {}, node.name, hint)


def _requant(ctx: LowerContext, node: Node, key: str, ins: list[str], kernel: str, hint: str) -> str:
    op: Any = node.op
    mult, shift, dtype = op.requant_dict()[key]
    attrs = {"out_dtype": dtype.name, "multiplier": int(mult), "shift": int(shift)}
    return ctx.emit(kernel, ins, attrs, {}, node.name, hint)


def _chunks(ctx: LowerContext, node: Node, x: str) -> list[str]:
    parts = shape_call(ctx, node, "chunk", [ValueRef(x), 4], {"dim": 1})
    return [shape_call(ctx, node, "getitem", [parts, k]).name for k in range(4)]


def _lut(ctx: LowerContext, node: Node, x: str, what: str, table: str, state: dict[str, torch.Tensor]) -> str:
    tgt = layer_path(node)
    const = ctx.const(f"{tgt}.{table}", state[table])
    return ctx.emit("lut", [x], {"what": what}, {"table": const}, node.name, f"{tgt}.{table.removesuffix('_table')}")


def _state_pair(node: Node, operands: list[Any]) -> tuple[Any, Any]:
    """The lowered h and c: two operands, or, when the call passed another cell's whole output
    (``whole_hx``), the two elements of that one operand (the producing rule's ``(h', c')`` pair)."""
    op: Any = node.op
    if not op.whole_hx:
        return operands[1], operands[2]
    hx = operands[1]
    if not (isinstance(hx, (tuple, list)) and len(hx) == 2):
        raise LoweringError(
            f"node '{node.name}': LSTMCell '{layer_path(node)}' reads its state as one value, which must be a "
            f"pair (h, c) of codes (another cell's whole output); got {type(hx).__name__}"
        )
    return hx[0], hx[1]


def op_qlstm_cell(ctx: LowerContext, node: Node, operands: list[Any]) -> tuple[ValueRef, ValueRef]:
    op: Any = node.op
    tgt, state = layer_path(node), layer_state(node, operands)
    x = tensor_ref(operands[0], node)
    if ctx.values[x].dim() != 2:
        raise LoweringError(f"node '{node.name}': LSTMCell '{tgt}' takes a 2-dimensional input (batch, features)")
    gates = _linear(ctx, node, "ih", op.in_scales[0], op.ih_out, state, ValueRef(x)).name
    c: str | None = None
    if op.has_state:
        h, c = (tensor_ref(v, node, what) for v, what in zip(_state_pair(node, operands), ("h", "c"), strict=True))
        hh = _linear(ctx, node, "hh", op.in_scales[1], op.hh_out, state, ValueRef(h)).name
        gates = _add(ctx, node, [gates, hh], op.gates_add, "qint8", f"{tgt}.gates")
    if ctx.values[gates].dtype != torch.int8:
        raise LoweringError(f"node '{node.name}': LSTMCell '{tgt}': the gates must be qint8 codes (tables)")
    sig = _lut(ctx, node, gates, "sigmoid", "sigmoid_table", state)
    i, f, _, o = _chunks(ctx, node, sig)
    g = _lut(ctx, node, _chunks(ctx, node, gates)[2], "tanh", "tanh_g_table", state)
    ig = _requant(ctx, node, "ig", [i, g], "mul", f"{tgt}.ig")
    if c is None:
        c_new = ig
    else:
        fc = _requant(ctx, node, "fc", [f, c], "mul", f"{tgt}.fc")
        c_new = _add(ctx, node, [fc, ig], op.cell_add, op.cell.dtype.name, f"{tgt}.cell")
    c8 = _requant(ctx, node, "c8", [c_new], "rescale", f"{tgt}.cell_tanh_input")
    tc = _lut(ctx, node, c8, "tanh", "tanh_c_table", state)
    h_new = _requant(ctx, node, "h", [o, tc], "mul", f"{tgt}.h")
    return ValueRef(h_new), ValueRef(c_new)


def op_qmultihead_attention(ctx: LowerContext, node: Node, operands: list[Any]) -> Any:
    op: Any = node.op
    tgt, state = layer_path(node), layer_state(node, operands)
    inputs = op.module_inputs(operands)
    ins = [tensor_ref(v, node, k) for k, v in zip(("query", "key", "value"), inputs[:3], strict=True)]
    if ctx.values[ins[0]].dim() != 3:
        raise LoweringError(f"node '{node.name}': MultiheadAttention '{tgt}' takes 3-dimensional inputs")
    if not op.batch_first:
        ins = [shape_call(ctx, node, "transpose", [ValueRef(x), 0, 1]).name for x in ins]
    h = int(op.num_heads)
    d = int(op.embed_dim) // h
    heads: list[ValueRef] = []
    for i, (proj, x) in enumerate(zip(("q_proj", "k_proj", "v_proj"), ins, strict=True)):
        y = _linear(ctx, node, proj, op.in_scales[i], op.proj_outs[i], state, ValueRef(x))
        length = int(ctx.values[y.name].shape[1])
        y = shape_call(ctx, node, "reshape", [y, [-1, length, h, d]])  # the batch stays free
        heads.append(shape_call(ctx, node, "transpose", [y, 1, 2]))  # (N, H, L, D)
    q, k, v = heads
    kt = shape_call(ctx, node, "transpose", [k, -2, -1])
    scores = _requant(ctx, node, "scores", [q.name, kt.name], "matmul", f"{tgt}.scores")
    lq, lk = int(ctx.values[q.name].shape[2]), int(ctx.values[k.name].shape[2])
    attn = _attention_softmax(ctx, node, op.masks(inputs), state, scores, h, lq, lk)
    c = _requant(ctx, node, "context", [attn.name, v.name], "matmul", f"{tgt}.context")
    length = int(ctx.values[c].shape[2])
    merged = shape_call(
        ctx,
        node,
        "reshape",
        [shape_call(ctx, node, "transpose", [ValueRef(c), 1, 2]), [-1, length, int(op.embed_dim)]],
    )
    out = _linear(ctx, node, "out_proj", op.context.scale[0], op.out, state, merged)
    if not op.batch_first:
        out = shape_call(ctx, node, "transpose", [out, 0, 1])
    if not op.need_weights:
        return out, None
    if op.average_attn_weights:
        mult, shift, dtype = op.requant_dict()["weights_mean"]
        attrs = {
            "dims": [1],
            "keepdim": False,
            "out_dtype": dtype.name,
            "n": h,
            "multiplier": int(mult),
            "shift": int(shift),
        }
        return out, ValueRef(ctx.emit("reduce_sum", [attn.name], attrs, {}, node.name, f"{tgt}.weights"))
    return out, ValueRef(_requant(ctx, node, "weights", [attn.name], "rescale", f"{tgt}.weights"))


def _attention_softmax(
    ctx: LowerContext,
    node: Node,
    masks: dict[str, Any],
    state: dict[str, torch.Tensor],
    scores: str,
    h: int,
    lq: int,
    lk: int,
) -> ValueRef:
    """The softmax of the scores, with the masks: finite float entries added as codes on the scores'
    grid (an exact saturating add), excluded entries (bool True, ``-inf``) left out of the softmax."""
    op: Any = node.op
    tgt = layer_path(node)
    table = state["softmax.table"]
    inputs: list[str] = []
    roles: list[str] = []
    consts: dict[str, str] = {}
    soft = False
    for role, v in masks.items():
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
    dtype = op.softmax.dtype.name
    if not roles and not consts:
        return emit_softmax(
            ctx,
            node,
            f"{tgt}.softmax",
            scores,
            int(op.softmax_dim),
            int(op.softmax_multiplier),
            int(op.softmax_shift),
            dtype,
            table,
        )
    attrs = {"inputs": roles, "heads": h, "lq": lq, "lk": lk}
    if soft:
        scale = float(torch.tensor(op.scores.scale[0], dtype=torch.float32))
        codes = ctx.emit(
            "attention_mask_codes", inputs, {**attrs, "scale": scale}, consts, node.name, f"{tgt}.mask_codes"
        )
        add = {"swap": False, "add_shift": 0, "qscale": 1, "multiplier": 1, "shift": 0, "out_dtype": "qint8"}
        scores = ctx.emit("add", [scores, codes], add, {}, node.name, f"{tgt}.masked_scores")
    masked = ctx.emit("attention_masked", inputs, attrs, consts, node.name, f"{tgt}.masked")
    sattrs = {"multiplier": int(op.softmax_multiplier), "shift": int(op.softmax_shift), "out_dtype": dtype}
    return ValueRef(
        ctx.emit(
            "masked_softmax",
            [scores, masked],
            sattrs,
            {"table": ctx.const(f"{tgt}.softmax.table", table)},
            node.name,
            f"{tgt}.softmax",
        )
    )


#: IR op name -> its shared rule (the marches register them: backends/<march>/rules.py)
OP_RULES: dict[str, OpRule] = {
    "qlstm_cell": op_qlstm_cell,
    "qmultihead_attention": op_qmultihead_attention,
}
