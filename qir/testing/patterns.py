"""Property helpers for patterns: a naive reference matcher and a maximality check.

::

    from qir.testing.patterns import assert_pattern_maximal
    assert_pattern_maximal(my_pattern, graph)   # the engine finds every match, and only those

:func:`brute_force_matches` shares nothing with the engine but the pattern data: it
tries every node as a root and, at commutative nodes, every order of the first two
operands, computes use counts itself, and enumerates every binding. See
docs/patterns.md for property-testing a fusion pattern with hypothesis.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from passes.patterns import AnyPattern, OpPattern, Pattern, as_pattern, find_all, match_all
from qir.ir import Commutative, Graph, Node, Value

__all__ = ["Binding", "assert_pattern_maximal", "brute_force_matches"]


@attrs.frozen
class Binding:
    """One way a pattern matches: the value and operand slot at each pre-order position."""

    root: Node
    values: tuple[Value, ...]
    slots: tuple[int | None, ...]

    def key(self) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
        return tuple(id(v) for v in self.values), self.slots

    def describe(self) -> str:
        pairs = zip(self.values, self.slots, strict=True)
        return ", ".join(f"%{v.name}" + ("" if s is None else f"[{s}]") for v, s in pairs)


_Partial = tuple[tuple[Value, ...], tuple[int | None, ...], dict[str, Value]]


def _use_counts(graph: Graph) -> dict[Value, int]:
    counts: dict[Value, int] = {}
    for n in graph.nodes:
        for v in n.operands:
            counts[v] = counts.get(v, 0) + 1
    for v in graph.output_values:
        counts[v] = counts.get(v, 0) + 1
    return counts


def _kind_ok(p: OpPattern, v: Value) -> bool:
    if not isinstance(v, Node):
        return False
    cls = type(v.op)
    if any(issubclass(cls, k) for k in p.kinds):
        return True
    return any(issubclass(t, want) for want in p.traits for t in cls.traits)


def _attr_holds(op: Any, attr: str, pred: Any) -> bool:
    if not hasattr(op, attr):
        return False
    value = getattr(op, attr)
    if callable(pred):
        return bool(pred(value))
    if isinstance(pred, (set, frozenset)):
        return value in pred
    return bool(value == pred)


def _merge(parts: Sequence[_Partial]) -> _Partial | None:
    values: tuple[Value, ...] = ()
    slots: tuple[int | None, ...] = ()
    caps: dict[str, Value] = {}
    for vs, ss, cs in parts:
        for k, v in cs.items():
            if k in caps and caps[k] is not v:
                return None
            caps[k] = v
        values += vs
        slots += ss
    return values, slots, caps


def _bind(p: Pattern, v: Value, slot: int | None, interior: bool, uses: Mapping[Value, int]) -> list[_Partial]:
    single = p.single_use if p.single_use is not None else (interior and isinstance(p, OpPattern))
    if single and uses.get(v, 0) != 1:
        return []
    here: dict[str, Value] = {p.name: v} if p.name else {}
    if isinstance(p, AnyPattern):
        return [((v,), (slot,), here)]
    if not isinstance(p, OpPattern):
        raise TypeError(f"brute_force_matches does not know pattern class {type(p).__name__}")
    if not _kind_ok(p, v):
        return []
    assert isinstance(v, Node)
    if not all(_attr_holds(v.op, a, pred) for a, pred in p.attr_preds):
        return []
    if not all(f(v) for f in p.node_preds):
        return []
    if p.operands is None:
        return [((v,), (slot,), here)]
    k = len(p.operands)
    if len(v.operands) < k:
        return []
    comm = p.commutative if p.commutative is not None else v.op.has_trait(Commutative)
    heads = list(itertools.permutations(range(2))) if comm and k >= 2 else [tuple(range(min(k, 2)))]
    out: list[_Partial] = []
    for head in heads:
        order = (*head, *range(len(head), k))
        choices = [_bind(cp, v.operands[i], i, True, uses) for cp, i in zip(p.operands, order, strict=True)]
        for combo in itertools.product(*choices):
            merged = _merge([((v,), (slot,), here), *combo])
            if merged is not None:
                out.append(merged)
    return out


def brute_force_matches(pattern: Any, graph: Graph) -> list[Binding]:
    """Every binding of ``pattern`` at every node of ``graph`` (roots in graph order)."""
    p = as_pattern(pattern)
    uses = _use_counts(graph)
    out: list[Binding] = []
    for node in graph.nodes:
        seen: set[Any] = set()
        for values, slots, _ in _bind(p, node, None, False, uses):
            b = Binding(node, values, slots)
            if b.key() not in seen:
                seen.add(b.key())
                out.append(b)
    return out


def assert_pattern_maximal(pattern: Any, graph: Graph, *, describe: Callable[[Graph], str] | None = None) -> None:
    """Assert the engine matches exactly where the brute-force matcher does.

    Checks that :func:`passes.patterns.find_all` reports every root that has a binding
    and no other, in graph order, and that :func:`passes.patterns.match_all` at each
    root yields exactly the brute-force bindings. ``describe`` renders the graph in the
    failure message (default: one line per node).
    """
    p = as_pattern(pattern)
    brute = brute_force_matches(p, graph)
    want_roots = list(dict.fromkeys(b.root for b in brute))
    got_roots = [m.root for m in find_all(p, graph)]
    text = describe(graph) if describe else "\n".join(f"  {n!r}" for n in graph.nodes)
    if got_roots != want_roots:
        missing = [f"%{n.name}" for n in want_roots if n not in got_roots]
        extra = [f"%{n.name}" for n in got_roots if n not in want_roots]
        raise AssertionError(
            f"pattern {p} matched at the wrong roots\n  missing: {missing}\n  extra: {extra}\n"
            f"  order: got {[n.name for n in got_roots]}, want {[n.name for n in want_roots]}\ngraph:\n{text}"
        )
    for root in want_roots:
        want = {b.key(): b for b in brute if b.root is root}
        got = {m.key(): m for m in match_all(p, root)}
        if set(got) != set(want):
            only_engine = [Binding(root, m.values, m.slots).describe() for k, m in got.items() if k not in want]
            only_brute = [b.describe() for k, b in want.items() if k not in got]
            raise AssertionError(
                f"pattern {p} at %{root.name}: bindings differ\n  engine only: {only_engine}\n"
                f"  brute force only: {only_brute}\ngraph:\n{text}"
            )
