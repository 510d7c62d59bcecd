"""Graph, Node and Value: the SSA core of the IR.

A :class:`Graph` is an ordered list of :class:`Node` (a doubly linked list, so insertion
and removal are O(1)). Every node defines exactly one :class:`Value` (the node itself);
graph inputs are :class:`Argument` values. Constants (weights, buffers) are nodes of the
``constant`` op whose data lives in :attr:`Graph.constants`, keyed by their state-dict
name. The graph's result is a (nested) Python structure whose leaves may be values.
"""

from __future__ import annotations

import copy
import keyword
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from qir.ir.op import IRError, Op, Ref, freeze, get_op_class, iter_refs
from qir.ir.stand_ins import refuse_stand_ins, stand_in_keys
from qir.ir.types import Type

if TYPE_CHECKING:
    import networkx as nx

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def sanitize_name(hint: str) -> str:
    """Turn any hint (``layer1.0.conv``) into a valid value name (``layer1_0_conv``)."""
    if hint.isascii() and hint.isidentifier() and not keyword.iskeyword(hint):
        return hint  # already valid (most hints: a graph names thousands of values)
    name = re.sub(r"[^A-Za-z0-9_]", "_", hint) or "v"
    if name[0].isdigit():
        name = "_" + name
    if keyword.iskeyword(name):
        name += "_"
    return name


class Value:
    """A named, typed SSA value. Tracks its users (nodes that take it as an operand)."""

    __slots__ = ("_users", "graph", "name", "type")

    def __init__(self, name: str, type: Type) -> None:
        self.name = name
        self.type = type
        self._users: dict[Node, int] = {}  # user -> number of operand slots using self
        self.graph: Graph | None = None

    @property
    def users(self) -> list[Node]:
        """Nodes that use this value, in insertion order of the use."""
        return list(self._users)

    @property
    def num_uses(self) -> int:
        """Operand slots that read this value, plus one per appearance in the graph output."""
        n = sum(self._users.values())
        if self.graph is not None:
            n += self.graph._output_uses.get(self, 0)
        return n

    def replace_all_uses_with(self, new: Value) -> None:
        if new is self:
            return
        for user in list(self._users):
            user.replace_operand(self, new)
        if self.graph is not None:
            self.graph._replace_in_output(self, new)

    def __repr__(self) -> str:
        return f"%{self.name}"


class Argument(Value):
    """A graph input. ``default`` is used when the caller omits it (fx placeholders)."""

    __slots__ = ("default", "has_default")

    def __init__(self, name: str, type: Type, default: Any = None, has_default: bool = False) -> None:
        super().__init__(name, type)
        self.default = default
        self.has_default = has_default


class Node(Value):
    """One op application: ``%name: type = op(operands...) @scope``.

    ``scope`` is the qualified name of the module the node came from (``layer1.0.conv1``)
    or None; emitters recreate that module path, so state-dict keys survive.
    """

    __slots__ = ("_operands", "meta", "next", "op", "prev", "scope")

    def __init__(
        self,
        op: Op,
        operands: Sequence[Value],
        type: Type,
        name: str = "",
        scope: str | None = None,
    ) -> None:
        super().__init__(name, type)
        self.op = op
        self._operands: list[Value] = []
        self.scope = scope
        self.prev: Node | None = None
        self.next: Node | None = None
        self.meta: dict[str, Any] = {}
        for v in operands:
            self._add_use(v)

    # -- operands --------------------------------------------------------------
    @property
    def operands(self) -> tuple[Value, ...]:
        return tuple(self._operands)

    def _add_use(self, v: Value) -> None:
        if not isinstance(v, Value):
            raise IRError(f"node %{self.name}: operand {v!r} is not a Value")
        self._operands.append(v)
        v._users[self] = v._users.get(self, 0) + 1

    def _drop_use(self, v: Value) -> None:
        c = v._users.get(self, 0) - 1
        if c <= 0:
            v._users.pop(self, None)
        else:
            v._users[self] = c

    def set_operands(self, operands: Sequence[Value]) -> None:
        for v in self._operands:
            self._drop_use(v)
        self._operands = []
        for v in operands:
            self._add_use(v)

    def set_operand(self, index: int, new: Value) -> None:
        old = self._operands[index]
        self._drop_use(old)
        self._operands[index] = new
        new._users[self] = new._users.get(self, 0) + 1

    def replace_operand(self, old: Value, new: Value) -> None:
        for i, v in enumerate(self._operands):
            if v is old:
                self.set_operand(i, new)

    @property
    def attrs(self) -> dict[str, Any]:
        return self.op.attributes()

    def __repr__(self) -> str:
        return f"%{self.name} = {self.op.name}({', '.join(repr(v) for v in self._operands)})"


