"""The module behind a torch.jit.trace: found by the tensors the trace shares with it and its module
tree, never a GraphModule built over the model's submodules (qir's compile and check steps build such
temporaries; they share every tensor and stay on the heap until the cyclic collector runs); two
different live candidates are refused, naming them."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.fx
from torch import nn

from qir.quantization import compile_model
from qir.quantization.jit_source import TracedSourceError, traced_original
from tests.backends.pv_models import Stubbed, eager_converted

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")

SHAPE = (1, 3, 8, 8)


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Dropped GraphModules stay on the heap, as between two runs of the cyclic collector."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _converted() -> nn.Module:
    return eager_converted(Stubbed(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()), SHAPE, "bayes")


def _over(model: nn.Module, class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """A GraphModule over ``model``'s submodules calling each, as an fx trace of it builds."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for name, _ in model.named_children():
        x = g.call_module(name, (x,))
    g.output(x)
    return torch.fx.GraphModule(model, g, class_name=class_name)


def test_temporaries_over_the_model_are_not_the_source(no_cyclic_gc: None) -> None:
    q = _converted()
    x = torch.rand(SHAPE)
    traced = torch.jit.trace(q, x)
    for _ in range(3):
        _over(q)  # dropped: a GraphModule and its Graph keep each other alive
        _over(q, class_name="Stubbed")  # even with the model's class name and module tree
    assert traced_original(traced, "test") is q
    compiled = compile_model(traced, [x])  # compile's own temporaries (the lookup runs again inside)
    assert torch.equal(compiled(x), q(x))


def test_a_live_different_module_with_the_same_tensors_is_refused() -> None:
    q = _converted()
    traced = torch.jit.trace(q, torch.rand(SHAPE))
    other = _over(q, class_name="Stubbed")  # kept alive: which of the two was traced is unknown
    with pytest.raises(TracedSourceError, match=r"test: 2 different live modules share.*Stubbed.*pass the converted"):
        traced_original(traced, "test")
    del other
    assert traced_original(traced, "test") is q


def test_an_equivalent_copy_is_one_answer() -> None:
    q = _converted()
    gm = _over(q, class_name="Net")
    traced = torch.jit.trace(gm, torch.rand(SHAPE))
    twin = torch.fx.GraphModule(gm, gm.graph, class_name="Net")  # the same code over the same modules
    assert traced_original(traced, "test") in (gm, twin)


def test_a_loaded_trace_has_no_source(tmp_path: Path) -> None:
    q = _converted()
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.trace(q, torch.rand(SHAPE)), str(path))
    with pytest.raises(TracedSourceError, match="no longer alive"):
        traced_original(torch.jit.load(str(path)), "test")
