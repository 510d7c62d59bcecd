"""Graph well-formedness: acyclic, definitions before uses, consistent types, valid ops."""

from __future__ import annotations

from qir.ir.graph import Argument, Graph, Node, Value
from qir.ir.op import IRError
from qir.ir.types import TensorType, Type


class VerifyError(IRError):
    """A graph failed verification. ``node`` names the offending value (when known)."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


def _fail(node: Value | None, msg: str) -> VerifyError:
    if node is None:
        return VerifyError(msg)
    where = f" (module {node.scope})" if isinstance(node, Node) and node.scope else ""
    return VerifyError(f"%{node.name}{where}: {msg}", node.name)


def verify(graph: Graph, check_types: bool = True) -> None:
    """Raise :class:`VerifyError` naming the first bad node; return None when the graph is sound.

    Checks: unique names, every operand defined earlier in the same graph (which also
    rules out cycles), use lists consistent with operands, op arity and per-op rules,
    constants bound, output values defined, and (``check_types``) that each node's
    declared type matches what its op infers where the op can infer it.
    """
    defined: set[Value] = set()
    names: set[str] = set()
    for a in graph.inputs:
        if not isinstance(a, Argument):
            raise _fail(a, "graph input is not an Argument")
        if a.name in names:
            raise _fail(a, "name defined twice")
        names.add(a.name)
        defined.add(a)
    count = 0
    prev: Node | None = None
    for n in graph.nodes:
        count += 1
        if n.prev is not prev:
            raise _fail(n, "node list links are corrupt")
        prev = n
        if n.name in names:
            raise _fail(n, "name defined twice")
        names.add(n.name)
        for i, v in enumerate(n.operands):
            if v not in defined:
                if v.graph is not graph:
                    raise _fail(n, f"operand {i} %{v.name} belongs to another graph")
                raise _fail(n, f"operand {i} %{v.name} is used before it is defined (or forms a cycle)")
            if n not in v._users:
                raise _fail(n, f"operand {i} %{v.name} does not list this node as a user")
        try:
            n.op.verify([v.type for v in n.operands])
        except IRError as e:
            raise _fail(n, str(e)) from None
        if n.op.name == "constant":
            key = n.op.key  # type: ignore[attr-defined]
            if key not in graph.constants:
                raise _fail(n, f"constant {key!r} has no tensor in graph.constants")
            t = graph.constants[key]
            if isinstance(n.type, TensorType) and tuple(t.shape) != n.type.shape:
                raise _fail(n, f"constant {key!r} has shape {tuple(t.shape)}, declared {n.type}")
        elif check_types:
            _check_type(n)
        defined.add(n)
    if count != len(graph):
        raise VerifyError(f"graph @{graph.name}: node count {len(graph)} disagrees with the list ({count})")
    for v in graph.output_values:
        if v not in defined:
            raise _fail(v, "graph output is not defined in the graph")


def _check_type(n: Node) -> None:
    try:
        inferred: Type = n.op.infer_type([v.type for v in n.operands])
    except (IRError, NotImplementedError):
        return  # ops that cannot infer (opaque calls, data-dependent) keep their declared type
    except Exception as e:  # torch rejected the operand shapes on meta tensors
        raise _fail(n, f"op {n.op.name!r} rejects its operand types: {type(e).__name__}: {e}") from None
    declared = n.type
    if isinstance(declared, TensorType) and isinstance(inferred, TensorType):
        if declared.shape != inferred.shape or declared.dtype.to_torch() != inferred.dtype.to_torch():
            raise _fail(n, f"declared type {declared} but op {n.op.name!r} gives {inferred}")
