"""Lowering rules of the ops ``convert_fx`` runs on codes: abs, clamp, comparisons, padding, max /
min, arg-reductions, top-k, gather, and the shuffles (docs/semantics.md, "Ops on codes").

The converted graph already holds every integer constant (clamp bounds and comparison
ranges as codes, a constant pad's code), so these rules only read them and emit the
kernels of ``backends/common/kernels/codes.py`` and ``select.py``.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any

import torch

from backends.common.lower import (
    LowerContext,
    LoweringError,
    Named,
    RuleNode,
    register_function_rule,
    register_method_rule,
    register_op_rule,
    shape_call,
    tensor_ref,
)
from backends.common.program import ValueRef
from qir.ir.graph import Node as IRNode

Node = RuleNode

__all__ = ["COMPARISON_FUNCTIONS", "COMPARISON_METHODS"]


def _get(args: list[Any], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` or keyword ``name`` of a call (a method's receiver is argument 0)."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def _is_tensor(ctx: LowerContext, v: Any) -> bool:
    return isinstance(v, ValueRef) and isinstance(ctx.values.get(v.name), torch.Tensor)


def _int(v: Any, node: Node, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise LoweringError(f"node '{node.name}': {what} must be a constant integer here, got {v!r:.60}")
    return v


# ----------------------------------------------------------------------------- elementwise on codes


def fn_abs_codes(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return ValueRef(ctx.emit("abs", [tensor_ref(args[0], node)], {}, {}, node.name, "abs"))


def fn_clamp_codes(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    lo, hi = _get(args, kwargs, 1, "lo"), _get(args, kwargs, 2, "hi")
    attrs = {"min": None if lo is None else int(lo), "max": None if hi is None else int(hi)}
    return ValueRef(ctx.emit("clamp", [tensor_ref(args[0], node)], attrs, {}, node.name, "clamp"))


def fn_compare_codes(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    op = str(_get(args, kwargs, 1, "op"))
    lo, hi = _get(args, kwargs, 3, "lo"), _get(args, kwargs, 4, "hi")
    attrs = {
        "op": op,
        "lo": None if lo is None else int(lo),
        "hi": None if hi is None else int(hi),
        "negate": op == "ne",
    }
    return ValueRef(ctx.emit("compare", [tensor_ref(args[0], node)], attrs, {}, node.name, op))


#: tensor-vs-tensor comparison spellings (convert_fx keeps them when both operands share one scale)
COMPARISON_FUNCTIONS: dict[Any, str] = {
    operator.eq: "eq",
    operator.ne: "ne",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.lt: "lt",
    operator.le: "le",
    torch.eq: "eq",
    torch.ne: "ne",
    torch.not_equal: "ne",
    torch.gt: "gt",
    torch.greater: "gt",
    torch.ge: "ge",
    torch.greater_equal: "ge",
    torch.lt: "lt",
    torch.less: "lt",
    torch.le: "le",
    torch.less_equal: "le",
}
COMPARISON_METHODS: dict[str, str] = {
    "eq": "eq",
    "ne": "ne",
    "not_equal": "ne",
    "gt": "gt",
    "greater": "gt",
    "ge": "ge",
    "greater_equal": "ge",
    "lt": "lt",
    "less": "lt",
    "le": "le",
    "less_equal": "le",
}


def _compare_tensors(ctx: LowerContext, node: Node, op: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    a, b = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "other")
    if not (_is_tensor(ctx, a) and _is_tensor(ctx, b)):
        raise LoweringError(
            f"node '{node.name}': {op} of {a!r:.40} and {b!r:.40} has no integer kernel here; convert_fx turns a "
            "comparison of a quantized tensor with a number into compare_codes (compile the converted model)"
        )
    return ValueRef(ctx.emit("compare", [a.name, b.name], {"op": op}, {}, node.name, op))


def fn_compare(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return _compare_tensors(ctx, node, COMPARISON_FUNCTIONS[target], args, kwargs)


def method_compare(ctx: LowerContext, node: Node, name: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return _compare_tensors(ctx, node, COMPARISON_METHODS[name], args, kwargs)


# ----------------------------------------------------------------------------- padding


def _emit_pad(ctx: LowerContext, node: Named, x: Any, pad: Any, mode: str, value: Any) -> ValueRef:
    code = 0.0 if value is None else float(value)
    if mode == "constant" and not code.is_integer():
        raise LoweringError(
            f"node '{node.name}': pad value {value} is not a code; convert_fx turns a constant pad's "
            "value into its code at the input's scale (compile the converted model)"
        )
    attrs = {"pad": [int(p) for p in pad], "mode": mode, "value": int(code)}
    return ValueRef(ctx.emit("pad", [tensor_ref(x, node)], attrs, {}, node.name, "pad"))


# ----------------------------------------------------------------------------- selection


def _reduce(ctx: LowerContext, node: Node, which: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(_get(args, kwargs, 0, "input"), node)
    second = _get(args, kwargs, 1, "dim", kwargs.get("other"))
    if _is_tensor(ctx, second):  # two tensors on one scale (convert_fx checked): elementwise
        fn = "maximum" if which == "max" else "minimum"
        return ValueRef(ctx.emit(fn, [x, second.name], {}, {}, node.name, fn))
    dim = None if second is None else _int(second, node, "dim")
    attrs = {"which": which, "dim": dim, "keepdim": bool(_get(args, kwargs, 2, "keepdim", False))}
    return ValueRef(ctx.emit("reduce_max", [x], attrs, {}, node.name, which))


def fn_max(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return _reduce(ctx, node, "max" if target is torch.max else "min", args, kwargs)


def method_max(ctx: LowerContext, node: Node, name: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return _reduce(ctx, node, name, args, kwargs)


def _arg_reduce(ctx: LowerContext, node: Node, which: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(_get(args, kwargs, 0, "input"), node)
    dim = _get(args, kwargs, 1, "dim")
    attrs = {
        "which": which,
        "dim": None if dim is None else _int(dim, node, "dim"),
        "keepdim": bool(_get(args, kwargs, 2, "keepdim", False)),
    }
    return ValueRef(ctx.emit("arg_reduce", [x], attrs, {}, node.name, which))


def fn_arg_reduce(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return _arg_reduce(ctx, node, "argmax" if target is torch.argmax else "argmin", args, kwargs)


def method_arg_reduce(ctx: LowerContext, node: Node, name: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    return _arg_reduce(ctx, node, name, args, kwargs)


def fn_topk(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(_get(args, kwargs, 0, "input"), node)
    attrs = {
        "k": _int(_get(args, kwargs, 1, "k"), node, "topk's k"),
        "dim": _int(_get(args, kwargs, 2, "dim", -1), node, "dim"),
        "largest": bool(_get(args, kwargs, 3, "largest", True)),
        "sorted": bool(_get(args, kwargs, 4, "sorted", True)),
    }
    return ValueRef(ctx.emit("topk", [x], attrs, {}, node.name, "topk"))


def fn_gather(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    x = tensor_ref(_get(args, kwargs, 0, "input"), node)
    dim = _int(_get(args, kwargs, 1, "dim"), node, "gather's dim")
    index = _get(args, kwargs, 2, "index")
    if isinstance(index, torch.Tensor):  # a buffer of the model: stored in the Program
        c = ctx.const(f"{node.name}.index", index.to(torch.int64))
        return ValueRef(ctx.emit("gather", [x], {"dim": dim}, {"index": c}, node.name, "gather"))
    return ValueRef(ctx.emit("gather", [x, tensor_ref(index, node, "index")], {"dim": dim}, {}, node.name, "gather"))


def fn_getattr(ctx: LowerContext, node: Node, target: Any, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    """``x.shape`` / ``x.ndim`` (run-time shape values, like ``x.size()`` / ``x.dim()``), and
    ``r.values`` / ``r.indices`` of a max / min / topk result (the kernels return ``(values, indices)``)."""
    field = args[1] if len(args) > 1 else None
    if field in _SHAPE_ATTRS:
        return shape_call(ctx, node, _SHAPE_ATTRS[field], [args[0]])
    if field not in ("values", "indices"):
        raise LoweringError(
            f"node '{node.name}': attribute .{field} has no lowering rule (only .shape / .ndim of a tensor "
            "and .values / .indices of max, min and topk results)"
        )
    return shape_call(ctx, node, "getitem", [args[0], 0 if field == "values" else 1])


#: tensor attributes that are shape values -> the shape function computing them at run time
_SHAPE_ATTRS = {"shape": "size", "ndim": "dim"}


def op_getattr(ctx: LowerContext, node: IRNode, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    return fn_getattr(ctx, RuleNode(node.name, builtins.getattr), builtins.getattr, [operands[0], op.attr], {})


def op_pad(ctx: LowerContext, node: IRNode, operands: list[Any]) -> ValueRef:
    op: Any = node.op
    if not all(isinstance(p, int) for p in op.pad):
        raise LoweringError(f"node '{node.name}': pad needs constant integer padding, got {op.pad!r:.60}")
    return _emit_pad(ctx, node, operands[0], op.pad, op.mode, op.value)


register_function_rule("qir.quantization.code_ops.abs_codes", fn_abs_codes)
register_function_rule("qir.quantization.code_ops.clamp_codes", fn_clamp_codes)
register_function_rule("qir.quantization.code_ops.compare_codes", fn_compare_codes)
for _fn in COMPARISON_FUNCTIONS:
    register_function_rule(_fn, fn_compare)
for _name in COMPARISON_METHODS:
    register_method_rule(_name, method_compare)
register_op_rule("pad", op_pad)
for _fn in (torch.max, torch.min):
    register_function_rule(_fn, fn_max)
for _name in ("max", "min"):
    register_method_rule(_name, method_max)
for _fn in (torch.argmax, torch.argmin):
    register_function_rule(_fn, fn_arg_reduce)
for _name in ("argmax", "argmin"):
    register_method_rule(_name, method_arg_reduce)
register_function_rule(torch.topk, fn_topk)
register_method_rule("topk", lambda ctx, node, name, args, kwargs: fn_topk(ctx, node, torch.topk, args, kwargs))
register_function_rule(torch.gather, fn_gather)
register_method_rule("gather", lambda ctx, node, name, args, kwargs: fn_gather(ctx, node, torch.gather, args, kwargs))
register_op_rule("getattr", op_getattr)
