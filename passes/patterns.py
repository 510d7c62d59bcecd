"""Patterns as data, and the matcher.

A pattern describes a small tree of values rooted at one node::

    conv = P({Conv2d, Conv3d}, P.any("x")).named("conv").where(add=False, act=None)
    pat = P({Relu, Relu6}, P(Add, conv, P.any("other")))

* an **op pattern** (:class:`OpPattern`, built by :class:`P`) names the op kind (an op
  class, a set of op classes, or a :class:`~qir.ir.Trait`), constrains the node's
  *leading* operands (trailing ones, such as a conv's weight and bias, are free unless
  listed), and may carry attribute predicates and node predicates;
* a **wildcard** (:data:`Any`, also exported as the seeds' :data:`MatchAllNode`) matches
  any value, including graph inputs;
* ``P.const(...)`` matches a ``constant`` node (a weight or buffer);
* a **name** captures the value; a name used twice must bind the same value;
* operands of a node whose op has the :class:`~qir.ir.Commutative` trait (or of a pattern
  built with ``commutative=True``) match in either order; :attr:`Match.slots` says
  which operand slot each pattern position matched;
* an interior op node (not the root) must be **single use** by default: fusing it away
  would otherwise break its other users. ``.multi_use()`` lifts that.

The seeds' tuple form is accepted wherever a pattern is: ``(relu, (add, (bn, conv),
MatchAllNode))`` with torch spellings (module classes, functions, unbound methods) that
:func:`resolve_spelling` maps to IR op classes through their ``module_types``,
``functions`` and ``methods`` declarations.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator, Mapping, Sequence

import attrs

from qir.ir import OP_REGISTRY, Commutative, Graph, Node, Op, Trait, Value
from qir.ir.ops.core import Constant

__all__ = [
    "Any",
    "AnyPattern",
    "Match",
    "MatchAllNode",
    "MatchStats",
    "OpIndex",
    "OpPattern",
    "P",
    "Pattern",
    "PatternError",
    "PatternLike",
    "as_pattern",
    "find_all",
    "iter_matches",
    "match",
    "match_all",
    "resolve_spelling",
]


class PatternError(ValueError):
    """A malformed pattern or an unresolvable tuple-form entry."""


AttrPred = typing.Any  # a value (compared with ==), a set of allowed values, or a callable
NodePred = Callable[[Node], bool]


# --------------------------------------------------------------------------- pattern data

_P = typing.TypeVar("_P", bound="Pattern")


@attrs.frozen(eq=False)
class Pattern:
    """Base of pattern nodes. ``name`` captures the matched value."""

    name: str | None = None
    #: None: the default (interior op nodes single use, others free).
    single_use: bool | None = None

    @property
    def size(self) -> int:
        """Positions in this subtree (pre-order numbering of :attr:`Match.values`)."""
        return 1

    @property
    def depth(self) -> int:
        """Op levels in this subtree (a wildcard has depth 0)."""
        return 0

    def positions(self) -> tuple[Pattern, ...]:
        """Every position of the tree in pre-order (the order of :attr:`Match.values`)."""
        return (self,)

    def accepts_kind(self, op_type: type[Op]) -> bool:
        """Whether a node with this op class could be the root of a match."""
        return True

    def named(self: _P, name: str) -> _P:
        _check_name(name)
        return attrs.evolve(self, name=name)

    def multi_use(self: _P) -> _P:
        """Allow this (interior) position's value to have other users."""
        return attrs.evolve(self, single_use=False)

    def only_use(self: _P) -> _P:
        """Require this position's value to have exactly one use."""
        return attrs.evolve(self, single_use=True)


@attrs.frozen(eq=False)
class AnyPattern(Pattern):
    """Matches any value (a node or a graph input) that passes its predicates."""

    #: ``fn(value) -> bool``: all must hold
    value_preds: tuple[Callable[[Value], bool], ...] = ()

    def where(self, *preds: Callable[[Value], bool], **attr_preds: AttrPred) -> AnyPattern:
        """Add value predicates (``fn(value) -> bool``); the value may be a graph input, not a node."""
        if attr_preds:
            raise PatternError(
                f"{self}: a wildcard has no op attributes to test ({', '.join(attr_preds)}); "
                f"use P.op(kind, {next(iter(attr_preds))}=...) for a node of a known op"
            )
        for p in preds:
            if not callable(p):
                raise PatternError(f"{self}: where() predicates must be callables, got {p!r}")
        return attrs.evolve(self, value_preds=self.value_preds + preds)

    def __str__(self) -> str:
        head = "_"
        if self.value_preds:
            head += "{" + ", ".join(getattr(f, "__name__", "pred") for f in self.value_preds) + "}"
        return f"{head} @{self.name}" if self.name else head


