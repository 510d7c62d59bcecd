"""A graph whose module calls are unbound verifies (text carries no modules) but refuses to run
before any node runs, naming every unbound module and how to bind it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qir.ir import UnboundModuleError, parse_graph, run_graph, unbound_modules, verify

TEXT = """graph @m(%x: tensor<2x4xf32>) {
  %a: tensor<2x4xf32> = call(%x, kind="function", target="test.count", args=(%x,))
  %h: tensor<2x3xf32> = call(%a, kind="module", target="head.fc", args=(%a,)) @head.fc
  %g: tensor<2x3xf32> = call(%h, kind="module", target="tail", args=(%h,)) @tail
  %k: tensor<2x3xf32> = call(%g, kind="module", target="head.fc2", args=(%g,)) @head.fc2
  %z: tensor<2x3xf32> = call(%k, kind="module", target="tail", args=(%k,)) @tail
  return %z
}"""


def _graph(calls: list[int]) -> object:
    def count(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x

    return parse_graph(TEXT, objects={"test.count": count})


def test_verifies_unbound_and_lists_each_module_once() -> None:
    g = _graph([])
    verify(g)  # verification does not need the modules
    assert unbound_modules(g) == ["head.fc", "tail", "head.fc2"]


def test_run_refuses_before_any_node_runs() -> None:
    calls: list[int] = []
    g = _graph(calls)
    with pytest.raises(UnboundModuleError) as e:
        run_graph(g, torch.ones(2, 4))
    msg = str(e.value)
    assert "'head.fc', 'tail', 'head.fc2'" in msg and "%h" in msg
    assert "graph.objects['module:head.fc']" in msg
    assert calls == []  # the function call before the first module call never ran


def test_partly_bound_names_only_the_missing() -> None:
    g = _graph([])
    g.objects["module:head.fc"] = nn.Linear(4, 3)
    g.objects["module:tail"] = nn.ReLU()
    assert unbound_modules(g) == ["head.fc2"]
    with pytest.raises(UnboundModuleError, match=r"'head\.fc2' have no module bound \(first at node %k\)"):
        run_graph(g, torch.ones(2, 4))


def test_bound_graph_runs() -> None:
    calls: list[int] = []
    g = _graph(calls)
    lin, lin2 = nn.Linear(4, 3), nn.Linear(3, 3)
    g.objects.update({"module:head.fc": lin, "module:tail": nn.ReLU(), "module:head.fc2": lin2})
    x = torch.randn(2, 4)
    assert torch.equal(run_graph(g, x), torch.relu(lin2(torch.relu(lin(x)))))
    assert calls == [1]
