"""Property helpers: a pass keeps a graph's meaning, the text form round-trips, two graphs are equal.

Each helper raises ``AssertionError`` with a message naming what differs, so they work as
plain ``assert`` statements inside pytest and hypothesis tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from qir.ir.graph import Graph, map_values
from qir.ir.interpreter import run_graph
from qir.ir.parser import parse_graph
from qir.ir.printer import format_node, print_graph
from qir.ir.types import ScalarType, TensorType, Type
from qir.ir.verifier import verify

__all__ = [
    "assert_graphs_equal",
    "assert_outputs_close",
    "assert_preserves_semantics",
    "assert_roundtrip",
    "random_inputs",
    "run_pipeline",
]


# ----------------------------------------------------------------------------- equality


def _same(a: Any, b: Any) -> bool:
    """Equality that treats nan as equal to nan and keeps 1, 1.0 and True apart."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, slice):
        return _same((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _named(structure: Any) -> Any:
    return map_values(structure, lambda v: ("%", v.name))


def assert_graphs_equal(a: Graph, b: Graph, check_constants: bool = True) -> None:
    """Raise ``AssertionError`` at the first structural difference between ``a`` and ``b``.

    Compared: graph name and training flag; inputs (names, types, defaults); nodes in
    order (names, types, ops with their attributes, operand names, scopes); the output
    structure; and (``check_constants``) the tensors bound to each constant key used.
    ``node.meta`` is not compared.
    """
    if a.name != b.name:
        raise AssertionError(f"graph names differ: @{a.name} vs @{b.name}")
    if a.training != b.training:
        raise AssertionError(f"training flags differ: {a.training} vs {b.training}")
    if len(a.inputs) != len(b.inputs):
        raise AssertionError(f"input counts differ: {len(a.inputs)} vs {len(b.inputs)}")
    for p, q in zip(a.inputs, b.inputs, strict=True):
        if (p.name, p.type, p.has_default) != (q.name, q.type, q.has_default) or not _same(p.default, q.default):
            raise AssertionError(
                f"inputs differ: %{p.name}: {p.type} (default {p.default!r}) vs %{q.name}: {q.type} "
                f"(default {q.default!r})"
            )
    na, nb = list(a.nodes), list(b.nodes)
    for x, y in zip(na, nb, strict=False):
        same = (
            x.name == y.name
            and x.type == y.type
            and x.scope == y.scope
            and type(x.op) is type(y.op)
            and _same(x.op.attributes(), y.op.attributes())
            and [v.name for v in x.operands] == [v.name for v in y.operands]
        )
        if not same:
            raise AssertionError(f"nodes differ:\n  {format_node(x)}\n  {format_node(y)}")
    if len(na) != len(nb):
        extra = (na if len(na) > len(nb) else nb)[min(len(na), len(nb))]
        raise AssertionError(f"node counts differ: {len(na)} vs {len(nb)} (first extra: %{extra.name})")
    if not _same(_named(a.output), _named(b.output)):
        raise AssertionError(f"outputs differ: {_named(a.output)!r} vs {_named(b.output)!r}")
    if check_constants:
        for n in na:
            if n.op.name == "constant":
                key = n.op.key  # type: ignore[attr-defined]
                ta, tb = a.constants.get(key), b.constants.get(key)
                if ta is not tb and (ta is None or tb is None or not _same(ta, tb)):
                    raise AssertionError(f"constant {key!r} (%{n.name}) is bound to different tensors")


def assert_roundtrip(graph: Graph) -> Graph:
    """Print, parse and print again: the texts must be identical and the graphs equal.

    Returns the parsed graph (bound to ``graph``'s constants and objects).
    """
    text = print_graph(graph)
    parsed = parse_graph(text, graph.constants, graph.objects)
    again = print_graph(parsed)
    if again != text:
        diff = next(
            (
                f"line {i + 1}:\n  {p}\n  {q}"
                for i, (p, q) in enumerate(zip(text.splitlines(), again.splitlines(), strict=False))
                if p != q
            ),
            "line counts differ",
        )
        raise AssertionError(f"print(parse(print(g))) != print(g) at {diff}")
    assert_graphs_equal(graph, parsed)
    return parsed


# ----------------------------------------------------------------------------- semantics


def random_input(t: Type, generator: torch.Generator) -> Any:
    """A random run-time value of type ``t`` (float tensors ~ N(0, 1), ints in [-8, 8))."""
    if isinstance(t, TensorType):
        dt = t.dtype.to_torch()
        if dt.is_floating_point:
            return torch.randn(t.shape, generator=generator).to(dt)
        if dt == torch.bool:
            return torch.randint(0, 2, t.shape, generator=generator).bool()
        lo, hi = t.dtype.qrange if t.dtype.is_quantized else (-8, 8)
        return torch.randint(max(lo, -8), min(hi, 7) + 1, t.shape, generator=generator, dtype=dt)
    if isinstance(t, ScalarType):
        r = torch.randn((), generator=generator).item()
        return {"int": int(r * 4), "float": r, "bool": r > 0}[t.kind]
    raise ValueError(f"cannot make a random input of type {t}")


def random_inputs(graph: Graph, seed: int = 0) -> tuple[Any, ...]:
    """Deterministic random values for every input of ``graph`` without a default."""
    g = torch.Generator().manual_seed(seed)
    return tuple(random_input(a.type, g) for a in graph.inputs if not a.has_default)


def assert_outputs_close(
    actual: Any, expected: Any, atol: float = 1e-5, rtol: float = 1e-4, path: str = "output"
) -> None:
    """Compare two run-time output structures; tensors with ``torch.testing.assert_close``."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{path}: expected a tensor, got {type(actual).__name__}")
        try:
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
        except AssertionError as e:
            raise AssertionError(f"{path}: {e}") from None
    elif isinstance(expected, (tuple, list)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            raise AssertionError(f"{path}: expected a {type(expected).__name__} of {len(expected)}, got {actual!r}")
        for i, (x, y) in enumerate(zip(actual, expected, strict=True)):
            assert_outputs_close(x, y, atol, rtol, f"{path}[{i}]")
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            raise AssertionError(f"{path}: expected dict keys {list(expected)}, got {actual!r}")
        for k in expected:
            assert_outputs_close(actual[k], expected[k], atol, rtol, f"{path}[{k!r}]")
    elif not _same(actual, expected):
        raise AssertionError(f"{path}: {actual!r} != {expected!r}")


PassLike = Any  # a Pass instance, a sequence of them, a pipeline string, or a callable(Graph) -> Graph | None


def run_pipeline(pass_or_pipeline: PassLike, graph: Graph) -> Graph:
    """Apply ``pass_or_pipeline`` to ``graph`` in place and return the resulting graph.

    A :class:`~passes.base.Pass` (or a sequence) runs through the Pass contract
    ``p.apply(PassContext(), graph)``; a string runs ``passes.manager.PassManager``; a
    callable is called with the graph and may return a new one (any other return
    value means it edited the graph in place).
    """
    from passes.base import Pass, PassContext  # passes sits above qir.ir; only tests reach for it

    if isinstance(pass_or_pipeline, str):
        from passes.manager import PassManager

        return PassManager(pass_or_pipeline).run(graph, inplace=True).graph  # type: ignore[no-any-return]
    if isinstance(pass_or_pipeline, Pass):
        pass_or_pipeline = [pass_or_pipeline]
    if isinstance(pass_or_pipeline, Sequence):
        ctx = PassContext()
        for p in pass_or_pipeline:
            p.apply(ctx, graph)
        return graph
    if callable(pass_or_pipeline):
        fn: Callable[[Graph], Any] = pass_or_pipeline
        out = fn(graph)
        return out if isinstance(out, Graph) else graph  # in-place callables may return anything
    raise TypeError(f"expected a Pass, a sequence of passes, a pipeline string or a callable, got {pass_or_pipeline!r}")


def assert_preserves_semantics(
    pass_or_pipeline: PassLike,
    graph: Graph,
    inputs: Sequence[Any] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
) -> Graph:
    """Run the pass on a copy of ``graph``; it must verify and compute the same outputs.

    ``inputs`` default to :func:`random_inputs` (``seed``). Also checks the pass left the
    original graph untouched: its text, and its constant tensors, which the copy shares
    (a pass must bind new tensors rather than edit them in place). Returns the new graph.
    """
    verify(graph)
    args = tuple(inputs) if inputs is not None else random_inputs(graph, seed)
    before_text = print_graph(graph)
    snapshot = {k: t.detach().clone() for k, t in graph.constants.items()}
    with torch.no_grad():
        expected = run_graph(graph, *args)
    out = run_pipeline(pass_or_pipeline, graph.copy())
    for key, t in graph.constants.items():
        if not _same(t.detach(), snapshot[key]):
            raise AssertionError(
                f"{pass_or_pipeline!r} edited constant {key!r} in place; the copy it was given shares "
                "constant tensors with the original, so bind a new tensor instead"
            )
    try:
        verify(out)
    except Exception as e:
        raise AssertionError(f"the graph after {pass_or_pipeline!r} does not verify: {e}\n{print_graph(out)}") from e
    with torch.no_grad():
        actual = run_graph(out, *args)
    try:
        assert_outputs_close(actual, expected, atol, rtol)
    except AssertionError as e:
        raise AssertionError(
            f"{pass_or_pipeline!r} changed the result: {e}\nbefore:\n{before_text}\nafter:\n{print_graph(out)}"
        ) from None
    if print_graph(graph) != before_text:
        raise AssertionError(f"{pass_or_pipeline!r} modified the original graph instead of its copy")
    return out