#: The wildcard. ``Any.named("x")`` captures what it matched.
Any = AnyPattern()
#: The seeds' spelling of the wildcard.
MatchAllNode = Any


@attrs.frozen(eq=False)
class OpPattern(Pattern):
    """Matches a node whose op is one of ``kinds`` or has one of ``traits``."""

    kinds: tuple[type[Op], ...] = ()
    traits: tuple[type[Trait], ...] = ()
    #: Patterns for the leading operands; None leaves all operands free.
    operands: tuple[Pattern, ...] | None = None
    attr_preds: tuple[tuple[str, AttrPred], ...] = ()
    node_preds: tuple[NodePred, ...] = ()
    #: None: follow the op's Commutative trait. Applies to the first two operands.
    commutative: bool | None = None
    _size: int = attrs.field(init=False)
    _depth: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not self.kinds and not self.traits:
            raise PatternError("an op pattern needs at least one op class or trait")
        ops = self.operands or ()
        object.__setattr__(self, "_size", 1 + sum(p.size for p in ops))
        object.__setattr__(self, "_depth", 1 + max((p.depth for p in ops), default=0))
        if self.commutative and len(ops) < 2:
            raise PatternError(f"{self}: commutative=True needs at least two operand patterns")
        for attr, _ in self.attr_preds:
            missing = [k.__name__ for k in self.kinds if attr not in attrs.fields_dict(k)]
            if missing:
                raise PatternError(f"{self}: op class(es) {', '.join(missing)} have no attribute {attr!r}")

    @property
    def size(self) -> int:
        return self._size

    @property
    def depth(self) -> int:
        return self._depth

    def positions(self) -> tuple[Pattern, ...]:
        out: list[Pattern] = [self]
        for p in self.operands or ():
            out.extend(p.positions())
        return tuple(out)

    def accepts_kind(self, op_type: type[Op]) -> bool:
        return issubclass(op_type, self.kinds) or any(op_type.has_trait(t) for t in self.traits)

    def where(self, *preds: NodePred, **attr_preds: AttrPred) -> OpPattern:
        """Add node predicates (``fn(node) -> bool``) and attribute predicates.

        An attribute predicate is a value (``act=None``: equality), a set of allowed
        values (``act={None, "relu"}``) or a callable on the attribute value.
        """
        for p in preds:
            if not callable(p):
                raise PatternError(f"{self}: where() positional predicates must be callables, got {p!r}")
        return attrs.evolve(
            self, node_preds=self.node_preds + preds, attr_preds=self.attr_preds + tuple(attr_preds.items())
        )

    def __str__(self) -> str:
        head = "|".join([k.name or k.__name__ for k in self.kinds] + [t.__name__ for t in self.traits])
        if self.attr_preds:
            head += "{" + ", ".join(f"{k}={_pred_str(v)}" for k, v in self.attr_preds) + "}"
        if self.node_preds:
            head += "{" + ", ".join(getattr(f, "__name__", "pred") for f in self.node_preds) + "}"
        args = "" if self.operands is None else "(" + ", ".join(str(p) for p in self.operands) + ")"
        return head + args + (f" @{self.name}" if self.name else "")

    __repr__ = __str__


def _pred_str(v: AttrPred) -> str:
    if callable(v):
        return getattr(v, "__name__", "pred")
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(sorted(repr(x) for x in v)) + "}"
    return repr(v)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise PatternError(f"capture names must be non-empty strings, got {name!r}")


# --------------------------------------------------------------------------- builder


