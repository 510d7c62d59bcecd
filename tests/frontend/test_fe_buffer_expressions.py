"""Tensors computed from buffers stay expressions on the buffers (qir/frontend/tracer.py,
``_DerivedTensors``): the traced graph reads the module's own buffer when it runs, and no
``_tensor_constant`` attribute is folded from it."""

from __future__ import annotations

import torch
from fe_helpers import assert_same
from torch import nn

from qir.frontend import emit, trace
from qir.frontend.tracer import QirTracer


class Expressions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("boxes", torch.tensor([[0.0, 1.0, 4.0, 5.0], [2.0, 2.0, 3.0, 6.0]]))
        self.register_buffer("gain", torch.tensor(2.0))
        self.shift = torch.tensor([0.25, -0.25])  # a plain tensor attribute: read like a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = 4 * self.boxes  # a reflected operator
        cat = torch.cat([scaled, (self.boxes + 1.0).flip(0)], 0)  # a function of a method's result
        row = self.boxes[0].clamp(min=0.5).float()  # an index, then methods
        if self.gain.item() > 1.0:  # control flow on a buffer's value still traces (a real tensor)
            row = row * self.gain
        return x @ cat.T + row.sum() + self.shift.mean() * self.boxes.T.sum()


def _attrs(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "get_attr"]


def test_buffer_expressions_are_computed_from_the_buffers_at_run_time() -> None:
    m = Expressions()
    x = torch.randn(3, 4)
    gm = torch.fx.GraphModule(m, QirTracer().trace(m))
    assert not any(a.startswith("_tensor_constant") for a in _attrs(gm))
    assert set(_attrs(gm)) == {"boxes", "gain", "shift"}
    assert_same(gm(x), m(x))
    out = emit(trace(m, (x,)))
    assert not any(k.startswith("_tensor_constant") for k in out.state_dict())
    assert_same(out(x), m(x))
    for model in (m, gm, out):  # the graph reads the buffer when it runs
        model.boxes.mul_(0.5)
    assert_same(gm(x), m(x))
    assert_same(out(x), m(x))


class Written(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("base", torch.tensor([1.0, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.base * 2
        t[0] = 5.0  # written at trace time: the values of that moment are folded, as fx folds them
        return x + t


def test_a_tensor_written_at_trace_time_is_folded() -> None:
    m = Written()
    gm = torch.fx.GraphModule(m, QirTracer().trace(m))
    assert any(a.startswith("_tensor_constant") for a in _attrs(gm))
    x = torch.randn(2)
    assert torch.equal(gm(x), m(x))
