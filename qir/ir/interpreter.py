"""Execute a graph with torch, in float: the reference semantics for every test."""

from __future__ import annotations

from typing import Any

from qir.ir.graph import Graph, Value, map_values
from qir.ir.op import IRError
from qir.ir.ops.core import Call, EvalContext


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
        check_bound(self.graph)
        self.graph.refuse_stand_ins("run")
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


class UnboundModuleError(IRError):
    """A graph calls modules that are not bound in ``graph.objects`` (raised before any node runs)."""


def unbound_modules(graph: Graph) -> list[str]:
    """Targets of ``call(kind="module")`` nodes with no module in ``graph.objects`` (in graph order,
    once each). IR text carries no modules, so a parsed graph that calls one has them all unbound."""
    missing: dict[str, None] = {}
    for node in graph.nodes:
        op = node.op
        if isinstance(op, Call) and op.kind == "module" and f"module:{op.target}" not in graph.objects:
            missing[op.target] = None
    return list(missing)


def check_bound(graph: Graph) -> None:
    """Raise :class:`UnboundModuleError` naming every unbound module call of ``graph`` (and the node that makes
    it) before anything runs: a graph that verifies runs once its module calls are bound, and a
    half-run graph that stops at its first opaque module helps no one."""
    missing = unbound_modules(graph)
    if not missing:
        return
    first = next(
        n.name for n in graph.nodes if isinstance(n.op, Call) and n.op.kind == "module" and n.op.target == missing[0]
    )
    names = ", ".join(repr(t) for t in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise UnboundModuleError(
        f'graph @{graph.name} cannot run: call(kind="module") target(s) {names} have no module bound '
        f"(first at node %{first}); IR text carries no modules: bind each before running, "
        f"graph.objects['module:{missing[0]}'] = <the nn.Module>"
    )


def run_graph(graph: Graph, *args: Any, **kwargs: Any) -> Any:
    """Run ``graph`` on ``args`` and return its output structure."""
    return Interpreter(graph).run(*args, **kwargs)
