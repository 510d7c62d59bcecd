"""Emit marks an opaque call wrapped by what torch.fx recorded (``node.meta["is_wrapped"]``), and by the
callee's module only where that record is missing."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from qir.frontend import emit, trace
from qir.ir import Graph, Node


def crop_to_even(x: torch.Tensor) -> torch.Tensor:
    """Shape-dependent control flow: fx cannot trace into it."""
    if x.shape[-1] % 2:
        x = x[..., :-1]
    return x


def scale_rows(x: torch.Tensor) -> torch.Tensor:
    """The same kind of helper, in a module named under ``math`` (a namespace fx records natively): the guess
    by ``__module__`` alone takes it for a function fx records by itself."""
    if x.shape[0] > 1:
        return x * torch.arange(1, x.shape[0] + 1, dtype=x.dtype).view(-1, *([1] * (x.dim() - 1)))
    return x


torch.fx.wrap("crop_to_even")
torch.fx.wrap("scale_rows")
scale_rows.__module__ = "math.qir_test_helpers"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_rows(crop_to_even(self.conv(x)))


def _calls(g: Graph) -> dict[str, Node]:
    return {n.op.target.rpartition(".")[2]: n for n in g.nodes if n.op.name == "call"}  # type: ignore[attr-defined]


def _wrapped_targets(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("is_wrapped")]


def test_the_recorded_is_wrapped_decides_even_for_a_torch_module_name() -> None:
    x = torch.randn(3, 2, 4, 5)
    m = Net().eval()
    g = trace(m, (x,))
    calls = _calls(g)
    assert {k: n.meta.get("is_wrapped") for k, n in calls.items()} == {"crop_to_even": True, "scale_rows": True}
    gm = emit(g)
    assert _wrapped_targets(gm) == ["crop_to_even", "scale_rows"]
    # traced again (a second prepare's trace of the emitted float model), both stay one call each
    again = torch.fx.symbolic_trace(gm)
    assert [n.target.__name__ for n in again.graph.nodes if n.op == "call_function"] == ["crop_to_even", "scale_rows"]
    with torch.no_grad():
        assert torch.equal(again(x), m(x))


def test_without_the_record_the_module_name_decides() -> None:
    g = trace(Net().eval(), (torch.randn(3, 2, 4, 5),))
    for n in _calls(g).values():
        del n.meta["is_wrapped"]  # as in a graph read from text or a hand-built fx graph
    # the user's module: guessed wrapped; the math-named one: taken for a function fx records itself
    assert _wrapped_targets(emit(g)) == ["crop_to_even"]


def test_a_record_of_false_is_kept() -> None:
    g = trace(Net().eval(), (torch.randn(3, 2, 4, 5),))
    _calls(g)["crop_to_even"].meta["is_wrapped"] = False
    assert _wrapped_targets(emit(g)) == ["scale_rows"]
