"""Checks every QAT op family shares: a prepared model traces to the family's typed ops, the text
form round-trips, ``run_graph`` is the prepared model (observer updates included), and ``emit``
rebuilds the same state-dict keys in order, computing the same outputs."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from qir.frontend import emit, trace
from qir.ir import Graph, parse_graph, print_graph, run_graph
from qir.ir.ops.core import Call
from qir.quantization.integer_grid import set_integer_grid


def traced(qat: nn.Module, x: torch.Tensor) -> Graph:
    """The prepared model's IR, with no opaque module or FloatFunctional call left."""
    g = trace(qat, (x,))
    opaque = [(n.name, n.meta.get("frontend_note")) for n in g.nodes if isinstance(n.op, Call) and n.scope]
    assert not opaque, opaque
    return g


def assert_qat_contract(qat: torch.fx.GraphModule, x: torch.Tensor, batch: Callable[[], torch.Tensor]) -> Graph:
    """``qat`` (trained a little, in training mode): the checks above; returns its IR."""
    set_integer_grid(qat, False)  # an op rebuilds its module unbound: float fake quantization
    other = copy.deepcopy(qat)
    g = traced(other, x)
    text = print_graph(g)
    assert print_graph(parse_graph(text, constants=g.constants, objects=g.objects)) == text
    for _ in range(2):  # training: both observe, and the next step sees the updated scales
        b = batch()
        assert torch.equal(run_graph(g, b), qat(b))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in qat.state_dict().items())
    qat.eval()
    g.training = False
    assert torch.equal(run_graph(g, x), qat(x))
    back = emit(g)
    assert list(back.state_dict()) == list(qat.state_dict())
    assert torch.equal(back.eval()(x), qat(x))
    return g
