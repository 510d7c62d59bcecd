"""The lowering rules every march shares: op rules keyed by IR op name (the layout ops, relu,
identity, dropout; pad and getattr in lower_rules_codes), and the legacy rules the IR walk's
adapter reaches: one per quantized module class and QFunctional method, and the torch
functions / tensor methods a converted graph keeps between modules that have no op rule.

Each rule reads the module's integer buffers and fixed scales and derives integer
parameters with :mod:`backends.common.numerics` (and the module library's shared rule
helpers); it never calls the module's forward. Marches override a rule by registering
their own under their name (``register_op_rule("permute", rule, march="bayes")``,
``register_module_rule(cls, rule, march="bayes")``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.integer_rules import avg_pool_params, bilinear_taps
from backends.common.lower import (
    LowerContext,
    LoweringError,
    Named,
    RuleNode,
    acc_bound,
    f32_scale,
    names_in,
    register_function_rule,
    register_method_rule,
    register_module_rule,
    register_op_rule,
    requant_mode,
    shape_call,
    tensor_ref,
)
from backends.common.program import ValueRef
from qir.ir.graph import Node as IRNode
from qir.ir.op import resolve
from qir.nn import quantized as Q
from qir.quantization.convert import nearest_interpolate_codes, relu6_codes

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


# ----------------------------------------------------------------------------- stubs, activations, pools


def lower_quant_stub(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    return ValueRef(
        ctx.emit("quantize", [x], {"scale": f32_scale(m.scale), "dtype": _dt(m.dtype)}, {}, node.name, str(node.target))
    )


def lower_dequant_stub(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    s = m.scale.detach().to(torch.float32)
    axis = None if s.numel() == 1 else -s.dim()
    c = ctx.const(f"{node.target}.scale", s.reshape(-1))
    return ValueRef(ctx.emit("dequantize", [x], {"axis": axis}, {"scale": c}, node.name, str(node.target)))


def _clamp(ctx: LowerContext, node: Named, x: Any, lo: int | None, hi: int | None) -> ValueRef:
    return ValueRef(ctx.emit("clamp", [tensor_ref(x, node)], {"min": lo, "max": hi}, {}, node.name, "clamp"))


def lower_relu(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return _clamp(ctx, node, args[0], 0, None)


def lower_relu6(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return _clamp(ctx, node, args[0], 0, int(m.bound))


def lower_identity(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    return args[0]


def lower_lut(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    c = ctx.const(f"{node.target}.table", m.table)
    return ValueRef(ctx.emit("lut", [x], {"what": str(m.op_name)}, {"table": c}, node.name, str(node.target)))


def lower_maxpool(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    stride = m.stride if m.stride is not None else m.kernel_size
    attrs = {
        "kernel_size": _plain(m.kernel_size),
        "stride": _plain(stride),
        "padding": _plain(m.padding),
        "dilation": _plain(m.dilation),
        "ceil_mode": bool(m.ceil_mode),
    }
    return ValueRef(ctx.emit("maxpool2d", [x], attrs, {}, node.name, str(node.target)))


def lower_avgpool(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    attrs = {
        "kernel_size": list(m.kernel_size),
        "stride": list(m.stride),
        "padding": list(m.padding),
        "ceil_mode": bool(m.ceil_mode),
        "count_include_pad": bool(m.count_include_pad),
        "divisor_override": m.divisor_override,
        "out_dtype": _dt(m.dtype),
    }
    consts = {
        "multipliers": ctx.const(f"{node.target}.multipliers", m.multipliers),
        "shifts": ctx.const(f"{node.target}.shifts", m.shifts),
    }
    return ValueRef(ctx.emit("avgpool2d", [x], attrs, consts, node.name, str(node.target)))


def lower_adaptive_avgpool(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    from backends.common.kernels.pool import adaptive_bounds

    x = tensor_ref(args[0], node)
    h, w = (int(d) for d in ctx.values[x].shape[-2:])
    o = m.output_size
    oh, ow = (o, o) if isinstance(o, int) else (o[0], o[1])
    hs, he = adaptive_bounds(h, h if oh is None else int(oh))
    ws, we = adaptive_bounds(w, w if ow is None else int(ow))
    top = int((he - hs).max()) * int((we - ws).max())
    mult, sh = avg_pool_params(m.per_tensor_input(0), float(m.scale[0]), top, m.march)
    consts = {
        "multipliers": ctx.const(f"{node.target}.multipliers", mult),
        "shifts": ctx.const(f"{node.target}.shifts", sh),
    }
    attrs = {"output_size": [oh, ow], "out_dtype": _dt(m.dtype)}
    return ValueRef(ctx.emit("adaptive_avgpool2d", [x], attrs, consts, node.name, str(node.target)))


def _nearest_maps(h: int, w: int, call: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Source row / column of every output pixel: torch's nearest resize applied to an index image."""
    idx = torch.arange(h * w, dtype=torch.float64).reshape(1, 1, h, w)
    out = call(idx)[0, 0].to(torch.int64)
    return (out[:, 0] // w).contiguous(), (out[0, :] % w).contiguous()


def _run_time_size(ctx: LowerContext, node: Node, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    """A resize's run-time ``size`` argument (``size=lateral.shape[2:]``): its example value, for
    the tables, and a value name the kernel reads to check that the size it was compiled for is
    the size asked at run time (None when the size is a literal)."""
    size = args[1] if len(args) > 1 else kwargs.get("size")
    if size is None:
        return None, None
    ex = ctx.example(size)
    if not names_in(size):
        return ex, None
    ref = size.name if isinstance(size, ValueRef) else shape_call(ctx, node, "identity", [size]).name
    return ex, ref


def _emit_nearest(ctx: LowerContext, node: Node, x: str, call: Any, size_ref: str | None = None) -> ValueRef:
    h, w = (int(d) for d in ctx.values[x].shape[-2:])
    rows, cols = _nearest_maps(h, w, call)
    consts = {"rows": ctx.const(f"{node.name}.rows", rows), "cols": ctx.const(f"{node.name}.cols", cols)}
    attrs: dict[str, Any] = {"in_size": [h, w]}
    if size_ref is not None:  # tables hold the compiled output size: the kernel checks the run-time one
        attrs["out_size"] = [len(rows), len(cols)]
    ins = [x] if size_ref is None else [x, size_ref]
    return ValueRef(ctx.emit("resize_nearest", ins, attrs, consts, node.name, "resize"))


def lower_interpolate(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    size, size_ref = _run_time_size(ctx, node, args, kwargs)
    if m.mode == "nearest":
        return _emit_nearest(
            ctx,
            node,
            x,
            lambda t: F.interpolate(
                t,
                size=m.size if size is None else size,
                scale_factor=m.scale_factor if size is None else None,
                mode="nearest",
                recompute_scale_factor=m.recompute_scale_factor if size is None else None,
            ),
            size_ref,
        )
    if m.mode != "bilinear":
        raise LoweringError(f"node '{node.name}': Interpolate mode '{m.mode}' has no integer kernel")
    h, w = (int(d) for d in ctx.values[x].shape[-2:])
    oh, ow, fh, fw = m._out_size(h, w, size)
    ac = bool(m.align_corners)
    consts: dict[str, str] = {}
    attrs: dict[str, Any] = {"in_size": [h, w], "out_dtype": _dt(m.dtype)}
    if size_ref is not None:
        attrs["out_size"] = [oh, ow]
    # Taps for both input widths: B = 12 fraction bits for int8 codes, 15 for int16 (module rule).
    for bits in (12, 15):
        hi0, hi1, hw0, hw1 = bilinear_taps(h, oh, fh, ac, bits)
        wi0, wi1, ww0, ww1 = bilinear_taps(w, ow, fw, ac, bits)
        for k, t in (("hi0", hi0), ("hi1", hi1), ("wi0", wi0), ("wi1", wi1)):
            consts[k] = ctx.const(f"{node.name}.{k}", t)
        for k, t in ((f"hw0_{bits}", hw0), (f"hw1_{bits}", hw1), (f"ww0_{bits}", ww0), (f"ww1_{bits}", ww1)):
            consts[k] = ctx.const(f"{node.name}.{k}", t)
        # The weights' 2**-2B folds into the shift (docs/modules.md, bilinear resize).
        attrs[f"multiplier{bits}"] = int(m.multiplier)
        attrs[f"shift{bits}"] = int(m.shift) + 2 * bits
    ins = [x] if size_ref is None else [x, size_ref]
    return ValueRef(ctx.emit("resize_bilinear", ins, attrs, consts, node.name, str(node.target)))


def lower_div(ctx: LowerContext, node: Node, m: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    ins = [tensor_ref(args[0], node), tensor_ref(args[1], node)]
    attrs = {"multiplier": int(m.multiplier), "shift": int(m.shift), "out_dtype": _dt(m.dtype)}
    return ValueRef(ctx.emit("div", ins, attrs, {}, node.name, str(node.target)))


register_module_rule(Q.QuantizedConvBase, lower_conv)
register_module_rule(Q.QuantStub, lower_quant_stub)
register_module_rule(Q.DeQuantStub, lower_dequant_stub)
register_module_rule(Q.ReLU, lower_relu)
register_module_rule(Q.ReLU6, lower_relu6)
register_module_rule(Q.UnaryLUT, lower_lut)
register_module_rule(Q.MaxPool2d, lower_maxpool)
register_module_rule(nn.MaxPool2d, lower_maxpool)
register_module_rule(Q.AvgPool2d, lower_avgpool)
register_module_rule(Q.AdaptiveAvgPool2d, lower_adaptive_avgpool)
register_module_rule(Q.Interpolate, lower_interpolate)
register_module_rule(Q.Div, lower_div)
register_module_rule(Q.Identity, lower_identity)


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
    return _clamp(ctx, node, operands[0], 0, None)


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
    return _clamp(ctx, node, args[0], 0, int(args[1]))


def fn_nearest(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(args[0], node)
    rest = [ctx.example(a) for a in args[1:]]
    kw = {k: ctx.example(v) for k, v in kwargs.items()}
    _, size_ref = _run_time_size(ctx, node, args, kwargs)
    return _emit_nearest(ctx, node, x, lambda t: F.interpolate(t, *rest, **kw), size_ref)


def method_shape(ctx: LowerContext, node: Node, name: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return shape_call(ctx, node, name, args, kwargs)


for _t in _INT_ARITH:
    register_function_rule(_t, fn_arith)
for _t in _BUILDERS:
    register_function_rule(_t, fn_build)
register_function_rule(relu6_codes, fn_relu6_codes)
register_function_rule(nearest_interpolate_codes, fn_nearest)
for _n in _SHAPE_METHODS:
    register_method_rule(_n, method_shape)
register_method_rule("__getitem__", lambda ctx, node, name, args, kwargs: shape_call(ctx, node, "getitem", args))

__all__: Sequence[str] = ["lower_conv"]

# The rule families in their own files register on import (they import this module's helpers):
# lower_rules_codes (abs, clamp, compare, pad, max, topk, gather), lower_rules_math (PReLU, GLU,
# Softmax, LayerNorm), lower_rules_sampling (grid_sample, RoIAlign), lower_rules_sequence (LSTMCell,
# MultiheadAttention).
from backends.common import (  # noqa: E402,F401
    lower_rules_codes,
    lower_rules_math,
    lower_rules_sampling,
    lower_rules_sequence,
)
