"""Lowering the float part of a model: torch calls on float values (after a DeQuantStub, or before a
QuantStub) become ``float_fn`` instructions that run on the CPU in float, as Horizon deploys the ops
it leaves off the BPU (seed 003, hybrid deployment).

A node is float work when its function is on the allowlist of
:mod:`backends.common.kernels.float_ops` (elementwise math, comparisons, reductions, ``topk`` /
``sort`` / ``gather``; the spelling the model used) and every tensor it reads is a float32 value, an
int64 index or a bool mask, at least one computed at run time. Integer codes (int8 / int16 / int32)
never are: ops on codes are BPU work and keep their own rules. Layout functions (``flatten``,
``permute``, indexing, ``cat``) are not on the list: their rules already move float tensors.
Anything else on float values (a user's Python function, ``fx_helper.wrap``) stays refused, naming
the node.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common.kernels.base import get_kernel
from backends.common.kernels.float_ops import FLOAT_VALUE_DTYPES, float_function_name
from backends.common.lower import LowerContext, LoweringError, names_in, stored_constants
from backends.common.program import Instruction, ValueRef
from qir.ir.graph import Graph, Node
from qir.ir.op import IRError, resolve
from qir.ir.ops.core import Call, resolve_target

__all__ = ["float_call", "lower_float_call"]

#: ``Tensor.to(dtype)`` between the float part's dtypes, as the fixed cast method of that dtype
_CASTS = {torch.float32: "Tensor.float", torch.int64: "Tensor.long", torch.bool: "Tensor.bool"}


def float_call(
    ctx: LowerContext, graph: Graph, n: Node, operands: list[Any]
) -> tuple[str, list[Any], dict[str, Any]] | None:
    """``(name, args, kwargs)`` when node ``n`` is float work (see the module doc), else None."""
    op = n.op
    try:
        if isinstance(op, Call):
            if op.kind == "module":
                return None
            args, kwargs = list(resolve(op.args, operands)), dict(resolve(op.kwargs, operands))
            if op.kind == "method":
                name = "Tensor.to" if op.target == "to" else float_function_name(method=str(op.target))
            else:
                name = float_function_name(resolve_target(op.target, graph.objects))
        else:
            # a module-only op's torch call is still its float form here: the float part runs in eval mode
            torch_call = getattr(op, "torch_call", None)
            if torch_call is None:
                return None
            fn, targs, tkwargs = torch_call(operands)
            args, kwargs = list(targs), dict(tkwargs)
            method = getattr(fn, "__name__", "")
            is_method = getattr(torch.Tensor, method, None) is fn
            if fn is torch.Tensor.to:
                name = "Tensor.to"
            else:
                name = float_function_name(method=method) if is_method else float_function_name(fn)
    except IRError:
        return None
    if name == "Tensor.to":  # x.float(), x.to(torch.float32): a dtype is no file value; the fixed casts are
        cast = _CASTS.get(args[1]) if len(args) == 2 and not kwargs else None
        if cast is None:
            return None
        name, args = cast, args[:1]
    if name is None:
        return None
    runtime = [ctx.example(ValueRef(v)) for v in names_in([args, kwargs])]
    tensors = [t for t in [*runtime, *_literal_tensors([args, kwargs])] if isinstance(t, torch.Tensor)]
    if not any(isinstance(t, torch.Tensor) for t in runtime):
        return None  # constants only, or sizes: not float work
    if any(t.dtype not in FLOAT_VALUE_DTYPES for t in tensors):
        return None  # integer codes: BPU work
    return name, args, kwargs


def _literal_tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _literal_tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _literal_tensors(x)]
    return []


def lower_float_call(ctx: LowerContext, n: Node, name: str, args: list[Any], kwargs: dict[str, Any]) -> ValueRef:
    """Emit the ``float_fn`` instruction for ``name(*args, **kwargs)`` at node ``n``; its result is
    checked against the shape the loader will infer (a call whose output size depends on the data,
    such as ``torch.where(mask)``, has none and is refused)."""
    args, kwargs = stored_constants(ctx, n, args), stored_constants(ctx, n, kwargs)
    used = sorted(set(names_in([args, kwargs])))
    attrs = {"fn": name, "args": list(args), "kwargs": dict(kwargs)}
    schema = get_kernel("float_fn").schema
    assert schema.shape is not None
    probe = Instruction("float_fn", tuple(used), ("%probe",), attrs, {}, n.name)
    try:
        schema.shape(probe, [_meta(ctx.values[v]) for v in used], ctx.constants)
    except ValueError as e:
        raise LoweringError(
            f"node '{n.name}' ({name}) in the float part: its output shape cannot be known before it runs ({e}); "
            "compile the model without this step and run it in torch on the program's outputs"
        ) from None
    return ValueRef(ctx.emit("float_fn", used, attrs, {}, n.name, hint=name.rsplit(".", 1)[-1]))


def _meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v
