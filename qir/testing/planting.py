"""Hypothesis strategies that plant a given pattern (or a near miss of it) in random context.

``graphs()`` draws graphs over a set of ops, which rarely contain a particular multi-op
pattern; ``planted_graphs(pattern)`` builds one instance of the pattern on a random value
of a random graph, so a property test of a pattern's rewrite exercises it in most examples.
Near misses check the rewrite leaves almost-matches alone:

- ``"op"``: one op position gets a different op;
- ``"outside"``: one interior operand comes from outside the instance (another value);
- ``"extra_use"``: one interior value gets another user, breaking single use.

Every planted op keeps its first operand's type (convolutions and linear layers are square,
pooling is 3x3 / stride 1 / padding 1, ``matmul`` multiplies by a square constant), so
operands of any position fit together; ``cat`` joins along channels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from passes.patterns import AnyPattern, OpPattern, Pattern, as_pattern
from qir.ir.graph import Node, Value
from qir.ir.op import OP_REGISTRY, IRError, Op
from qir.ir.types import TensorType
from qir.testing.strategies import DEFAULT_OPS, Draw, _batch_norm, _Builder, _builder_for

__all__ = ["NEAR_MISSES", "PLANTABLE_OPS", "planted_graphs"]

NEAR_MISSES = ("op", "outside", "extra_use")


def _op(name: str) -> Any:
    """The op class registered as ``name`` (typed loosely: each takes its own attributes)."""
    return OP_REGISTRY[name]


def _shape(v: Value) -> tuple[int, ...]:
    assert isinstance(v.type, TensorType)
    return v.type.shape


def _conv(b: _Builder, xs: Sequence[Value]) -> Node:
    c = _shape(xs[0])[1]
    scope = b.scope()
    w = b.const(scope, "weight", b.rand(c, c, 1, 1) / c**0.5)
    return b.graph.add_node(_op("conv2d")(bias=False), [xs[0], w], scope=scope)


def _linear(b: _Builder, xs: Sequence[Value]) -> Node:
    n = _shape(xs[0])[-1]
    scope = b.scope()
    w = b.const(scope, "weight", b.rand(n, n) / n**0.5)
    return b.graph.add_node(_op("linear")(bias=False), [xs[0], w], scope=scope)


def _matmul(b: _Builder, xs: Sequence[Value]) -> Node:
    n = _shape(xs[0])[-1]
    other = xs[1] if len(xs) > 1 else b.const(b.scope(), "weight", b.rand(n, n) / n**0.5)
    return b.graph.add_node(_op("matmul")(), [xs[0], other])


def _binary(name: str) -> Callable[[_Builder, Sequence[Value]], Node]:
    def build(b: _Builder, xs: Sequence[Value]) -> Node:
        return b.graph.add_node(_op(name)(), [xs[0], xs[1] if len(xs) > 1 else xs[0]])

    return build


def _cat(b: _Builder, xs: Sequence[Value]) -> Node:
    parts = list(xs) if len(xs) > 1 else [xs[0], xs[0]]
    return b.graph.add_node(_op("cat")(dim=1), parts)


def _pool(name: str) -> Callable[[_Builder, Sequence[Value]], Node]:
    def build(b: _Builder, xs: Sequence[Value]) -> Node:
        return b.graph.add_node(_op(name)(kernel_size=3, stride=1, padding=1), [xs[0]])

    return build


def _unary_from_strategies(name: str) -> Callable[[_Builder, Sequence[Value]], Node]:
    build = _builder_for(name)
    return lambda b, xs: build(b, xs[0])


_PLANTERS: dict[str, Callable[[_Builder, Sequence[Value]], Node]] = {
    "conv2d": _conv,
    "batch_norm": lambda b, xs: _batch_norm(b, xs[0]),
    "linear": _linear,
    "matmul": _matmul,
    "add": _binary("add"),
    "mul": _binary("mul"),
    "cat": _cat,
    "max_pool2d": _pool("max_pool2d"),
    "avg_pool2d": _pool("avg_pool2d"),
}
_TWO_OPERANDS = frozenset({"add", "mul", "cat"})
#: ops a planted position can be built as (any simple unary op of graphs() works too)
PLANTABLE_OPS = tuple(sorted(_PLANTERS))


def _planter(cls: type[Op]) -> Callable[[_Builder, Sequence[Value]], Node] | None:
    if cls.name in _PLANTERS:
        return _PLANTERS[cls.name]
    try:
        return _unary_from_strategies(cls.name)
    except IRError:
        return None


def _choices(p: OpPattern) -> list[type[Op]]:
    """Op classes that fill position ``p``: its kinds, their registered subclasses, its traits' ops."""
    out = [c for c in OP_REGISTRY.values() if p.accepts_kind(c) and _planter(c) is not None]
    if not out:
        raise IRError(
            f"planted_graphs(): no generator for any op of pattern position {p}; "
            f"plantable: {', '.join(PLANTABLE_OPS)} and the single-operand ops of graphs()"
        )
    return sorted(out, key=lambda c: c.name)