class Graph:
    """An SSA graph of nodes with named, typed values.

    Build one with :meth:`add_input`, :meth:`add_node` / :meth:`create_node`,
    :meth:`add_constant` and :meth:`set_output`. Edit it with :meth:`insert_node`,
    :meth:`erase_node` and :meth:`Value.replace_all_uses_with`.
    """

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.inputs: list[Argument] = []
        self._head: Node | None = None
        self._tail: Node | None = None
        self._len = 0
        self._names: set[str] = set()
        self._counters: dict[str, int] = {}
        self.constants: dict[str, torch.Tensor] = {}
        #: Non-tensor objects the graph refers to by key: opaque modules, callables.
        self.objects: dict[str, Any] = {}
        self._output: Any = None
        self._output_uses: dict[Value, int] = {}
        self._const_tail: Node | None = None
        #: Whether the source module was in training mode (emitters restore it).
        self.training: bool = False

    # -- names -----------------------------------------------------------------
    def unique_name(self, hint: str) -> str:
        base = sanitize_name(hint)
        if base not in self._names:
            self._names.add(base)
            return base
        n = self._counters.get(base, 1)
        while f"{base}_{n}" in self._names:
            n += 1
        self._counters[base] = n + 1
        name = f"{base}_{n}"
        self._names.add(name)
        return name

    def _claim(self, v: Value, name: str, exact: bool) -> None:
        if exact:
            if not _IDENT.match(name):
                raise IRError(f"value name {name!r} is not an identifier")
            if name in self._names:
                raise IRError(f"value name %{name} is defined twice")
            self._names.add(name)
            v.name = name
        else:
            v.name = self.unique_name(name)
        v.graph = self

    def rename(self, v: Value, name: str) -> None:
        self._names.discard(v.name)
        self._claim(v, name, exact=False)

    # -- building --------------------------------------------------------------
    def add_input(
        self, name: str, type: Type, default: Any = None, has_default: bool = False, exact: bool = False
    ) -> Argument:
        arg = Argument(name, type, default, has_default)
        self._claim(arg, name, exact)
        self.inputs.append(arg)
        return arg

    def create_node(
        self,
        op: Op,
        operands: Sequence[Value] = (),
        type: Type | None = None,
        name: str | None = None,
        scope: str | None = None,
        exact_name: bool = False,
    ) -> Node:
        """A new, detached node. ``type`` defaults to the op's inferred result type."""
        if type is None:
            from qir.ir.unknown_dims import infer_type  # imports qir.ir.op, as this module does

            type = infer_type(op, [v.type for v in operands])
        node = Node(op, operands, type, "", scope)
        self._claim(node, name or op.name, exact_name)
        return node

    def add_node(
        self,
        op: Op,
        operands: Sequence[Value] = (),
        type: Type | None = None,
        name: str | None = None,
        scope: str | None = None,
        exact_name: bool = False,
    ) -> Node:
        """Create a node and append it at the end of the graph."""
        node = self.create_node(op, operands, type, name, scope, exact_name)
        self._link_after(node, self._tail)
        return node

    def add_constant(
        self,
        key: str,
        tensor: torch.Tensor,
        kind: str = "parameter",
        name: str | None = None,
        scope: str | None = None,
    ) -> Node:
        """Register ``tensor`` under ``key`` and add a ``constant`` node for it at the top."""
        if key in self.constants and self.constants[key] is not tensor:
            raise IRError(f"constant key {key!r} is already bound to another tensor")
        self.constants[key] = tensor
        # by name: the op classes build on this module (qir/ir/__init__.py registers them first)
        constant: Any = get_op_class("constant")
        op = constant(key=key, kind=kind)
        node = self.create_node(op, (), op.type_for(tensor), name or key, scope)
        self._link_after(node, self._last_constant())
        self._const_tail = node
        return node

    def _last_constant(self) -> Node | None:
        """The last node of the leading block of constants, in O(1) amortised.

        The cached tail stays valid while it is still linked into this graph and the node
        after it is not a constant; otherwise walk forward from it (or from the head).
        """
        n = self._const_tail
        if n is not None and (n.graph is not self or (n.prev is None and self._head is not n)):
            n = None
        if n is None:
            if self._head is None or self._head.op.name != "constant":
                return None
            n = self._head
        while n.next is not None and n.next.op.name == "constant":
            n = n.next
        self._const_tail = n
        return n

    def insert_node(self, node: Node, *, before: Node | None = None, after: Node | None = None) -> Node:
        if node.prev is not None or node.next is not None or self._head is node:
            raise IRError(f"node %{node.name} is already in a graph")
        if (before is None) == (after is None):
            raise ValueError("give exactly one of before= / after=")
        self._link_after(node, before.prev if before is not None else after)
        return node

    def _link_after(self, node: Node, prev: Node | None) -> None:
        node.graph = self
        if prev is None:
            node.next = self._head
            if self._head is not None:
                self._head.prev = node
            self._head = node
            if self._tail is None:
                self._tail = node
        else:
            node.prev = prev
            node.next = prev.next
            if prev.next is not None:
                prev.next.prev = node
            else:
                self._tail = node
            prev.next = node
        self._len += 1

    def erase_node(self, node: Node) -> None:
        """Remove an unused node (raises naming its users otherwise)."""
        if node._users or self._output_uses.get(node):
            users = ", ".join(f"%{u.name}" for u in node._users) or "the graph output"
            raise IRError(f"cannot erase %{node.name}: still used by {users}")
        for v in node._operands:
            node._drop_use(v)
        node._operands = []
        if node.prev is not None:
            node.prev.next = node.next
        else:
            self._head = node.next
        if node.next is not None:
            node.next.prev = node.prev
        else:
            self._tail = node.prev
        if node is self._const_tail:
            self._const_tail = node.prev if node.prev is not None and node.prev.op.name == "constant" else None
        node.prev = node.next = None
        node.graph = None
        self._len -= 1
        self._names.discard(node.name)

    # -- output ----------------------------------------------------------------
    @property
    def output(self) -> Any:
        return self._output

    def set_output(self, structure: Any) -> None:
        structure = plain_containers(structure)
        self._output_uses = {}
        self._output = structure
        for v in iter_values(structure):
            self._output_uses[v] = self._output_uses.get(v, 0) + 1

    @property
    def output_values(self) -> list[Value]:
        return list(iter_values(self._output))

    def _replace_in_output(self, old: Value, new: Value) -> None:
        if old in self._output_uses:
            self.set_output(map_values(self._output, lambda v: new if v is old else v))

    # -- iteration -------------------------------------------------------------
    @property
    def nodes(self) -> Iterator[Node]:
        n = self._head
        while n is not None:
            nxt = n.next
            yield n
            n = nxt

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Node]:
        return self.nodes

    def find(self, name: str) -> Value:
        for v in self.inputs:
            if v.name == name:
                return v
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no value %{name} in graph @{self.name}")

    def stand_ins(self) -> list[str]:
        """Keys of the constants bound to zero stand-ins (``parse_graph(allow_unbound=True)``),
        which verify does not check and nothing runs (:mod:`qir.ir.stand_ins`)."""
        return stand_in_keys(self.constants)

    def refuse_stand_ins(self, action: str) -> None:
        """Raise :class:`~qir.ir.stand_ins.StandInError` naming the stand-ins, if any, before
        the graph is executed (``action``: "run", "emit", "lower")."""
        refuse_stand_ins(self.name, self.constants, action)

    def constant_value(self, v: Value) -> torch.Tensor | None:
        """The tensor of a ``constant`` node, else None; an :class:`IRError` naming the node when
        its key has no tensor in :attr:`constants` (a graph that does not verify)."""
        if isinstance(v, Node) and v.op.name == "constant":
            key = v.op.key  # type: ignore[attr-defined]
            t = self.constants.get(key)
            if t is None:
                raise IRError(f"%{v.name}: constant {key!r} has no tensor in graph.constants; bind one")
            return t
        return None

    # -- algorithms ------------------------------------------------------------
    def to_networkx(self) -> nx.MultiDiGraph:
        """A networkx view: one graph node per value (name), one edge per operand slot."""
        import networkx as nx

        g = nx.MultiDiGraph()
        for a in self.inputs:
            g.add_node(a.name, value=a, op="input")
        for n in self.nodes:
            g.add_node(n.name, value=n, op=n.op.name)
        for n in self.nodes:
            for i, v in enumerate(n._operands):
                g.add_edge(v.name, n.name, index=i)
        return g

    def eliminate_dead_code(self) -> int:
        """Remove pure nodes with no uses, last to first. Returns how many were removed."""
        from qir.ir.op import Pure

        removed = 0
        n = self._tail
        while n is not None:
            prev = n.prev
            if n.op.has_trait(Pure) and not n._users and not self._output_uses.get(n):
                self.erase_node(n)
                removed += 1
            n = prev
        self.prune_constants()
        return removed

    def prune_constants(self) -> None:
        """Drop constant tensors no ``constant`` node refers to any more (one O(n) sweep)."""
        live = {n.op.key for n in self.nodes if n.op.name == "constant"}  # type: ignore[attr-defined]
        for key in [k for k in self.constants if k not in live]:
            del self.constants[key]

    def copy(self) -> Graph:
        """A deep copy of the structure; constant tensors and objects are shared."""
        g = Graph(self.name)
        g.training = self.training
        g.constants = dict(self.constants)
        g.objects = dict(self.objects)
        vmap: dict[Value, Value] = {}
        for a in self.inputs:
            vmap[a] = g.add_input(a.name, a.type, a.default, a.has_default, exact=True)
        for n in self.nodes:
            new = g.add_node(n.op, [vmap[v] for v in n._operands], n.type, n.name, n.scope, exact_name=True)
            new.meta = copy.copy(n.meta)
            vmap[n] = new
        g.set_output(map_values(self._output, lambda v: vmap[v]))
        return g

    def __str__(self) -> str:
        # the text printer builds on this module and installs itself (qir/ir/__init__.py imports it)
        return _PRINTER[0](self)


