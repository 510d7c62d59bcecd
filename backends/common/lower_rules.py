"""The lowering rules every march shares: op rules keyed by IR op name (the layout ops, relu,
identity, dropout; pad and getattr in lower_rules_codes), the conv / linear rule body the
integer layers' op rules call (``lower_conv``), and the legacy rules the IR walk's adapter
reaches: the torch functions / tensor methods a converted graph keeps between layers.

Each rule reads the layer's integer data and fixed scales and derives integer parameters
with :mod:`backends.common.numerics`; it never calls a module's forward. Marches override a
rule by registering their own under their name (``register_op_rule("permute", rule, march="bayes")``,
``register_module_rule(cls, rule, march="bayes")``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from backends.common.lower import (
    LowerContext,
    LoweringError,
    RuleNode,
    acc_bound,
    register_function_rule,
    register_method_rule,
    register_op_rule,
    requant_mode,
    shape_call,
    tensor_ref,
)
from backends.common.program import ValueRef
from backends.common.rules_layers import clamp_codes, emit_nearest, size_operand
from qir.ir.graph import Node as IRNode
from qir.ir.op import resolve

Node = RuleNode


def _plain(v: Any) -> Any:
    """Module hyper-parameters as JSON-plain values (tuples -> lists)."""
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def _dt(dtype: Any) -> str:
    return str(dtype.name)


# ----------------------------------------------------------------------------- conv / linear

_KINDS = {
    "Conv2d": "conv2d",
    "Conv1d": "conv1d",
    "Conv3d": "conv3d",
    "ConvTranspose2d": "conv_transpose2d",
    "Linear": "linear",
}


def _chunks(w: torch.Tensor, amax: int) -> list[list[int]] | None:
    """Input-channel ranges whose float32 partial sums stay within 2**24 for every output channel."""
    per = w.to(torch.int64).abs().sum(dim=tuple(range(2, w.dim()))) * amax  # (O, C)
    limit = 2**24
    if bool((per > limit).any()):
        return None
    out: list[list[int]] = []
    start = 0
    run = torch.zeros(per.shape[0], dtype=torch.int64)
    for c in range(per.shape[1]):
        if bool((run + per[:, c] > limit).any()):
            out.append([start, c])
            start, run = c, torch.zeros_like(run)
        run += per[:, c]
    out.append([start, int(per.shape[1])])
    return out


def lower_conv(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    xv = ctx.values[x]
    if xv.is_floating_point():
        raise LoweringError(f"node '{node.name}': {type(m).__name__} '{node.target}' receives a float tensor")
    inputs = [x]
    if m.has_add:
        addend = args[1] if len(args) > 1 else kwargs.get("addend")
        inputs.append(tensor_ref(addend, node, "addend"))
    kind = _KINDS[m.kind]
    assert m.dtype is not None
    attrs: dict[str, Any] = {"kind": kind, "out_dtype": _dt(m.dtype), "act": m.act, "has_add": bool(m.has_add)}
    if m.has_add:
        attrs.update(add_multiplier=int(m.add_multiplier), add_shift=int(m.add_shift), extra_bits=int(m.extra_bits))
    hint = str(node.target)
    consts = {
        "weight": ctx.const(f"{hint}.weight", m.weight),
        "bias": ctx.const(f"{hint}.bias", m.bias),
        "multiplier": ctx.const(f"{hint}.multiplier", m.multiplier),
        "shift": ctx.const(f"{hint}.shift", m.shift),
        "relu6_bound": ctx.const(f"{hint}.relu6_bound", m.relu6_bound),
    }
    bound, amax = acc_bound(m.weight, xv, out_axis=1 if kind == "conv_transpose2d" else 0)
    attrs["requant"] = requant_mode(bound, m.bias, m.multiplier, m.shift)
    if m.has_add and int(m.add_shift) > 52:
        attrs["requant"] = "i64"  # the addend's 2**(shift-1) would not add exactly in float64
    int8 = xv.dtype == torch.int8 and m.weight.dtype == torch.int8
    hp = m.hp
    if kind == "linear":
        cands = [
            e
            for e in ctx.policy.linear
            if (e == "int_mm" and int8 and bound < 2**31) or (e == "f32" and bound <= 2**24) or e == "f64"
        ]
        if len(cands) > 1 and "f64" in cands:
            cands.remove("f64")
        return ValueRef(
            ctx.emit(
                "linear",
                inputs,
                ctx.choose_engine("linear", inputs, attrs, consts, cands, node.name),
                consts,
                node.name,
                hint,
            )
        )
    attrs.update(
        stride=_plain(hp["stride"]),
        padding=_plain(hp["padding"]),
        dilation=_plain(hp["dilation"]),
        groups=int(hp["groups"] or 1),
        padding_mode=str(hp["padding_mode"]),
        reversed_padding=_plain(hp["reversed_padding"]),
        kernel_size=list(m.weight.shape[2:]),
    )
    if kind != "conv2d":
        if kind == "conv_transpose2d":
            attrs["output_padding"] = _plain(hp["output_padding"])
        attrs["engine"] = "f32" if bound <= 2**24 else "f64"
        return ValueRef(ctx.emit("conv_nd", inputs, attrs, consts, node.name, hint))
    zero_pad = attrs["padding_mode"] == "zeros" and not isinstance(attrs["padding"], str)
    plain = attrs["groups"] == 1 and zero_pad
    c_out, c_per_group, kh, kw = m.weight.shape
    depthwise = zero_pad and c_per_group == 1 and attrs["groups"] == c_out == xv.shape[1] and not m.has_add
    cands = []
    for e in ctx.policy.conv2d:
        if e == "dw":
            # kh * kw <= 1024 keeps the torch fallback (float32) exact: sums below 1024 * 128 * 128 = 2**24
            if depthwise and int8 and attrs["out_dtype"] in ("qint8", "qint16") and kh * kw <= 1024:
                cands.append(e)
        elif e in ("int_mm", "int_mm_t") and int8 and plain and bound < 2**31:
            cands.append(e)
        elif e == "f32" and bound <= 2**24:
            cands.append(e)
        elif e == "f32_chunked" and plain and bound > 2**24:
            chunks = _chunks(m.weight, amax)
            if chunks is not None:
                attrs["chunks"] = chunks
                cands.append(e)
        elif e == "f64":
            cands.append(e)
    if len(cands) > 1 and "f64" in cands:
        cands.remove("f64")  # the fallback only: about 2x float32 and 5-10x _int_mm wherever another is exact
    # the int8 engines requantize in one native pass; the float engines' float64 requantization alone
    # costs more than their conv (docs/backends.md "Kernel choices"): not worth timing, and on a
    # loaded machine a timing can pick them by accident
    if "dw" in cands:
        cands = ["dw"]
    elif any(e in cands for e in ("int_mm", "int_mm_t")):
        cands = [e for e in cands if e in ("int_mm", "int_mm_t")]
    chosen = ctx.choose_engine("conv2d", inputs, attrs, consts, cands, node.name)
    if chosen["engine"] != "f32_chunked":
        chosen.pop("chunks", None)
    return ValueRef(ctx.emit("conv2d", inputs, chosen, consts, node.name, hint))


# The stubs, scale-keeping layers, table lookups, pools, resize and Div are integer IR ops lowered
# by op rules (backends/common/rules_layers.py, registered per march in backends/<march>/rules.py).


# ----------------------------------------------------------------------------- op rules (IR op names)

#: IR ops that are one layout / shape function of kernels/shape.py under the op's own name: the
#: op's torch call (``op.torch_call``) gives that function's arguments
SHAPE_OPS = (
    "numel",
    "len",
    "size",
    "dim",
    "flatten",
    "reshape",
    "permute",
    "transpose",
    "squeeze",
    "unsqueeze",
    "split",
    "chunk",
    "unbind",
    "flip",
    "roll",
    "tile",
    "contiguous",
    "expand",
    "expand_as",
    "repeat",
    "pixel_shuffle",
    "pixel_unshuffle",
    "channel_shuffle",
    # a cat / stack left in a converted model joins float values (dequantized outputs, post-processing):
    # convert turns every cat of quantized tensors into a qcat or refuses it
    "cat",
    "stack",
)


def op_shape(ctx: LowerContext, node: IRNode, operands: list[Any]) -> ValueRef:
    op: Any = node.op  # one of SHAPE_OPS: a TorchOp
    _, args, kwargs = op.torch_call(operands)
    return shape_call(ctx, node, op.name, list(args), kwargs)


def op_getitem(ctx: LowerContext, node: IRNode, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    return shape_call(ctx, node, "getitem", [operands[0], resolve(op.index, operands)])


def op_identity(ctx: LowerContext, node: IRNode, operands: list[Any]) -> Any:
    return operands[0]


def op_dropout(ctx: LowerContext, node: IRNode, operands: list[Any]) -> Any:
    if getattr(
        node.op, "training", None
    ):  # the functional form with training=True; the module form follows the (eval) graph
        raise LoweringError(f"node '{node.name}': dropout with training=True has no compiled form (use eval mode)")
    return operands[0]


def op_relu(ctx: LowerContext, node: IRNode, operands: list[Any]) -> ValueRef:
    return clamp_codes(ctx, node, operands[0], 0, None)


for _name in SHAPE_OPS:
    register_op_rule(_name, op_shape)
register_op_rule("getitem", op_getitem)
register_op_rule("identity", op_identity)
register_op_rule("dropout", op_dropout)
register_op_rule("relu", op_relu)


# ----------------------------------------------------------------------------- functions and methods

#: tensor methods without an IR op of their own (opaque method calls in the IR)
_SHAPE_METHODS = ("clone", "detach", "view_as", "reshape_as")
_INT_ARITH = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.floordiv: "floordiv",
    operator.mod: "mod",
    operator.truediv: "truediv",
    operator.pow: "pow",
}


def _is_tensor(ctx: LowerContext, v: Any) -> bool:
    return isinstance(v, ValueRef) and isinstance(ctx.values.get(v.name), torch.Tensor)


#: torch constructors of tensors from sizes -> their float32 shape functions
_BUILDERS: dict[Any, str] = {torch.zeros: "zeros", torch.ones: "ones", torch.arange: "arange"}


def fn_build(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    """``torch.zeros(b, c)``, ``torch.ones(...)``, ``torch.arange(w)`` from sizes: float32 tensors
    (before a QuantStub, e.g. coordinates), built at run time from the run-time sizes."""
    extra = {k: v for k, v in kwargs.items() if not (k == "dtype" and v in (None, torch.float32))}
    extra = {k: v for k, v in extra.items() if not (k in ("device", "requires_grad", "layout") and not v)}
    if extra:
        raise LoweringError(
            f"node '{node.name}': {target.__name__}(...) with {', '.join(f'{k}={v}' for k, v in extra.items())} "
            "has no compiled form; only float32 tensors are built from sizes (add .float() or drop dtype=)"
        )
    return shape_call(ctx, node, _BUILDERS[target], args)


def fn_arith(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    tensors = [ctx.values[a.name] for a in args if _is_tensor(ctx, a)]
    if tensors and all(t.dtype == torch.float32 for t in tensors):
        # float32 values built from sizes before a QuantStub (torch.arange(w) + offset): the same
        # torch op as the converted model runs, so the artifact stays bit-exact
        return shape_call(ctx, node, _INT_ARITH[target], args)
    if tensors:
        raise LoweringError(
            f"node '{node.name}': {target.__name__} on tensors has no integer form here; "
            "quantized arithmetic goes through FloatFunctional (prepare_qat_fx generates it)"
        )
    return shape_call(ctx, node, _INT_ARITH[target], args)


def fn_relu6_codes(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return clamp_codes(ctx, node, args[0], 0, int(args[1]))


def fn_nearest(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    rest = [ctx.example(a) for a in args[1:]]
    kw = {k: ctx.example(v) for k, v in kwargs.items()}
    _, size_ref = size_operand(ctx, node, args[1] if len(args) > 1 else kwargs.get("size"))
    return emit_nearest(ctx, node, x, lambda t: F.interpolate(t, *rest, **kw), size_ref)


def method_shape(ctx: LowerContext, node: Node, name: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return shape_call(ctx, node, name, args, kwargs)


for _t in _INT_ARITH:
    register_function_rule(_t, fn_arith)
for _t in _BUILDERS:
    register_function_rule(_t, fn_build)
# code functions convert_fx writes into the graph, keyed by qualified name (no import of qir.quantization)
register_function_rule("qir.quantization.convert.relu6_codes", fn_relu6_codes)
register_function_rule("qir.quantization.convert.nearest_interpolate_codes", fn_nearest)
for _n in _SHAPE_METHODS:
    register_method_rule(_n, method_shape)
register_method_rule("__getitem__", lambda ctx, node, name, args, kwargs: shape_call(ctx, node, "getitem", args))

__all__: Sequence[str] = ["lower_conv"]

# The rule family in its own file registers on import (it imports this module's helpers):
# lower_rules_codes (abs, clamp, compare, pad, max, topk, gather). The integer layers (qconv ...
# LSTMCell, MultiheadAttention) are op rules (backends/common/rules_*.py) the marches register;
# lower_rules_yuv (centered YUV to RGB) builds on lower_conv and is imported with this module by lower_ir.
from backends.common import lower_rules_codes  # noqa: E402,F401