class P:
    """Builder: ``P(kind, *operands, name=..., commutative=..., single_use=..., **attr_preds)``.

    ``kind`` is an op class, a set/tuple/list of op classes, a trait, or a torch
    spelling (``nn.Conv2d``, ``F.relu``). Operands are patterns, the wildcard, or
    tuple-form specs. ``P.any(name)`` and ``P.const(name)`` build leaves.
    """

    def __new__(  # type: ignore[misc]
        cls,
        kind: typing.Any,
        *operands: typing.Any,
        name: str | None = None,
        commutative: bool | None = None,
        single_use: bool | None = None,
        **attr_preds: AttrPred,
    ) -> OpPattern:
        kinds, traits, preds = _resolve_kind_flavors(kind)
        if name is not None:
            _check_name(name)
        return OpPattern(
            name=name,
            single_use=single_use,
            kinds=kinds,
            traits=traits,
            operands=tuple(as_pattern(o) for o in operands) if operands else None,
            attr_preds=tuple(attr_preds.items()),
            node_preds=preds,
            commutative=commutative,
        )

    @staticmethod
    def op(kind: typing.Any, name: str | None = None, **attr_preds: AttrPred) -> OpPattern:
        """A node of ``kind`` whose operands are all free."""
        kinds, traits, preds = _resolve_kind_flavors(kind)
        return OpPattern(name=name, kinds=kinds, traits=traits, attr_preds=tuple(attr_preds.items()), node_preds=preds)

    @staticmethod
    def any(name: str | None = None) -> AnyPattern:
        """The wildcard, optionally capturing what it matched."""
        return Any if name is None else Any.named(name)

    @staticmethod
    def const(name: str | None = None, tensor: Callable[[typing.Any], bool] | None = None) -> OpPattern:
        """A ``constant`` node; ``tensor`` is an optional predicate on its tensor."""
        preds: tuple[NodePred, ...] = ()
        if tensor is not None:
            check = tensor

            def const_tensor(n: Node) -> bool:
                t = n.graph.constant_value(n) if isinstance(n.graph, Graph) else None
                return t is not None and bool(check(t))

            preds = (const_tensor,)
        return OpPattern(name=name, kinds=(Constant,), node_preds=preds, single_use=False)


def _resolve_kind(kind: typing.Any) -> tuple[tuple[type[Op], ...], tuple[type[Trait], ...]]:
    kinds, traits, _ = _resolve_kind_flavors(kind)
    return kinds, traits


def _resolve_kind_flavors(
    kind: typing.Any,
) -> tuple[tuple[type[Op], ...], tuple[type[Trait], ...], tuple[NodePred, ...]]:
    """Op classes, traits, and a node predicate when a module class names one flavour of an op
    class that stands for several (``nn.BatchNorm1d`` of ``batch_norm``)."""
    entries = list(kind) if isinstance(kind, (set, frozenset, list, tuple)) else [kind]
    kinds: list[type[Op]] = []
    traits: list[type[Trait]] = []
    #: op class -> the module classes allowed (absent: any node of the class)
    flavors: dict[type[Op], set[type] | None] = {}
    for e in entries:
        if isinstance(e, type) and issubclass(e, Trait):
            traits.append(e)
        elif isinstance(e, type) and issubclass(e, Op):
            kinds.append(e)
            flavors[e] = None
        elif isinstance(e, str) and e in _op_registry():
            kinds.append(_op_registry()[e])  # an IR op name: "conv2d", "batch_norm"
            flavors[_op_registry()[e]] = None
        else:
            found = resolve_spelling(e)
            kinds.extend(found)
            for op_cls in found:
                flavor = _module_flavor_of(op_cls, e)
                if flavor is None or flavors.get(op_cls, set()) is None:
                    flavors[op_cls] = None
                else:
                    flavors.setdefault(op_cls, set()).add(flavor)  # type: ignore[union-attr]
    if not kinds and not traits:
        raise PatternError(f"empty op kind {kind!r}")
    narrowed = {k: v for k, v in flavors.items() if v is not None}
    preds: tuple[NodePred, ...] = ()
    if narrowed:
        names = "/".join(sorted(t.__name__ for v in narrowed.values() for t in v))

        def module_flavor(n: Node) -> bool:
            allowed = narrowed.get(type(n.op))
            return allowed is None or n.op.module_flavor() in allowed  # type: ignore[attr-defined]

        module_flavor.__name__ = f"module={names}"
        preds = (module_flavor,)
    # dedupe, keep a stable order so printed patterns are reproducible
    return tuple(dict.fromkeys(kinds)), tuple(dict.fromkeys(traits)), preds


