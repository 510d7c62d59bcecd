"""Shared checks: trace a module, run the IR and the emitted module, compare with the module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qir.frontend import emit, trace
from qir.ir import Graph, run_graph, verify


def flat(out: Any) -> list[Any]:
    if isinstance(out, (tuple, list)):
        return [y for o in out for y in flat(o)]
    if isinstance(out, dict):
        return [y for o in out.values() for y in flat(o)]
    return [out]


def assert_same(a: Any, b: Any, atol: float = 1e-6) -> None:
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb, strict=False):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
            torch.testing.assert_close(x, y, atol=atol, rtol=1e-5)
        else:
            assert x == y


def roundtrip(m: nn.Module, *inputs: Any) -> Graph:
    """Trace ``m``; check the interpreter and the emitted module against it; return the graph."""
    g = trace(m, inputs)
    verify(g)
    with torch.no_grad():
        expected = m(*inputs)
        assert_same(run_graph(g, *inputs), expected)
        gm = emit(g)
        assert_same(gm(*inputs), expected)
    assert list(gm.state_dict()) == list(m.state_dict())
    return g


def op_names(g: Graph) -> list[str]:
    return [n.op.name for n in g.nodes if n.op.name != "constant"]
