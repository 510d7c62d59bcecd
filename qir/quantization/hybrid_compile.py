"""Compiling a hybrid model: its CPU part becomes the program's float part.

``convert_fx`` leaves a hybrid model's CPU modules (``hybrid_dict``, ops without a BPU form) as
float torch modules between the integer BPU segments. ``compile_model`` lowers them like the
float pre- and post-processing around any quantized model: each becomes ``float_fn`` instructions
calling the torch functions the converted model calls (``F.conv2d(x, weight, bias, ...)`` with the
weights stored as program constants, ``F.selu``, ...), so the artifact computes the converted
model's float part bit for bit.

The converted GraphModule calls a CPU module whole (prepare kept it one opaque call, so fusion
never crossed the boundary). A module the IR has an op for (``nn.Conv2d``, ``nn.Linear``,
``nn.BatchNorm2d``, ...) lowers as that op; any other (a user module wrapping ``F.selu``) is
inlined here first: its forward is traced and its calls replace the module call, so each of them
is lowered on its own, and one the float part cannot run is refused naming the node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from qir.frontend.lookup import tables
from qir.frontend.tracer import TraceError
from qir.quantization.fuse import trace_fx
from qir.quantization.hybrid import hybrid_plan_of

__all__ = ["INLINED_AS", "INLINED_FROM", "inline_cpu_modules"]

#: ``node.meta`` keys of a node inlined from a CPU module's forward: the module's path, and the name
#: reports show for the node (the path for the one call of its forward, ``head.act.selu`` for one of several)
INLINED_FROM = "qir.inlined_from"
INLINED_AS = "qir.inlined_as"


def inline_cpu_modules(gm: nn.Module) -> nn.Module:
    """``gm`` with the calls of its hybrid CPU modules that have no IR op traced inline (a new
    GraphModule sharing ``gm``'s submodules; ``gm`` itself when there are none).

    The inlined nodes are named for the call they replace, so the program's steps, ``perf_model``'s
    layers and ``visualize_model``'s boxes carry the user's names: a forward with one call takes the
    call's node name (``head_act``; ``head_act_1`` for its second call), one with several calls
    prefixes each (``head_act_selu``); ``node.meta`` holds the module path (``INLINED_FROM``) and the
    name reports show (``INLINED_AS``: ``head.act``, ``head.act.selu``).
    """
    plan = hybrid_plan_of(gm)
    if plan is None or not isinstance(gm, torch.fx.GraphModule):
        return gm
    cpu = set(plan.cpu_modules())
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_module":
            m = gm.get_submodule(str(node.target))
            if _is_float_dequant_stub(m) and len(node.args) == 1 and not node.kwargs:
                # a DeQuantStub of a float value (after a CPU op): an identity
                env[node] = torch.fx.node.map_arg(node.args[0], lambda a: env[a])
                changed = True
                continue
            if str(node.target) in cpu and tables().for_module(m) is None:
                # no IR op (a float conv, linear, batch norm lowers as that op): its forward's calls
                env[node] = _inline(graph, node, m, str(node.target), env)
                changed = True
                continue
        if node.op == "output":
            graph.output(torch.fx.node.map_arg(node.args[0], lambda a: env[a]), type_expr=node.type)
            continue
        env[node] = graph.node_copy(node, lambda a: env[a])
    if not changed:
        return gm
    graph.lint()
    out = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    return out


def _is_float_dequant_stub(m: nn.Module) -> bool:
    from qir.quantization.stubs import FLOAT_DEQUANT_STUBS

    return type(m) in FLOAT_DEQUANT_STUBS


def _inline(
    graph: torch.fx.Graph, node: torch.fx.Node, m: nn.Module, path: str, outer: dict[torch.fx.Node, Any]
) -> Any:
    """Append the traced calls of ``m``'s forward (``m`` at ``path``, called by ``node`` of the graph
    being copied; ``outer`` maps that graph's nodes to ``graph``'s) to ``graph``; return the result."""
    try:
        sub = trace_fx(m)
    except TraceError as e:
        raise TraceError(
            f"the CPU module '{path}' ({type(m).__name__}) of this hybrid model cannot be traced to compile its float "
            f"forward: {e}"
        ) from e
    placeholders = [n for n in sub.nodes if n.op == "placeholder"]
    if node.kwargs or len(node.args) > len(placeholders):
        raise TraceError(
            f"the CPU module '{path}' ({type(m).__name__}) is called with keyword or extra arguments; only positional "
            "calls of CPU modules are inlined to compile them"
        )
    calls = [n for n in sub.nodes if n.op not in ("placeholder", "output", "get_attr")]
    env: dict[torch.fx.Node, Any] = {}
    for i, sn in enumerate(placeholders):
        if i < len(node.args):
            env[sn] = torch.fx.node.map_arg(node.args[i], lambda a: outer[a])
        else:
            env[sn] = sn.args[0] if sn.args else None
    result: Any = None
    for sn in sub.nodes:
        if sn.op == "placeholder":
            continue
        if sn.op == "output":
            result = torch.fx.node.map_arg(sn.args[0], lambda a: env[a])
            continue
        one = len(calls) == 1 and sn is calls[0]
        target = f"{path}.{sn.target}" if sn.op in ("get_attr", "call_module") else sn.target
        new = graph.create_node(
            sn.op,
            target,
            torch.fx.node.map_arg(sn.args, lambda a: env[a]),
            torch.fx.node.map_arg(sn.kwargs, lambda a: env[a]),
            name=node.name if one else f"{node.name}_{sn.name}",
            type_expr=sn.type,
        )
        new.meta = dict(sn.meta)
        new.meta[INLINED_FROM] = path
        new.meta[INLINED_AS] = path if one else f"{path}.{sn.name}"
        env[sn] = new
    return result