class _Planter:
    def __init__(self, b: _Builder, draw: Draw, anchor: Value, miss: str | None, target: int) -> None:
        self.b, self.draw, self.anchor, self.miss, self.target = b, draw, anchor, miss, target
        self.position = 0
        self.interior: list[Value] = []

    def outside(self, like: Value) -> Value:
        same = [v for v in self.b.pool if v.type == like.type and v is not like]
        if same and self.draw(st.booleans()):
            return same[self.draw(st.integers(0, len(same) - 1))]
        return self.b.graph.add_input(f"o{len(self.b.graph.inputs)}", like.type)

    def build(self, p: Pattern) -> Value:
        here = self.position
        self.position += 1
        if isinstance(p, AnyPattern) or not isinstance(p, OpPattern):
            return self.anchor if self.draw(st.booleans()) else self.outside(self.anchor)
        kids = [self.build(c) for c in (p.operands or ())]
        choices = _choices(p)
        cls = choices[self.draw(st.integers(0, len(choices) - 1))]
        if self.miss == "op" and here == self.target:
            # another type-preserving op taking any operands (cat changes the channel count; matmul needs H == W)
            safe = _PLANTERS.keys() - {"cat", "matmul"}
            others = [c for c in OP_REGISTRY.values() if not p.accepts_kind(c) and c.name in safe]
            cls = others[self.draw(st.integers(0, len(others) - 1))]
        if self.miss == "outside" and here == self.target and kids:
            kids[0] = self.outside(kids[0])
        inputs = kids or [self.anchor]
        if cls.name in _TWO_OPERANDS and len(inputs) == 1:
            # the free operand comes from elsewhere: reusing the planted value would break single use
            inputs = [inputs[0], self.outside(inputs[0]) if kids else inputs[0]]
        node = _planter(cls)(self.b, inputs)  # type: ignore[misc]
        if here != 0:
            self.interior.append(node)
        return node


def _op_positions(p: Pattern) -> list[int]:
    return [i for i, q in enumerate(p.positions()) if isinstance(q, OpPattern)]


def _interior_op_positions(p: Pattern) -> list[int]:
    return [i for i in _op_positions(p) if i != 0]


@st.composite
def planted_graphs(
    draw: Draw,
    pattern: Any,
    near_miss: str | None = None,
    context_ops: Sequence[str] = DEFAULT_OPS,
    max_context: int = 3,
    channels: int | tuple[int, int] = (1, 4),
    size: int | tuple[int, int] = (2, 4),
) -> Any:
    """Graphs holding one instance of ``pattern`` (a pattern or the seeds' tuple form) on a
    random value, between random context nodes over ``context_ops``; with ``near_miss`` (one
    of :data:`NEAR_MISSES`) the instance is broken in that one way."""
    p = as_pattern(pattern)
    if near_miss is not None and near_miss not in NEAR_MISSES:
        raise ValueError(f"planted_graphs(): near_miss must be one of {NEAR_MISSES} or None, got {near_miss!r}")
    lo, hi = (1, channels) if isinstance(channels, int) else channels
    slo, shi = (1, size) if isinstance(size, int) else size
    b = _Builder(draw, (lo, hi), draw(st.integers(0, 2**31 - 1)))
    shape = (1, draw(st.integers(lo, hi)), draw(st.integers(slo, shi)), draw(st.integers(slo, shi)))
    b.pool.append(b.graph.add_input("x", TensorType(shape)))
    before = [_builder_for(n) for n in context_ops]
    for _ in range(draw(st.integers(0, max_context))):
        b.pool.append(before[draw(st.integers(0, len(before) - 1))](b, b.pool[-1]))
    anchor = b.pool[draw(st.integers(0, len(b.pool) - 1))]
    targets = {
        "op": _op_positions(p),
        "outside": [i for i in _op_positions(p) if getattr(p.positions()[i], "operands", None)],
    }
    targets["extra_use"] = _interior_op_positions(p)
    target = -1
    if near_miss is not None:
        where = targets[near_miss]
        if not where:
            raise ValueError(f"planted_graphs(): pattern {p} has no position for a {near_miss!r} near miss")
        target = where[draw(st.integers(0, len(where) - 1))]
    planter = _Planter(b, draw, anchor, near_miss, target)
    root = planter.build(p)
    outputs: list[Value] = [root]
    if near_miss == "extra_use" and planter.interior:
        outputs.append(planter.interior[draw(st.integers(0, len(planter.interior) - 1))])
    b.graph.set_output(tuple(outputs) if len(outputs) > 1 else root)
    return b.graph
