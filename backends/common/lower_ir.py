"""Lowering over the IR: ``lower_ir(graph, example_inputs, march, opt)`` -> :class:`Program`.

Walks the IR graph's nodes in order. Graph inputs become Program inputs (holding the
example values), ``constant`` nodes stand for their tensors, and every other node is
lowered by

1. the **op rule** registered for its IR op name (:func:`backends.common.lower.register_op_rule`),
   called with the node and its lowered operands; else
2. the **adapter**, for rules keyed by what a node stands for in torch rather than by IR
   op name (torch functions and tensor methods without an IR op, and module classes a user
   registers with ``register_module_rule`` — no built-in quantized layer needs one: each is
   an integer IR op), mapping the node back to the torch call it stands for, as the torch
   emitter does:

   * ``call`` of kind ``module``: the module object in ``graph.objects`` -> module rules
     (a built-in layer that stayed opaque because it failed to bind is refused, with the
     front end's reason);
   * ``call`` of kind ``method`` -> method rules (a QFunctional method call is an integer op,
     ``qadd`` ..., when it traced; one that did not is refused naming it);
   * ``call`` of kind ``function``: the resolved callable -> function rules;
   * an op with a torch call (``op.torch_call``) -> function rules (method rules when the
     callable is a ``torch.Tensor`` method);
   * a module-backed op (``op.to_module``) -> module rules.

The graph's output structure (tensors, tuples, lists of them) becomes the Program's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from backends.common.lower import (
    LowerContext,
    LoweringError,
    RuleNode,
    function_rule,
    get_kernel_policy,
    method_rule,
    module_rule,
    names_in,
    op_rule,
)
from backends.common.lower_float import float_call, lower_float_call
from backends.common.program import Program, ValueRef
from qir.ir.graph import Graph, Node, Value, map_values
from qir.ir.op import IRError, ModuleOp, resolve, torch_call_of
from qir.ir.ops.core import Call, Constant, resolve_target

__all__ = ["lower_ir"]


def lower_ir(graph: Graph, example_inputs: Sequence[Any], march: str, opt: int = 2) -> Program:
    """Lower ``graph`` for ``march``; every instruction runs once on ``example_inputs``.

    The graph is read, never changed. Raises :class:`LoweringError` naming the node (and
    its module) that has no rule or whose rule refuses it.
    """
    import backends.common.lower_rules  # registers the common rules
    import backends.common.lower_rules_yuv  # noqa: F401  (centered YUV to RGB)

    graph.refuse_stand_ins("lower")  # the program runs every instruction: not on zero stand-ins

    ctx = LowerContext(march=march, opt=opt, policy=get_kernel_policy(march))
    if len(graph.inputs) != len(example_inputs):
        raise LoweringError(
            f"the model takes {len(graph.inputs)} input(s) "
            f"({', '.join(a.name for a in graph.inputs)}), got {len(example_inputs)} example input(s)"
        )
    env: dict[Value, Any] = {}
    inputs: list[str] = []
    for arg, example in zip(graph.inputs, example_inputs, strict=True):
        name = ctx.fresh(arg.name)
        ctx.values[name] = example
        inputs.append(name)
        env[arg] = ValueRef(name)
    for n in graph.nodes:
        if isinstance(n.op, Constant):
            env[n] = graph.constants[n.op.key]
            continue
        operands = [env[v] for v in n.operands]
        rule = op_rule(march, n.op.name)
        try:
            call = float_call(ctx, graph, n, operands)
            if call is not None:  # float post-processing (or pre-processing): the program's CPU float part
                res = lower_float_call(ctx, n, *call)
            else:
                res = rule(ctx, n, operands) if rule is not None else _legacy(ctx, graph, n, operands)
        except IRError as e:  # an op that cannot spell its own call: say which node, as rules do
            raise LoweringError(f"{_where(n)}: {e}") from e
        env[n] = res
        for name in names_in(res):
            ctx.check_dtype(name, n.name)
    outputs = _output_names(map_values(graph.output, lambda v: env[v]))
    prog = Program(
        march=march,
        inputs=inputs,
        outputs=outputs,
        instructions=ctx.instructions,
        constants=ctx.constants,
        meta={"opt": opt},
    )
    prog.validate()
    return prog


def _output_names(v: Any) -> Any:
    if isinstance(v, ValueRef):
        return v.name
    if isinstance(v, tuple):
        return tuple(_output_names(x) for x in v)
    if isinstance(v, list):
        return [_output_names(x) for x in v]
    if isinstance(v, dict):  # detection heads return {"heatmap": ..., "reg": ...}
        bad = [k for k in v if not isinstance(k, str)]
        if bad:
            raise LoweringError(f"model output dict has the key {bad[0]!r:.40}: only string keys can be compiled")
        return {k: _output_names(x) for k, x in v.items()}
    raise LoweringError(f"model output {v!r:.80} is not a tensor or a tuple / list / dict (string keys) of tensors")


# ----------------------------------------------------------------------------- legacy adapter


def _where(n: Node) -> str:
    return f"node '{n.name}'" + (f" (module '{n.scope}')" if n.scope else "")


def _legacy(ctx: LowerContext, graph: Graph, n: Node, operands: list[Any]) -> Any:
    """Lower ``n`` with the rules keyed by module class, QFunctional method, function or method."""
    op, march = n.op, ctx.march
    if isinstance(op, Call):
        args, kwargs = list(resolve(op.args, operands)), dict(resolve(op.kwargs, operands))
        if op.kind == "module":
            m = graph.objects.get(f"module:{op.target}")
            if m is None:
                raise LoweringError(f"{_where(n)}: no module object for '{op.target}' in the graph's objects")
            return _module(ctx, n, m, op.target, args, kwargs)
        if op.kind == "method":
            receiver = args[0] if args else None
            if isinstance(receiver, nn.Module):  # QFunctional methods trace to integer ops (qadd, ...)
                raise LoweringError(
                    f"{_where(n)}: method {type(receiver).__name__}.{op.target} did not trace to an integer op "
                    f"and has no lowering rule on {march}"
                )
            return _method(ctx, n, op.target, args, kwargs)
        try:
            fn = resolve_target(op.target, graph.objects)
        except IRError as e:
            raise LoweringError(f"{_where(n)}: {e}") from None
        return _function(ctx, n, fn, args, kwargs)
    torch_call = torch_call_of(op)
    if torch_call is not None:
        try:
            fn, targs, tkwargs = torch_call(operands)
        except IRError:
            if not isinstance(op, ModuleOp):
                raise
        else:
            name = getattr(fn, "__name__", "")
            if getattr(torch.Tensor, name, None) is fn:  # a Tensor method: its rules are keyed by name
                return _method(ctx, n, name, list(targs), dict(tkwargs))
            # a module-backed op keeps its module form where it came from a module (it has a scope)
            # and no function rule takes its torch call
            if function_rule(march, fn) is not None or not isinstance(op, ModuleOp) or not n.scope:
                return _function(ctx, n, fn, list(targs), dict(tkwargs))
    if isinstance(op, ModuleOp):
        roles = op.param_roles()
        params = op.module_params(n.operands)
        if not all(isinstance(p, Node) and isinstance(p.op, Constant) for p in params):
            raise LoweringError(f"{_where(n)}: op '{op.name}' has run-time state; only constant state is lowered")
        tensors = {r: graph.constants[p.op.key] for r, p in zip(roles, params, strict=True)}  # type: ignore[attr-defined]
        try:
            m = op.to_module(tensors)
        except NotImplementedError as e:
            raise LoweringError(f"{_where(n)}: op '{op.name}' has no lowering rule on {march} ({e})") from None
        inputs = [operands[n.operands.index(v)] for v in op.module_inputs(n.operands)]
        module_call = getattr(op, "module_call", None)
        args, kwargs = module_call(inputs) if module_call is not None else (tuple(inputs), {})
        return _module(ctx, n, m, n.scope or n.name, list(args), dict(kwargs))
    raise LoweringError(f"{_where(n)}: op '{op.name}' has no lowering rule on {march}")


def _module(ctx: LowerContext, n: Node, m: nn.Module, path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    rule = module_rule(ctx.march, m)
    if rule is None:
        note = n.meta.get("frontend_note")  # why the front end kept the call opaque (a call that did not bind)
        raise LoweringError(
            f"node '{n.name}': module '{path}' ({type(m).__module__}.{type(m).__name__}) "
            f"has no lowering rule on {ctx.march}" + (f" (not traced to an IR op: {note})" if note else "")
        )
    return rule(ctx, RuleNode(n.name, path, tuple(args)), m, args, kwargs)


def _method(ctx: LowerContext, n: Node, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    rule = method_rule(ctx.march, name)
    if rule is None:
        raise LoweringError(f"{_where(n)}: tensor method .{name}() has no lowering rule on {ctx.march}")
    return rule(ctx, RuleNode(n.name, name, tuple(args)), name, args, kwargs)


def _function(ctx: LowerContext, n: Node, fn: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    rule = function_rule(ctx.march, fn)
    if rule is None:
        what = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or str(fn)
        raise LoweringError(f"{_where(n)}: function {what} has no lowering rule on {ctx.march}")
    return rule(ctx, RuleNode(n.name, fn, tuple(args)), fn, args, kwargs)
