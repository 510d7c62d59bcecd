"""Shared checks for the integer-op families: the family traced as opaque module calls (as before
its ops existed) and ``check_model``'s report compared between the two."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import attrs
import torch
from torch import nn

from qir.frontend import emit, trace
from qir.ir.graph import Graph
from qir.ir.interpreter import run_graph
from qir.ir.op import bump_registry_version
from qir.ir.parser import parse_graph
from qir.ir.printer import print_graph
from qir.quantization import check_model


@contextlib.contextmanager
def opaque(family: Iterable[Any]) -> Iterator[None]:
    """Trace the modules of ``family`` (integer op classes) as opaque calls inside the block."""
    saved = {c: c.module_types for c in family}
    for c in saved:
        c.module_types = ()
    bump_registry_version()
    try:
        yield
    finally:
        for c, types in saved.items():
            c.module_types = types
        bump_registry_version()


def assert_check_model_unchanged(
    converted: nn.Module,
    x: Any,
    march: str,
    family: Iterable[Any],
    expect: Collection[str],
    gone: Collection[str],
) -> None:
    """``check_model`` reports the same findings with the family's integer ops as with the opaque
    calls they replaced; only the op a finding names is the integer op now, not ``call``."""
    report = check_model(converted, x, march=march)
    ops = {n.op.name for n in trace(converted, x).nodes}
    assert set(expect) <= ops
    with opaque(family):
        assert not set(gone) & {n.op.name for n in trace(converted, x).nodes}
        before = check_model(converted, x, march=march)
    assert str(report) == str(before)
    for now, was in ((report.violations, before.violations), (report.unknown, before.unknown)):
        assert [attrs.evolve(v, op="call") if v.op in ops else v for v in now] == list(was)


def same(a: object, b: object) -> bool:
    """Equal tensors, or equal tuples / lists of them (layers with tuple or list results)."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


def assert_runs_and_emits_as(g: Graph, converted: nn.Module, inputs: Callable[[int], tuple[Any, ...]], x: Any) -> None:
    """``run_graph`` of ``g`` on ``x`` and its emitted module on three input draws equal the converted
    model, and the emitted module has the converted model's state-dict keys."""
    assert same(run_graph(g, *x), converted(*x))
    back = emit(g)
    assert sorted(back.state_dict()) == sorted(converted.state_dict())
    for seed in range(3):
        assert same(back(*inputs(seed)), converted(*inputs(seed)))


def assert_round_trips(g: Graph, converted: nn.Module, x: Any) -> None:
    """The text form parses back to the same text, and the parsed graph runs as the converted model."""
    text = print_graph(g)
    g2 = parse_graph(text, constants=g.constants, objects=g.objects)
    assert print_graph(g2) == text
    assert same(run_graph(g2, *x), converted(*x))
