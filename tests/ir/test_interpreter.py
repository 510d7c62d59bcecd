"""The interpreter: inputs, defaults, output structures, constants, errors naming the node."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qir.ir import Graph, Interpreter, IRError, Node, parse_graph, run_graph

TEXT = """
graph @main(%x: tensor<1x2x4x4xf32>, %scale: float = 2.0) {
  %w: tensor<3x2x1x1xf32> = constant(key="conv.weight") @conv
  %b: tensor<3xf32> = constant(key="conv.bias") @conv
  %conv: tensor<1x3x4x4xf32> = conv2d(%x, %w, %b) @conv
  %r: tensor<1x3x4x4xf32> = relu(%conv)
  %s: tensor<1x3x4x4xf32> = add(%r, %conv)
  %flat: tensor<1x48xf32> = call(%s, kind="method", target="flatten", args=(%s, 1))
  return (%s, {"flat": %flat, "scale": %scale, "k": 3})
}
"""


def setup() -> tuple[Graph, dict[str, torch.Tensor]]:
    consts = {"conv.weight": torch.randn(3, 2, 1, 1), "conv.bias": torch.randn(3)}
    return parse_graph(TEXT, consts), consts


def test_runs_and_matches_torch() -> None:
    g, c = setup()
    x = torch.randn(1, 2, 4, 4)
    s, rest = run_graph(g, x)
    conv = F.conv2d(x, c["conv.weight"], c["conv.bias"])
    expected = torch.relu(conv) + conv
    torch.testing.assert_close(s, expected)
    torch.testing.assert_close(rest["flat"], expected.flatten(1))
    assert rest["scale"] == 2.0 and rest["k"] == 3


def test_keyword_inputs_override_defaults() -> None:
    g, _ = setup()
    _, rest = run_graph(g, x=torch.zeros(1, 2, 4, 4), scale=5.0)
    assert rest["scale"] == 5.0


def test_input_errors() -> None:
    g, _ = setup()
    with pytest.raises(TypeError, match="missing input %x"):
        run_graph(g)
    with pytest.raises(TypeError, match="takes 2 inputs, got 3"):
        run_graph(g, 1, 2, 3)
    with pytest.raises(TypeError, match=r"unknown inputs \['y'\]"):
        run_graph(g, torch.zeros(1, 2, 4, 4), y=1)


def test_failure_names_node_and_module() -> None:
    g, _ = setup()
    with pytest.raises(IRError, match=r"node %conv = conv2d \(module conv\) failed: RuntimeError"):
        run_graph(g, torch.zeros(1, 5, 4, 4))


def test_unbound_constant_is_reported() -> None:
    g, _ = setup()
    del g.constants["conv.bias"]
    with pytest.raises(IRError, match=r"constant 'conv\.bias' has no tensor"):
        run_graph(g, torch.zeros(1, 2, 4, 4))


def test_run_node_can_be_overridden() -> None:
    g, _ = setup()
    seen: list[str] = []

    class Recording(Interpreter):
        def run_node(self, node: Node, operands: list[object]) -> object:
            seen.append(node.name)
            return super().run_node(node, operands)

    Recording(g).run(torch.zeros(1, 2, 4, 4))
    assert seen == ["w", "b", "conv", "r", "s", "flat"]


def test_batch_norm_uses_running_stats() -> None:
    text = """
    graph @main(%x: tensor<2x3x2x2xf32>) {
      %g: tensor<3xf32> = constant(key="bn.weight") @bn
      %b: tensor<3xf32> = constant(key="bn.bias") @bn
      %m: tensor<3xf32> = constant(key="bn.running_mean", kind="buffer") @bn
      %v: tensor<3xf32> = constant(key="bn.running_var", kind="buffer") @bn
      %n: tensor<i64> = constant(key="bn.num_batches_tracked", kind="buffer") @bn
      %bn: tensor<2x3x2x2xf32> = batch_norm(%x, %g, %b, %m, %v, %n) @bn
      return %bn
    }
    """
    bn = torch.nn.BatchNorm2d(3).eval()
    with torch.no_grad():
        for t, lo in ((bn.running_mean, -1.0), (bn.running_var, 0.5), (bn.weight, 0.5)):
            assert t is not None
            t.uniform_(lo, 2.0)
    g = parse_graph(text, {f"bn.{k}": v for k, v in bn.state_dict().items()})
    x = torch.randn(2, 3, 2, 2)
    torch.testing.assert_close(run_graph(g, x), bn(x))
