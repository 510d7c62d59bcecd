"""Hypothesis strategies for random, valid IR graphs and their inputs.

::

    from hypothesis import given
    from qir.testing import graphs, inputs_for

    @given(graphs(ops=("conv2d", "batch_norm", "relu", "add"), max_nodes=6), st.data())
    def test_my_pass(g, data):
        args = data.draw(inputs_for(g))
        ...

Graphs are NCHW chains with optional branches (a value feeding several nodes), shared
uses (``add(%a, %a)``), several outputs (a tuple or a dict), and realistic constants
(conv weights scaled by fan-in, batch-norm running variances positive). Shapes stay tiny
so hundreds of examples run in seconds; result types are computed here rather than by
shape inference on meta tensors, which costs milliseconds per node (the verifier still
checks them). Tensors come from a drawn seed, not element by
element, which keeps shrinking fast and examples reproducible.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from hypothesis import strategies as st

from qir.ir.graph import Graph, Node, Value
from qir.ir.op import OP_REGISTRY, IRError, Op, ShapePreserving
from qir.ir.ops.elementwise import Add
from qir.ir.ops.nn import BatchNorm, Conv2d
from qir.ir.types import TensorType
from qir.testing.properties import random_input

__all__ = ["DEFAULT_OPS", "graphs", "inputs_for", "supported_ops"]

DEFAULT_OPS = ("conv2d", "batch_norm", "relu", "relu6", "add")

Draw = Callable[[st.SearchStrategy[Any]], Any]


class _Builder:
    """Grows one graph; ``pool`` holds the tensor values later nodes may consume."""

    def __init__(self, draw: Draw, channels: tuple[int, int], seed: int) -> None:
        self.draw = draw
        self.channels = channels
        self.gen = torch.Generator().manual_seed(seed)
        self.graph = Graph("main")
        self.pool: list[Value] = []
        self.modules = 0

    def pick(self, allow_branches: bool) -> Value:
        if not allow_branches or len(self.pool) == 1:
            return self.pool[-1]
        # mostly extend the chain; sometimes branch off an earlier value
        if self.draw(st.integers(0, 3)) > 0:
            return self.pool[-1]
        return self.pool[self.draw(st.integers(0, len(self.pool) - 1))]

    def scope(self) -> str:
        self.modules += 1
        return f"m{self.modules - 1}"

    def const(self, scope: str, role: str, t: torch.Tensor, kind: str = "parameter") -> Node:
        return self.graph.add_constant(f"{scope}.{role}", t, kind=kind, scope=scope)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen)

    def uniform(self, n: int, lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand((n,), generator=self.gen)


def _conv2d(b: _Builder, x: Value) -> Node:
    assert isinstance(x.type, TensorType)
    cin = x.type.shape[1]
    cout = b.draw(st.integers(*b.channels))
    k = b.draw(st.sampled_from((1, 3)))
    groups = b.draw(st.sampled_from([g for g in (1, cin) if cin % g == 0 and cout % g == 0]))
    bias = b.draw(st.booleans())
    scope = b.scope()
    fan_in = cin // groups * k * k
    operands: list[Value] = [x, b.const(scope, "weight", b.rand(cout, cin // groups, k, k) / fan_in**0.5)]
    if bias:
        operands.append(b.const(scope, "bias", 0.1 * b.rand(cout)))
    op = Conv2d(padding=(k // 2, k // 2), groups=groups, bias=bias)
    out = TensorType((x.type.shape[0], cout, *x.type.shape[2:]))  # padding k // 2 keeps the size
    return b.graph.add_node(op, operands, out, scope=scope)


def _batch_norm(b: _Builder, x: Value) -> Node:
    assert isinstance(x.type, TensorType)
    c = x.type.shape[1]
    scope = b.scope()
    operands: list[Value] = [
        x,
        b.const(scope, "weight", b.uniform(c, 0.5, 1.5)),
        b.const(scope, "bias", 0.1 * b.rand(c)),
        b.const(scope, "running_mean", 0.1 * b.rand(c), "buffer"),
        b.const(scope, "running_var", b.uniform(c, 0.5, 1.5), "buffer"),  # positive, like trained stats
        b.const(scope, "num_batches_tracked", torch.tensor(100), "buffer"),
    ]
    return b.graph.add_node(BatchNorm(), operands, x.type, scope=scope)


def _add(b: _Builder, x: Value) -> Node:
    same = [v for v in b.pool if v is not x and v.type == x.type]
    # a shared use add(%x, %x) when nothing else has x's shape (or by chance)
    other = b.draw(st.sampled_from(same)) if same and b.draw(st.booleans()) else x
    return b.graph.add_node(Add(), [x, other], x.type)


def _unary(cls: type[Op]) -> Callable[[_Builder, Value], Node]:
    def build(b: _Builder, x: Value) -> Node:
        return b.graph.add_node(cls(), [x], x.type)

    return build


def _op(name: str) -> Any:
    return OP_REGISTRY[name]  # typed loosely: each op class takes its own attributes


def _linear(b: _Builder, x: Value) -> Node:
    assert isinstance(x.type, TensorType)
    n = x.type.shape[-1]  # square: keeps the type, so any later op fits
    scope = b.scope()
    w = b.const(scope, "weight", b.rand(n, n) / n**0.5)
    return b.graph.add_node(_op("linear")(bias=False), [x, w], x.type, scope=scope)


def _mul(b: _Builder, x: Value) -> Node:
    same = [v for v in b.pool if v is not x and v.type == x.type]
    other = b.draw(st.sampled_from(same)) if same and b.draw(st.booleans()) else x
    return b.graph.add_node(_op("mul")(), [x, other], x.type)


def _cat(b: _Builder, x: Value) -> Node:
    # along channels, with another value of the same spatial shape (or itself)
    assert isinstance(x.type, TensorType)
    same = [v for v in b.pool if isinstance(v.type, TensorType) and v.type.shape[2:] == x.type.shape[2:]]
    other = b.draw(st.sampled_from(same)) if same else x
    assert isinstance(other.type, TensorType)
    shape = (x.type.shape[0], x.type.shape[1] + other.type.shape[1], *x.type.shape[2:])
    if shape[0] != other.type.shape[0]:
        other, shape = x, (x.type.shape[0], 2 * x.type.shape[1], *x.type.shape[2:])
    return b.graph.add_node(_op("cat")(dim=1), [x, other], TensorType(shape))


def _matmul(b: _Builder, x: Value) -> Node:
    assert isinstance(x.type, TensorType)
    n = x.type.shape[-1]
    w = b.const(b.scope(), "weight", b.rand(n, n) / n**0.5)
    return b.graph.add_node(_op("matmul")(), [x, w], x.type)


def _pool(name: str) -> Callable[[_Builder, Value], Node]:
    def build(b: _Builder, x: Value) -> Node:
        return b.graph.add_node(_op(name)(kernel_size=3, stride=1, padding=1), [x], x.type)  # keeps the size

    return build


_BUILDERS: dict[str, Callable[[_Builder, Value], Node]] = {
    "conv2d": _conv2d,
    "batch_norm": _batch_norm,
    "add": _add,
    "linear": _linear,
    "mul": _mul,
    "cat": _cat,
    "matmul": _matmul,
    "max_pool2d": _pool("max_pool2d"),
    "avg_pool2d": _pool("avg_pool2d"),
}


def supported_ops() -> list[str]:
    """Op names :func:`graphs` can generate: the built-ins above plus every registered
    single-operand, shape- and dtype-preserving op whose attributes all have defaults."""
    names = set(_BUILDERS)
    for name, cls in OP_REGISTRY.items():
        if _is_simple_unary(cls):
            names.add(name)
    return sorted(names)


_UNARY_OK: dict[type[Op], bool] = {}


def _is_simple_unary(cls: type[Op]) -> bool:
    """One operand, default attributes, and float32 in -> the same float32 type out
    (so chains stay valid; ``logical_not`` and friends change the dtype and are left out)."""
    if cls not in _UNARY_OK:
        _UNARY_OK[cls] = _check_unary(cls)
    return _UNARY_OK[cls]


def _check_unary(cls: type[Op]) -> bool:
    if not cls.has_trait(ShapePreserving) or cls.arity != (1, 1):
        return False
    if any(f.default is attrs.NOTHING for f in attrs.fields(cls) if f.init):
        return False
    t = TensorType((1, 2, 2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            same = cls().infer_type([t]) == t
        except Exception:
            return False
    return same and not caught  # a warning (softmax without dim) means the defaults are not a real use


def _builder_for(name: str) -> Callable[[_Builder, Value], Node]:
    if name in _BUILDERS:
        return _BUILDERS[name]
    cls = OP_REGISTRY.get(name)
    if cls is not None and _is_simple_unary(cls):
        return _unary(cls)
    raise IRError(f"graphs(): no generator for op {name!r}; supported: {', '.join(supported_ops())}")


def _range(v: int | tuple[int, int], what: str) -> tuple[int, int]:
    lo, hi = (1, v) if isinstance(v, int) else v
    if not 1 <= lo <= hi:
        raise ValueError(f"graphs(): {what} must be an int >= 1 or a range (lo, hi) with 1 <= lo <= hi, got {v!r}")
    return lo, hi


@st.composite
def graphs(
    draw: Draw,
    ops: Sequence[str] = DEFAULT_OPS,
    max_nodes: int = 8,
    min_nodes: int = 1,
    channels: int | tuple[int, int] = (1, 4),
    size: int | tuple[int, int] = (1, 5),
    batch: int | tuple[int, int] = (1, 2),
    allow_branches: bool = True,
    multiple_outputs: bool = True,
) -> Graph:
    """Random valid graphs over ``ops`` (op names; see :func:`supported_ops`).

    ``max_nodes`` / ``min_nodes`` bound the non-constant nodes; ``channels``, ``size``
    (height and width) and ``batch`` bound the tensor shapes (inclusive ``(lo, hi)``
    ranges; a single int ``n`` means ``(1, n)``). With
    ``allow_branches`` a node may consume any earlier value, not only the last one; with
    ``multiple_outputs`` every value nobody uses becomes an output (a tuple, or a dict),
    so the graph has no dead code; otherwise the output is the last value.
    """
    builders = [_builder_for(n) for n in ops]
    channels, size, batch = _range(channels, "channels"), _range(size, "size"), _range(batch, "batch")
    if not 1 <= min_nodes <= max_nodes:
        raise ValueError(f"graphs(): need 1 <= min_nodes <= max_nodes, got {min_nodes}, {max_nodes}")
    b = _Builder(draw, channels, draw(st.integers(0, 2**31 - 1)))
    shape = (
        draw(st.integers(*batch)),
        draw(st.integers(*channels)),
        draw(st.integers(*size)),
        draw(st.integers(*size)),
    )
    b.pool.append(b.graph.add_input("x", TensorType(shape)))
    for _ in range(draw(st.integers(min_nodes, max_nodes))):
        build = builders[draw(st.integers(0, len(builders) - 1))]
        b.pool.append(build(b, b.pick(allow_branches)))
    last = b.pool[-1]
    if not multiple_outputs:
        b.graph.set_output(last)
        return b.graph
    leaves = [v for v in b.pool[:-1] if v.num_uses == 0] + [last]
    form = draw(st.sampled_from(("tuple", "dict", "single") if len(leaves) == 1 else ("tuple", "dict")))
    if form == "single":
        b.graph.set_output(last)
    elif form == "tuple":
        b.graph.set_output(tuple(leaves))
    else:
        b.graph.set_output({"out": last, "aux": leaves[:-1]})
    return b.graph


@st.composite
def inputs_for(draw: Draw, graph: Graph) -> tuple[Any, ...]:
    """Run-time values for ``graph``'s inputs that have no default (from a drawn seed)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return tuple(random_input(a.type, gen) for a in graph.inputs if not a.has_default)
