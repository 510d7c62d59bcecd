"""Shape formulas type a traced graph as the forward run on the example inputs does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from qir.frontend.convert import propagate
from qir.ir.types import type_of
from qir.quantization import DeQuantStub, QuantStub
from qir.quantization.fx_shapes import shape_values
from qir.quantization.fx_trace import trace_fx


class Block(nn.Module):
    def __init__(self, body: nn.Module, ch: int = 6) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, ch, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(ch)
        self.relu = nn.ReLU(inplace=True)
        self.body = body
        self.side = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(self.quant(x))))
        y = self.body(y)
        y = y + self.side(y)
        return self.dequant(torch.flatten(y, 1))


BODIES = {
    "max pool": lambda: nn.MaxPool2d(3, 2, 1),
    "max pool, ceil": lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True),
    "max pool, ceil, no padding": lambda: nn.MaxPool2d(2, 2, ceil_mode=True),
    "max pool, dilation": lambda: nn.MaxPool2d(2, 1, dilation=2),
    "avg pool": lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False),
    "avg pool, ceil": lambda: nn.AvgPool2d(3, 3, ceil_mode=True),
    "adaptive avg pool": lambda: nn.AdaptiveAvgPool2d(1),
    "adaptive avg pool, (None, 2)": lambda: nn.AdaptiveAvgPool2d((None, 2)),
    "identity": nn.Identity,
    "dropout": nn.Dropout,
    "relu6": nn.ReLU6,
}


def _trace(model: nn.Module, x: torch.Tensor) -> Any:
    return trace_fx(model, frozenset(), (x,))


@pytest.mark.parametrize("body", sorted(BODIES))
@pytest.mark.parametrize("size", [(1, 3, 16, 16), (2, 3, 13, 11), (1, 3, 9, 14)])
@pytest.mark.parametrize("training", [True, False])
def test_formulas_type_every_node_as_the_forward_run(body: str, size: tuple[int, ...], training: bool) -> None:
    model = Block(BODIES[body]()).train(training)
    x = torch.randn(size)
    fx_graph = _trace(model, x)
    shapes = shape_values(model, fx_graph, (x,))
    assert shapes is not None, "every node of this graph has a formula"
    real = propagate(model, fx_graph, (x,))
    assert set(shapes) == set(real)
    for name, value in real.items():
        assert type_of(shapes[name]) == type_of(value), name
        assert shapes[name].device.type == "meta"


def test_linear_and_batch_norm_1d() -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 2)).eval()
    x = torch.randn(3, 5)
    fx_graph = _trace(model, x)
    shapes = shape_values(model, fx_graph, (x,))
    assert shapes is not None
    real = propagate(model, fx_graph, (x,))
    assert {k: type_of(v) for k, v in shapes.items()} == {k: type_of(v) for k, v in real.items()}


class Sub(nn.ReLU):
    """A subclass may compute anything: no formula."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], 1)


@pytest.mark.parametrize(
    ("model", "size"),
    [
        (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")), (1, 3, 8, 8)),  # padding mode
        (nn.Sequential(nn.Conv2d(3, 4, 3), Sub()), (1, 3, 8, 8)),  # a subclass of a listed module
        (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sigmoid()), (1, 3, 8, 8)),  # a module without a formula
        (nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train(), (1, 3)),  # one value per channel: torch refuses
        (nn.Sequential(nn.MaxPool2d(3, 1, 2)), (1, 3, 8, 8)),  # padding over half the kernel: torch refuses
        (nn.Sequential(nn.Conv2d(4, 4, 3)), (1, 3, 8, 8)),  # channel mismatch: torch's error
    ],
)
def test_uncovered_graphs_go_to_the_forward_run(model: nn.Module, size: tuple[int, ...]) -> None:
    x = torch.randn(size)
    assert shape_values(model, _trace(model, x), (x,)) is None


def test_integer_inputs_go_to_the_forward_run() -> None:
    model = nn.Sequential(nn.Identity())
    x = torch.arange(6).reshape(2, 3)
    assert shape_values(model, _trace(model, x), (x,)) is None