def _op_registry() -> dict[str, type[Op]]:
    import qir.ir.ops  # noqa: F401  (registers the built-in ops)

    return OP_REGISTRY


def _module_flavor_of(op_cls: type[Op], entry: typing.Any) -> type | None:
    """The module class of ``op_cls.module_types`` that ``entry`` (a module class or a subclass
    of one) names, when ``op_cls`` stands for several and can tell them apart; else None."""
    module_types = tuple(getattr(op_cls, "module_types", ()))
    if len(module_types) < 2 or not hasattr(op_cls, "module_flavor") or not isinstance(entry, type):
        return None
    if issubclass(entry, tuple(getattr(op_cls, "any_flavor_modules", ()))):
        return None  # e.g. SyncBatchNorm: one class for every rank
    for base in entry.__mro__:
        if base in module_types:
            return base
    return None


# --------------------------------------------------------------------------- torch spellings


_SPELLINGS: dict[typing.Any, set[type[Op]]] = {}
_SPELLINGS_SIZE = -1


def _spelling_index() -> dict[typing.Any, set[type[Op]]]:
    """torch spelling -> op classes, rebuilt when more ops have been registered."""
    global _SPELLINGS_SIZE
    import qir.ir.ops  # noqa: F401  (registers the built-in ops)

    if _SPELLINGS_SIZE != len(OP_REGISTRY):
        _SPELLINGS.clear()
        for op_cls in OP_REGISTRY.values():
            spellings: list[typing.Any] = [*op_cls.functions, *op_cls.methods]
            spellings += list(getattr(op_cls, "module_types", ()))
            for s in spellings:
                _SPELLINGS.setdefault(s, set()).add(op_cls)
        _SPELLINGS_SIZE = len(OP_REGISTRY)
    return _SPELLINGS


def resolve_spelling(entry: typing.Any) -> tuple[type[Op], ...]:
    """The IR op classes a torch spelling stands for.

    Looked up in order: the op classes' ``functions`` / ``methods`` / ``module_types``
    (module classes also through their bases, so user subclasses resolve); then an
    unbound method such as ``FloatFunctional.add`` or ``torch.Tensor.add`` by its
    method name. Raises :class:`PatternError` naming the entry when nothing matches.
    """
    index = _spelling_index()
    found: set[type[Op]] = set()
    try:
        found |= index.get(entry, set())
    except TypeError:  # unhashable entries cannot be spellings
        pass
    if not found and isinstance(entry, type):
        for base in entry.__mro__[1:]:
            if base in index:
                found |= index[base]
                break
    if not found and not isinstance(entry, (type, str)) and callable(entry):
        qual = getattr(entry, "__qualname__", "") or ""
        owner = getattr(entry, "__objclass__", None)
        if owner is not None or "." in qual:
            found |= index.get(getattr(entry, "__name__", None), set())
    if not found:
        what = getattr(entry, "__qualname__", None) or repr(entry)
        raise PatternError(
            f"pattern entry {what!r} names no registered op: no op class lists it in module_types, functions or methods"
        )
    return tuple(sorted(found, key=lambda c: c.name))


def _torch_match_all() -> type | None:
    try:
        from torch.ao.quantization.utils import MatchAllNode as TorchMatchAll
    except ImportError:  # older/newer torch without it: only qir's spelling is accepted
        return None
    return TorchMatchAll


_TORCH_MATCH_ALL = _torch_match_all()

PatternLike = typing.Union[Pattern, tuple, type, Callable[..., typing.Any], str]  # noqa: UP007


def as_pattern(spec: typing.Any) -> Pattern:
    """A :class:`Pattern` from a pattern or the seeds' tuple form ``(op, *operand_specs)``.

    A bare (non-tuple) entry is an op whose operands are all free. The head of a tuple
    may be a set/list of spellings (alternatives).
    """
    if isinstance(spec, Pattern):
        return spec
    if spec is MatchAllNode or (_TORCH_MATCH_ALL is not None and spec is _TORCH_MATCH_ALL):
        return Any
    if isinstance(spec, tuple):
        if not spec:
            raise PatternError("empty tuple pattern")
        head, *rest = spec
        kinds, traits, preds = _resolve_kind_flavors(head if isinstance(head, (set, frozenset, list)) else [head])
        operands = tuple(as_pattern(r) for r in rest) or None
        return OpPattern(kinds=kinds, traits=traits, operands=operands, node_preds=preds)
    kinds, traits, preds = _resolve_kind_flavors(spec if isinstance(spec, (set, frozenset, list)) else [spec])
    return OpPattern(kinds=kinds, traits=traits, node_preds=preds)


