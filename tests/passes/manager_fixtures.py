"""Graphs and test passes shared by the pass-manager tests (registered once, ``pm-`` names)."""

from __future__ import annotations

import enum
from typing import ClassVar, Literal

import attrs
import torch

from passes.base import Pass, PassContext, register_pass
from qir.ir import DType, Graph, TensorType
from qir.ir.ops.core import Identity
from qir.ir.ops.elementwise import Add, Relu
from qir.ir.ops.nn import Linear
from qir.ir.ops.shape import Reshape, Transpose


def small_graph() -> Graph:
    """x -> linear -> identity -> relu -> add(., x); plus an unused relu of x (dead code)."""
    g = Graph("small")
    x = g.add_input("x", TensorType((2, 4), DType.float32))
    w = g.add_constant("fc.weight", torch.randn(4, 4))
    b = g.add_constant("fc.bias", torch.randn(4))
    y = g.add_node(Linear(), [x, w, b], name="fc", scope="fc")
    i = g.add_node(Identity(), [y], name="ident")
    r = g.add_node(Relu(), [i], name="act")
    g.add_node(Relu(), [x], name="unused")
    out = g.add_node(Add(), [r, x], name="sum")
    g.set_output(out)
    return g


def codes_graph() -> Graph:
    """x (int8 codes) -> relu -> reshape -> transpose: integer ops a march lowers."""
    g = Graph("codes")
    x = g.add_input("x", TensorType((2, 4), DType.qint8))
    r = g.add_node(Relu(), [x], name="act")
    v = g.add_node(Reshape(shape=(4, 2)), [r], name="view")
    g.set_output(g.add_node(Transpose(dim0=0, dim1=1), [v], name="t"))
    return g


def node_names(g: Graph) -> list[str]:
    return [n.name for n in g.nodes]


class Flavour(enum.Enum):
    """Enum whose values are strings: written by value."""

    SWEET = "sweet"
    SOUR = "sour-ish"


class Level(enum.Enum):
    """Enum with int values: written by name."""

    LOW = 1
    HIGH = 2


@register_pass
@attrs.frozen
class CountOps(Pass):
    """Counts nodes per op into the stats; never changes the graph."""

    name: ClassVar[str] = "pm-count-ops"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        for n in graph.nodes:
            ctx.count(f"ops.{n.op.name}")
        return False


@register_pass
@attrs.frozen
class Boom(Pass):
    name: ClassVar[str] = "pm-boom"
    message: str = "boom"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        raise ValueError(self.message)


@register_pass
@attrs.frozen
class Corrupt(Pass):
    """Declares a wrong result type on the first relu: the verifier must catch it."""

    name: ClassVar[str] = "pm-corrupt"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        for n in graph.nodes:
            if n.op.name == "relu":
                n.type = TensorType((9, 9), DType.float32)
                return True
        return False


@register_pass
@attrs.frozen
class ReturnsNone(Pass):
    name: ClassVar[str] = "pm-returns-none"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        return None  # type: ignore[return-value]  # the bug under test


@register_pass
@attrs.frozen
class Required(Pass):
    name: ClassVar[str] = "pm-required"
    level: int

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        return False


@register_pass
@attrs.frozen
class ObjectOption(Pass):
    """An option whose type pipeline text cannot express."""

    name: ClassVar[str] = "pm-opaque"
    table: dict[str, int] = attrs.field(factory=dict)

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        return False


@register_pass
@attrs.frozen
class Options(Pass):
    """One option of every kind pipeline text can express."""

    name: ClassVar[str] = "pm-options"
    n: int = 3
    x: float = 0.5
    flag: bool = False
    label: str = "plain"
    flavour: Flavour = Flavour.SWEET
    level: Level = Level.LOW
    mode: Literal["fast", "exact", 7] = "fast"
    limit: int | None = None
    note: str | None = None
    either: int | str = 0
    ops: tuple[str, ...] = ("conv2d", "linear")
    sizes: list[int] = attrs.field(factory=list)
    pair: tuple[int, float] = (1, 2.0)
    nested: tuple[tuple[int, ...], ...] = ()
    names: tuple[str, ...] | str = ()
    max_iters: int = 10

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        return False