#: ``str(graph)``: the text form, set by :func:`set_graph_printer` (``qir.ir.printer.print_graph``).
_PRINTER: list[Callable[[Graph], str]] = [lambda g: f"<graph {g.name}>"]


def set_graph_printer(printer: Callable[[Graph], str]) -> None:
    """Install how ``str(graph)`` spells a graph."""
    _PRINTER[0] = printer


def iter_values(structure: Any) -> Iterator[Value]:
    if isinstance(structure, Value):
        yield structure
    elif isinstance(structure, (tuple, list)):
        for s in structure:
            yield from iter_values(s)
    elif isinstance(structure, dict):
        for s in structure.values():
            yield from iter_values(s)
    elif isinstance(structure, slice):
        for s in (structure.start, structure.stop, structure.step):
            yield from iter_values(s)


def plain_containers(structure: Any) -> Any:
    """``structure`` with list / dict subclasses (torch.fx's immutable_list / immutable_dict)
    as plain lists / dicts, which the text form prints; tuples (named or not) keep their type."""
    if type(structure) is not list and isinstance(structure, list):
        return [plain_containers(s) for s in structure]
    if type(structure) is not dict and isinstance(structure, dict):
        return {k: plain_containers(s) for k, s in structure.items()}
    if type(structure) is list:
        return [plain_containers(s) for s in structure] if any(_nested(s) for s in structure) else structure
    if type(structure) is dict:
        return (
            {k: plain_containers(s) for k, s in structure.items()}
            if any(map(_nested, structure.values()))
            else structure
        )
    if type(structure) is tuple:
        return tuple(plain_containers(s) for s in structure) if any(_nested(s) for s in structure) else structure
    return structure