# --------------------------------------------------------------------------- matches


@attrs.frozen(eq=False)
class Match:
    """One way a pattern matched at :attr:`root`.

    ``values[i]`` is the value at pattern position ``i`` (pre-order, see
    :meth:`Pattern.positions`); ``slots[i]`` the operand index it occupies in its
    parent's node (None for the root), which tells on which side of a commutative op
    a sub-pattern was found.
    """

    pattern: Pattern
    values: tuple[Value, ...]
    slots: tuple[int | None, ...]
    names: Mapping[str, int]

    @property
    def root(self) -> Node:
        root = self.values[0]
        assert isinstance(root, Node)
        return root

    @property
    def captures(self) -> dict[str, Value]:
        return {k: self.values[i] for k, i in self.names.items()}

    @property
    def nodes(self) -> tuple[Node, ...]:
        """Values at op positions (root first): what a fusion consumes."""
        pairs = zip(self.pattern.positions(), self.values, strict=True)
        return tuple(v for p, v in pairs if isinstance(p, OpPattern) and isinstance(v, Node))

    def __getitem__(self, name: str) -> Value:
        try:
            return self.values[self.names[name]]
        except KeyError:
            raise KeyError(f"no capture {name!r} in match of {self.pattern}; captures: {sorted(self.names)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def node(self, name: str) -> Node:
        """The captured value ``name``, which must be a node."""
        v = self[name]
        if not isinstance(v, Node):
            raise TypeError(f"capture {name!r} is %{v.name}, a graph input, not a node")
        return v

    def slot(self, name: str) -> int | None:
        return self.slots[self.names[name]]

    def key(self) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
        """Identity of the binding (for comparing matches)."""
        return tuple(id(v) for v in self.values), self.slots

    def __repr__(self) -> str:
        caps = ", ".join(f"{k}=%{v.name}" for k, v in self.captures.items())
        return f"Match(%{self.values[0].name}: {self.pattern}{'; ' + caps if caps else ''})"


class _State:
    """Bindings under construction; undone on backtracking."""

    __slots__ = ("caps", "slots", "values")

    def __init__(self, size: int) -> None:
        self.values: list[Value | None] = [None] * size
        self.slots: list[int | None] = [None] * size
        self.caps: dict[str, int] = {}


def _attr_ok(op: Op, attr: str, pred: AttrPred) -> bool:
    try:
        value = getattr(op, attr)
    except AttributeError:
        return False
    if callable(pred):
        return bool(pred(value))
    if isinstance(pred, (set, frozenset)):
        return value in pred
    return bool(value == pred)


def _node_ok(p: OpPattern, v: Value, interior: bool) -> bool:
    """Everything about one position except its operands."""
    if not isinstance(v, Node) or not p.accepts_kind(type(v.op)):
        return False
    single = p.single_use if p.single_use is not None else interior
    if single and v.num_uses != 1:
        return False
    return all(_attr_ok(v.op, a, pred) for a, pred in p.attr_preds) and all(f(v) for f in p.node_preds)


def _match(p: Pattern, v: Value, pos: int, slot: int | None, interior: bool, st: _State) -> Iterator[None]:
    """Yield once per way ``p`` matches ``v`` with ``st`` filled in; restore ``st`` after."""
    if isinstance(p, OpPattern):
        if not _node_ok(p, v, interior):
            return
    elif p.single_use and v.num_uses != 1:
        return
    elif isinstance(p, AnyPattern) and not all(f(v) for f in p.value_preds):
        return
    bound_name = False
    if p.name is not None:
        prev = st.caps.get(p.name)
        if prev is not None and st.values[prev] is not v:
            return
        if prev is None:
            st.caps[p.name] = pos
            bound_name = True
    st.values[pos], st.slots[pos] = v, slot
    try:
        if isinstance(p, OpPattern) and p.operands is not None:
            assert isinstance(v, Node)
            yield from _match_operands(p, v, pos, st)
        else:
            yield
    finally:
        st.values[pos] = st.slots[pos] = None
        if bound_name:
            del st.caps[p.name]  # type: ignore[arg-type]


def _operand_orders(p: OpPattern, node: Node) -> list[tuple[int, ...]]:
    n = len(p.operands or ())
    order = tuple(range(n))
    comm = p.commutative if p.commutative is not None else node.op.has_trait(Commutative)
    if comm and n >= 2:
        return [order, (1, 0, *order[2:])]
    if comm and n == 1 and len(node.operands) >= 2:
        return [(0,), (1,)]  # one operand pattern: it may be either side of a commutative op
    return [order]


def _match_operands(p: OpPattern, node: Node, pos: int, st: _State) -> Iterator[None]:
    pats = p.operands or ()
    operands = node.operands
    if len(operands) < len(pats):
        return
    # child positions in pre-order, fixed by the pattern (not by the node's order)
    child_pos = []
    nxt = pos + 1
    for c in pats:
        child_pos.append(nxt)
        nxt += c.size
    for order in _operand_orders(p, node):
        yield from _match_seq(pats, child_pos, operands, order, 0, st)


def _match_seq(
    pats: Sequence[Pattern],
    child_pos: Sequence[int],
    operands: Sequence[Value],
    order: Sequence[int],
    i: int,
    st: _State,
) -> Iterator[None]:
    if i == len(pats):
        yield
        return
    slot = order[i]
    for _ in _match(pats[i], operands[slot], child_pos[i], slot, True, st):
        yield from _match_seq(pats, child_pos, operands, order, i + 1, st)


def iter_matches(pattern: PatternLike, value: Value) -> Iterator[Match]:
    """Every way ``pattern`` matches with its root at ``value`` (duplicates removed).

    Order: operands as given first, then commutative swaps, depth first.
    """
    p = as_pattern(pattern)
    st = _State(p.size)
    seen: set[tuple[tuple[int, ...], tuple[int | None, ...]]] = set()
    for _ in _match(p, value, 0, None, False, st):
        m = Match(p, tuple(st.values), tuple(st.slots), dict(st.caps))  # type: ignore[arg-type]
        k = m.key()
        if k not in seen:  # add(x, x) matches the same way in both orders
            seen.add(k)
            yield m


def match(pattern: PatternLike, value: Value) -> Match | None:
    """The first match of ``pattern`` rooted at ``value``, or None."""
    return next(iter_matches(pattern, value), None)


def match_all(pattern: PatternLike, value: Value) -> list[Match]:
    """All distinct matches of ``pattern`` rooted at ``value``."""
    return list(iter_matches(pattern, value))


# --------------------------------------------------------------------------- graph scans


@attrs.define
class MatchStats:
    """Counters for one pattern: roots tried (after the op-kind filter) and matches."""

    tried: int = 0
    matched: int = 0


class OpIndex:
    """Nodes of a graph grouped by op class, in graph order: one O(n) sweep.

    Lets :func:`find_all` visit only nodes whose op could be a pattern's root; build
    one index to scan a graph with many patterns.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.by_type: dict[type[Op], list[tuple[int, Node]]] = {}
        for i, n in enumerate(graph.nodes):
            self.by_type.setdefault(type(n.op), []).append((i, n))

    def candidates(self, pattern: Pattern) -> list[Node]:
        """Nodes that could be roots of ``pattern``, in graph order."""
        lists = [lst for t, lst in self.by_type.items() if pattern.accepts_kind(t)]
        if len(lists) == 1:
            return [n for _, n in lists[0]]
        return [n for _, n in sorted((e for lst in lists for e in lst), key=lambda e: e[0])]


def find_all(
    pattern: PatternLike, graph: Graph, *, index: OpIndex | None = None, stats: MatchStats | None = None
) -> list[Match]:
    """The first match at every node where ``pattern`` matches, in graph order."""
    p = as_pattern(pattern)
    idx = index if index is not None else OpIndex(graph)
    out: list[Match] = []
    for node in idx.candidates(p):
        m = match(p, node)
        if stats is not None:
            stats.tried += 1
            stats.matched += m is not None
        if m is not None:
            out.append(m)
    return out
