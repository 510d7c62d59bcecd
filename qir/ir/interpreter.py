"""Execute a graph with torch, in float: the reference semantics for every test."""

from __future__ import annotations

from typing import Any

from qir.ir.graph import Graph, Value, map_values
from qir.ir.op import IRError
from qir.ir.ops.core import EvalContext


class Interpreter:
    """Runs a :class:`Graph` node by node (like ``torch.fx.Interpreter``).

    Subclass and override :meth:`run_node` to observe or change values.
    """

    def __init__(self, graph: Graph, training: bool | None = None) -> None:
        self.graph = graph
        self.ctx = EvalContext(graph.constants, graph.objects, graph.training if training is None else training)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        env: dict[Value, Any] = {}
        inputs = self.graph.inputs
        if len(args) > len(inputs):
            raise TypeError(f"graph @{self.graph.name} takes {len(inputs)} inputs, got {len(args)}")
        for i, a in enumerate(inputs):
            if i < len(args):
                env[a] = args[i]
            elif a.name in kwargs:
                env[a] = kwargs.pop(a.name)
            elif a.has_default:
                env[a] = a.default
            else:
                raise TypeError(f"graph @{self.graph.name}: missing input %{a.name}")
        if kwargs:
            raise TypeError(f"graph @{self.graph.name}: unknown inputs {sorted(kwargs)}")
        for node in self.graph.nodes:
            env[node] = self.run_node(node, [env[v] for v in node.operands])
        return map_values(self.graph.output, lambda v: env[v])

    def run_node(self, node: Any, operands: list[Any]) -> Any:
        try:
            return node.op.evaluate(self.ctx, operands)
        except IRError:
            raise
        except Exception as e:
            where = f" (module {node.scope})" if node.scope else ""
            raise IRError(f"node %{node.name} = {node.op.name}{where} failed: {type(e).__name__}: {e}") from e


def run_graph(graph: Graph, *args: Any, **kwargs: Any) -> Any:
    """Run ``graph`` on ``args`` and return its output structure."""
    return Interpreter(graph).run(*args, **kwargs)