def _nested(v: Any) -> bool:
    return isinstance(v, (list, dict, tuple))


def map_values(structure: Any, fn: Any) -> Any:
    if isinstance(structure, Value):
        return fn(structure)
    if isinstance(structure, tuple):
        return tuple(map_values(s, fn) for s in structure)
    if isinstance(structure, list):
        return [map_values(s, fn) for s in structure]
    if isinstance(structure, dict):
        return {k: map_values(s, fn) for k, s in structure.items()}
    if isinstance(structure, slice):
        return slice(map_values(structure.start, fn), map_values(structure.stop, fn), map_values(structure.step, fn))
    return structure


def split_operands(args: Any, leading: int = 0) -> tuple[list[Value], Any]:
    """Pull Values out of a nested argument structure.

    Returns the operand list and the structure with each Value replaced by a
    :class:`Ref` to its operand index. Used by front ends to build nodes whose
    attributes mention run-time values. ``leading`` reserves indices taken by
    operands the caller already placed first.
    """
    operands: list[Value] = []
    index: dict[int, int] = {}

    def sub(v: Value) -> Ref:
        key = id(v)
        if key not in index:
            index[key] = leading + len(operands)
            operands.append(v)
        return Ref(index[key])

    return operands, freeze(map_values(args, sub))


def refs_in_order(values: Iterable[Any]) -> list[int]:
    out: list[int] = []
    for v in values:
        out.extend(r.index for r in iter_refs(v))
    return out
