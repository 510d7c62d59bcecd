"""Split a converted model at its wrapped calls: a head to compile, the wrapped Python as a tail.

``compile_model`` refuses ``fx_helper.wrap``-ed calls: a compiled program holds integer kernels and
allow-listed torch functions and never stores Python code (docs/security.md), and a wrapped
function is Python. The common case is post-processing at the end of the model (anchor decoding,
score thresholds, top-k on the head's dequantized outputs). :func:`split_wrapped_tail` cuts such a
converted model in two GraphModules sharing its modules:

* ``head``: the model's inputs to the values the wrapped calls (and whatever follows them) read,
  returned as a tuple: everything before the wrapped calls, which ``compile_model`` compiles;
* ``tail``: those values (then the model inputs it reads) to the model's outputs: the wrapped
  calls and what follows them, run in torch as the converted model runs them.

``split.run(program, *inputs)`` feeds the program's outputs to the tail and equals the converted
model's outputs bit for bit. Integer modules the wrapped code calls (``WrappedModuleCall``) run in
the tail, in torch. Integer work that reads a wrapped call's result (a QuantStub after it) cannot
be a tail: such a model is refused, with the segmented recipe (docs/hybrid.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.quantization.wrapped_modules import WRAPPED_MODULES_KEY
from qir.utils.fx_helper import wrapped_original

__all__ = ["WrappedSplit", "split_wrapped_tail"]


@dataclass(frozen=True)
class WrappedSplit:
    """A converted model cut before its wrapped calls (:func:`split_wrapped_tail`)."""

    #: the model's inputs -> a tuple of the values the tail reads (compile this)
    head: torch.fx.GraphModule
    #: (*the head's outputs, *the model inputs at ``inputs_read``) -> the model's outputs
    tail: torch.fx.GraphModule
    #: positions of the model inputs the tail reads itself
    inputs_read: tuple[int, ...]

    def run(self, head: Callable[..., Any], *inputs: Any) -> Any:
        """The model's outputs: ``head`` (the compiled program, or :attr:`head` itself) on ``inputs``,
        then the tail on its outputs."""
        cut = head(*inputs)
        cut = tuple(cut) if isinstance(cut, (tuple, list)) else (cut,)
        return self.tail(*cut, *(inputs[i] for i in self.inputs_read))


def _wrapped(n: torch.fx.Node) -> bool:
    """A call of a function wrapped with qir's ``fx_helper.wrap`` or with ``torch.fx.wrap`` (recorded whole)."""
    return n.op == "call_function" and (wrapped_original(n.target) is not None or bool(n.meta.get("is_wrapped")))


def _integer_module(m: nn.Module) -> bool:
    """One of qir's integer modules other than a dequantize (which ends integer work); by the class's
    module and name, as qir.quantization does not import qir.nn, which builds on it."""
    mro = type(m).__mro__
    integer = type(m).__module__.startswith("qir.nn.quantized")
    return integer and not any(c.__name__ == "DeQuantStub" and c.__module__.startswith("qir.nn.quantized") for c in mro)


def split_wrapped_tail(model: torch.fx.GraphModule) -> WrappedSplit:
    """Cut converted ``model`` (a ``convert_fx`` result) before its ``fx_helper.wrap``-ed (or
    ``torch.fx.wrap``-ed) calls; ``model`` is not changed (both parts share its modules)."""
    if not isinstance(model, torch.fx.GraphModule):
        raise TypeError(f"split_wrapped_tail takes a convert_fx model (a GraphModule), got {type(model).__name__}")
    graph = model.graph
    nodes = list(graph.nodes)
    wrapped = [n for n in nodes if _wrapped(n)]
    if not wrapped:
        raise ValueError(
            f"{type(model).__name__} calls no fx_helper.wrap-ed or torch.fx.wrap-ed function: "
            "compile_model takes it whole"
        )
    tail: set[torch.fx.Node] = set()
    todo = list(wrapped)
    while todo:
        n = todo.pop()
        if n not in tail and n.op != "output":
            tail.add(n)
            todo.extend(n.users)
    for n in nodes:
        if n in tail and n.op == "call_module" and _integer_module(model.get_submodule(str(n.target))):
            first = next(w for w in wrapped if w in _ancestors(n))
            raise ValueError(
                f"integer module '{n.target}' ({type(model.get_submodule(str(n.target))).__name__}) computes on the "
                f"result of wrapped call {first.name}, so the wrapped code is not at the end of the model and cannot "
                "run after the compiled program: give the parts before and after it modules of their own and compile "
                "each (docs/hybrid.md, 'Segmented deployment')"
            )
    output = next(n for n in nodes if n.op == "output")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    read: list[torch.fx.Node] = []  # values from outside the tail that the tail or the output reads
    for n in nodes:
        if n in tail or n is output:
            read.extend(a for a in n.all_input_nodes if a not in tail and a not in read)
    cut = [a for a in read if a.op not in ("placeholder", "get_attr")]
    passed = [a for a in placeholders if a in read]
    held = [a for a in read if a.op == "get_attr"]  # the model's own tensors: the tail reads them itself
    return WrappedSplit(
        head=_head(model, tail, cut),
        tail=_tail(model, [*held, *(n for n in nodes if n in tail)], cut, passed, output),
        inputs_read=tuple(placeholders.index(p) for p in passed),
    )


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _module(model: torch.fx.GraphModule, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    gm = torch.fx.GraphModule(model, graph, class_name=type(model).__name__)
    gm.meta.update({k: v for k, v in model.meta.items() if k != WRAPPED_MODULES_KEY})
    gm.train(model.training)
    return gm


def _head(model: torch.fx.GraphModule, tail: set[torch.fx.Node], cut: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in model.graph.nodes:
        if n in tail or n.op == "output":
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[c] for c in cut))
    gm = _module(model, graph)
    if gm.graph.eliminate_dead_code():  # what only the tail read (shape arithmetic on an input)
        gm.delete_all_unused_submodules()
        gm.recompile()
    return gm


def _tail(
    model: torch.fx.GraphModule,
    tail: Sequence[torch.fx.Node],
    cut: Sequence[torch.fx.Node],
    passed: Sequence[torch.fx.Node],
    output: torch.fx.Node,
) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for c in (*cut, *passed):
        env[c] = graph.placeholder(c.name)
        env[c].meta = dict(c.meta)
    for n in tail:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.node_copy(output, lambda a: env[a])
    return _module(model, graph)
