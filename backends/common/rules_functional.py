"""Lowering rules of the integer FloatFunctional ops (``qadd``, ``qcat``, ``qreduce``, ...).

Each rule reads the op's attributes (the call site's input scales, ``out`` spec, march and
the method's literal arguments) and derives the kernel's integer parameters with
:mod:`backends.common.numerics`, the functions the integer module itself calls, so the
program computes what the converted model computes (docs/modules.md "FloatFunctional").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from backends.common import numerics
from backends.common.integer_rules import SCALAR_CODE, div_params, ratio_params
from backends.common.lower import LowerContext, LoweringError, f32_scale, shape_call, tensor_ref
from backends.common.lut_segmented import method_table16
from backends.common.program import ValueRef
from qir.ir.graph import Node

__all__ = ["FUNCTIONAL_RULES"]


def _scalar(c: float) -> tuple[int, float]:
    """A number operand coded as ``±SCALAR_CODE`` at scale ``|c| / SCALAR_CODE`` (the module's rule)."""
    return (SCALAR_CODE if c > 0 else -SCALAR_CODE), abs(float(c)) / SCALAR_CODE


def _out(node: Node) -> tuple[str, float]:
    """The output dtype name and scale."""
    spec = node.op.out  # type: ignore[attr-defined]
    return spec.dtype.name, float(spec.scale[0])


def _in(node: Node, i: int) -> float:
    return float(node.op.in_scales[i])  # type: ignore[attr-defined]


def _march(node: Node) -> str:
    return str(node.op.march)  # type: ignore[attr-defined]


def _ref(v: Any, node: Node) -> str:
    return tensor_ref(v, node)  # type: ignore[arg-type]


def _quantized_out(node: Node) -> str:
    dt, _ = _out(node)
    if dt == "qint32":
        raise LoweringError(
            f"node '{node.name}': {node.op.name} ({node.op.method}) needs an output fake quant; "  # type: ignore[attr-defined]
            "only matmul has a qint32 output"
        )
    return dt


def _to_out(ctx: LowerContext, node: Node, x: Any, i: int) -> str:
    """Input ``i`` rescaled to the output scale (a saturating copy when the scales are equal)."""
    dt = _quantized_out(node)
    xr = _ref(x, node)
    s_in, (_, s_out) = _in(node, i), _out(node)
    if f32_scale(s_in) == f32_scale(s_out):
        return ctx.emit("rescale", [xr], {"copy": True, "out_dtype": dt, "multiplier": 1, "shift": 0}, {}, node.name)
    mult, sh = numerics.requant_params(s_in, s_out, _march(node), dt)
    return ctx.emit("rescale", [xr], {"out_dtype": dt, "multiplier": int(mult), "shift": int(sh)}, {}, node.name)


def add_attrs(p: numerics.AddParams, out_dtype: str) -> dict[str, Any]:
    """The ``add`` kernel's attributes for the integer add rule ``p``."""
    return {
        "swap": bool(p.swap),
        "add_shift": int(p.shift),
        "qscale": int(p.qscale),
        "multiplier": int(p.multiplier),
        "shift": int(p.out_shift),
        "out_dtype": out_dtype,
    }


def _add(ctx: LowerContext, node: Node, ins: list[str], s_y: float, extra: dict[str, Any]) -> ValueRef:
    dt = _quantized_out(node)
    p = numerics.add_params(_in(node, 0), s_y, _out(node)[1], _march(node), dt)
    return ValueRef(ctx.emit("add", ins, {**add_attrs(p, dt), **extra}, {}, node.name, "add"))


def lower_qadd(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    method = node.op.method  # type: ignore[attr-defined]
    ins = [_ref(operands[0], node), _ref(operands[1], node)]
    return _add(ctx, node, ins, _in(node, 1), {"relu": method == "add_relu", "negate_y": method == "sub"})


def _scalar_dynamic(ctx: LowerContext, node: Node, kernel: str, operands: Sequence[Any]) -> ValueRef:
    """A kernel that reads the number (operand 1) at run time and derives its parameters from it."""
    y = operands[1]
    ref = y.name if isinstance(y, ValueRef) else shape_call(ctx, node, "identity", [y]).name  # type: ignore[arg-type]
    attrs = {
        "in_scale": _in(node, 0),
        "out_scale": _out(node)[1],
        "march": _march(node),
        "out_dtype": _quantized_out(node),
    }
    ins = [_ref(operands[0], node), ref]
    return ValueRef(ctx.emit(kernel, ins, attrs, {}, node.name, kernel.removesuffix("_dynamic")))


def lower_qadd_scalar(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    if node.op.scalar is None:  # type: ignore[attr-defined]
        return _scalar_dynamic(ctx, node, "add_scalar_dynamic", operands)
    y = float(node.op.scalar)  # type: ignore[attr-defined]
    if y == 0.0:
        return ValueRef(_to_out(ctx, node, operands[0], 0))
    code, s_c = _scalar(y)
    return _add(ctx, node, [_ref(operands[0], node)], s_c, {"y_code": code})


def _product(
    ctx: LowerContext, node: Node, ins: list[str], s_a: float, s_b: float, kernel: str, extra: dict[str, Any]
) -> ValueRef:
    dt, s_out = _out(node)
    if dt == "qint32":
        attrs = {"out_dtype": "qint32", "multiplier": 1, "shift": 0, **extra}
        return ValueRef(ctx.emit(kernel, ins, attrs, {}, node.name, kernel))
    mult, sh = numerics.conv_requant_params(s_a, s_b, s_out, _march(node), dt)
    attrs = {"out_dtype": dt, "multiplier": int(mult.reshape(-1)[0]), "shift": int(sh.reshape(-1)[0]), **extra}
    return ValueRef(ctx.emit(kernel, ins, attrs, {}, node.name, kernel))


def lower_qmul(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    ins = [_ref(operands[0], node), _ref(operands[1], node)]
    return _product(ctx, node, ins, _in(node, 0), _in(node, 1), "mul", {})


def lower_qmul_scalar(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    if node.op.scalar is None:  # type: ignore[attr-defined]
        return _scalar_dynamic(ctx, node, "mul_scalar_dynamic", operands)
    x = _ref(operands[0], node)
    y = float(node.op.scalar)  # type: ignore[attr-defined]
    if y == 0.0:
        return ValueRef(ctx.emit("zeros_like", [x], {"out_dtype": _quantized_out(node)}, {}, node.name))
    code, s_c = _scalar(y)
    return _product(ctx, node, [x], _in(node, 0), s_c, "mul", {"y_code": code})


def lower_qmatmul(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    op: Any = node.op
    x, y = operands[0], operands[1]
    if op.x_trans:  # the plugin's matmul(x, y, x_trans, y_trans): a transpose of the codes first
        x = shape_call(ctx, node, "transpose", [x, -2, -1])  # type: ignore[arg-type]
    if op.y_trans:
        y = shape_call(ctx, node, "transpose", [y, -2, -1])  # type: ignore[arg-type]
    ins = [_ref(x, node), _ref(y, node)]
    return _product(ctx, node, ins, _in(node, 0), _in(node, 1), "matmul", {})


def lower_qtensor_div(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    ins = [_ref(operands[0], node), _ref(operands[1], node)]
    mult, sh = div_params(_in(node, 0), _in(node, 1), _out(node)[1], _march(node))
    attrs = {"multiplier": int(mult), "shift": int(sh), "out_dtype": _quantized_out(node)}
    return ValueRef(ctx.emit("div", ins, attrs, {}, node.name, "div"))


def lower_qcat(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    op: Any = node.op
    parts = [ValueRef(_to_out(ctx, node, t, i)) for i, t in enumerate(operands)]
    fn = "stack" if op.method == "stack" else "cat"
    return shape_call(ctx, node, fn, [parts], {"dim": int(op.dim)})  # type: ignore[arg-type]


def lower_qminmax(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    method = node.op.method  # type: ignore[attr-defined]
    ins = [_to_out(ctx, node, operands[0], 0), _to_out(ctx, node, operands[1], 1)]
    return ValueRef(ctx.emit(method, ins, {}, {}, node.name, method))


def lower_qreduce(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    op: Any = node.op
    x = _ref(operands[0], node)
    dims = None if op.dim is None else [int(d) for d in op.dim]
    dt = _quantized_out(node)
    s_in, s_out = _in(node, 0), _out(node)[1]
    attrs: dict[str, Any] = {"dims": dims, "keepdim": bool(op.keepdim), "out_dtype": dt, "n": None}
    if op.method == "mean":
        xv = ctx.values[x]
        out_numel = 1
        if dims is not None:
            kept = 1
            for d in dims:
                kept *= int(xv.shape[d])
            out_numel = xv.numel() // max(1, kept)
        n = xv.numel() // max(out_numel, 1)
        mult, sh = ratio_params(f32_scale(s_in) / (n * f32_scale(s_out)), _march(node))
        attrs["n"] = n
    else:
        mult, sh = numerics.requant_params(s_in, s_out, _march(node), dt)
    attrs.update(multiplier=int(mult), shift=int(sh))
    return ValueRef(ctx.emit("reduce_sum", [x], attrs, {}, node.name, op.method))


_LUT_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp": torch.exp,
    "ceil": torch.ceil,
    "floor": torch.floor,
}


def lower_qlut_method(ctx: LowerContext, node: Node, operands: Sequence[Any]) -> ValueRef:
    method = node.op.method  # type: ignore[attr-defined]
    x = _ref(operands[0], node)
    dt = _quantized_out(node)
    version = int(getattr(node.op, "table16_version", 1))
    if ctx.values[x].dtype == torch.int16:
        knots = method_table16(method, _LUT_FUNCTIONS[method], _in(node, 0), _out(node)[1], dt, version)
        if knots is not None:
            c = ctx.const(f"{node.name}.table16", knots)
            attrs = {"what": method, "out_dtype": dt, "version": version}
            return ValueRef(ctx.emit("lut16", [x], attrs, {"table": c}, node.name, method))
    if ctx.values[x].dtype != torch.int8:
        raise LoweringError(
            f"node '{node.name}': {method} of a {ctx.values[x].dtype} tensor has no table; {method} takes qint8 codes"
            + (" or qint16 codes" if method == "exp" or version > 1 else " (table16_version 1: convert it again)")
        )
    table = numerics.lut_int8(_LUT_FUNCTIONS[method], _in(node, 0), _out(node)[1], dt)
    c = ctx.const(f"{node.name}.table", table)
    return ValueRef(ctx.emit("lut", [x], {"what": method}, {"table": c}, node.name, method))


#: IR op name -> rule; every march that lowers FloatFunctional arithmetic registers these
FUNCTIONAL_RULES: dict[str, Callable[[LowerContext, Node, Sequence[Any]], ValueRef]] = {
    "qadd": lower_qadd,
    "qadd_scalar": lower_qadd_scalar,
    "qmul": lower_qmul,
    "qmul_scalar": lower_qmul_scalar,
    "qmatmul": lower_qmatmul,
    "qtensor_div": lower_qtensor_div,
    "qcat": lower_qcat,
    "qminmax": lower_qminmax,
    "qreduce": lower_qreduce,
    "qlut_method": lower_qlut_method,
}
