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

__all__ = ["inline_cpu_modules"]


def inline_cpu_modules(gm: nn.Module) -> nn.Module:
    """``gm`` with the calls of its hybrid CPU modules that have no IR op traced inline (a new
    GraphModule sharing ``gm``'s submodules; ``gm`` itself when there are none)."""
    plan = hybrid_plan_of(gm)
    if plan is None or not isinstance(gm, torch.fx.GraphModule):
        return gm
    cpu = set(plan.cpu_modules())
    graph = _copy_graph(gm.graph)
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        m = gm.get_submodule(str(node.target))
        if _is_float_dequant_stub(m) and len(node.args) == 1 and not node.kwargs:
            node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
            graph.erase_node(node)  # a DeQuantStub of a float value (after a CPU op): an identity
            changed = True
            continue
        if str(node.target) not in cpu:
            continue
        if tables().for_module(m) is not None:
            continue  # an IR op (a float conv, linear, batch norm): lowered as that op
        _inline(graph, node, m, str(node.target))
        changed = True
    if not changed:
        return gm
    graph.lint()
    out = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    return out


def _is_float_dequant_stub(m: nn.Module) -> bool:
    from torch.ao.quantization import DeQuantStub as TorchDeQuantStub

    from qir.quantization.stubs import DeQuantStub

    return type(m) in (DeQuantStub, TorchDeQuantStub)


def _copy_graph(g: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    out = new.graph_copy(g, {})
    new.output(out)
    return new


def _inline(graph: torch.fx.Graph, node: torch.fx.Node, m: nn.Module, path: str) -> None:
    """Replace call ``node`` of module ``m`` (at ``path``) by the traced calls of its forward."""
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
    env: dict[torch.fx.Node, Any] = {}
    result: Any = None
    with graph.inserting_before(node):
        for i, sn in enumerate(placeholders):
            env[sn] = node.args[i] if i < len(node.args) else (sn.args[0] if sn.args else None)
        for sn in sub.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                result = torch.fx.node.map_arg(sn.args[0], lambda a: env[a])
                continue
            new = graph.node_copy(sn, lambda a: env[a])  # type: ignore[arg-type,return-value]
            if new.op in ("get_attr", "call_module"):
                new.target = f"{path}.{sn.target}"
            env[sn] = new
    node.replace_all_uses_with(result)  # type: ignore[arg-type]
    graph.erase_node(node)
