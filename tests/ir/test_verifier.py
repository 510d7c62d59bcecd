"""The verifier: every check fires with a VerifyError naming the offending node."""

from __future__ import annotations

import pytest
import torch

from qir.ir import Graph, Node, TensorType, VerifyError, parse_graph, verify
from qir.ir.ops.elementwise import Relu

TEXT = """
graph @main(%x: tensor<1x2x4x4xf32>) {
  %w: tensor<3x2x1x1xf32> = constant(key="conv.weight") @conv
  %conv: tensor<1x3x4x4xf32> = conv2d(%x, %w, bias=False) @conv
  %r: tensor<1x3x4x4xf32> = relu(%conv)
  %s: tensor<1x3x4x4xf32> = add(%r, %conv)
  return %s
}
"""


def graph() -> Graph:
    g = parse_graph(TEXT, allow_unbound=True)
    verify(g)
    return g


def node(g: Graph, name: str) -> Node:
    v = g.find(name)
    assert isinstance(v, Node)
    return v


def fails(g: Graph, name: str | None, message: str) -> None:
    with pytest.raises(VerifyError, match=message) as info:
        verify(g)
    assert info.value.node == name
    if name is not None:
        assert f"%{name}" in str(info.value)


def test_sound_graph_passes() -> None:
    graph()


def test_duplicate_name() -> None:
    g = graph()
    node(g, "s").name = "r"
    fails(g, "r", "name defined twice")


def test_use_before_definition() -> None:
    g = graph()
    early = g.insert_node(g.create_node(Relu(), [node(g, "s")], name="early"), before=node(g, "conv"))
    fails(g, early.name, "used before it is defined")


def test_operand_from_another_graph() -> None:
    g, other = graph(), Graph("other")
    node(g, "r").set_operand(0, other.add_input("y", TensorType((1, 3, 4, 4))))
    fails(g, "r", "belongs to another graph")


def test_inconsistent_use_list() -> None:
    g = graph()
    node(g, "conv")._users.pop(node(g, "r"))
    fails(g, "r", "does not list this node as a user")


def test_wrong_arity() -> None:
    g = graph()
    r = node(g, "r")
    r.set_operands([*r.operands, g.inputs[0]])
    fails(g, "r", "takes 1 operands, got 2")


def test_op_specific_rule() -> None:
    g = graph()
    conv = node(g, "conv")
    conv.set_operands(conv.operands[:1])
    fails(g, "conv", "needs 2 operands")


def test_missing_constant() -> None:
    g = graph()
    del g.constants["conv.weight"]
    fails(g, "w", "constant 'conv.weight' has no tensor")


def test_constant_shape_mismatch() -> None:
    g = graph()
    g.constants["conv.weight"] = torch.zeros(3, 2, 3, 3)
    fails(g, "w", r"has shape \(3, 2, 3, 3\)")


def test_declared_type_disagrees_with_inference() -> None:
    g = graph()
    node(g, "r").type = TensorType((1, 3, 4, 5))
    fails(g, "r", "declared type .* gives")


def test_declared_types_can_be_skipped() -> None:
    g = graph()
    node(g, "r").type = TensorType((1, 3, 4, 5))
    with pytest.raises(VerifyError):
        verify(g)
    verify(g, check_types=False)  # structure only: the declared types are trusted


def test_operand_types_rejected_by_the_op() -> None:
    g = graph()
    node(g, "w").type = TensorType((3, 5, 1, 1))
    g.constants["conv.weight"] = torch.zeros(3, 5, 1, 1)
    fails(g, "conv", "rejects its operand types")


def test_broken_node_links() -> None:
    g = graph()
    node(g, "s").prev = None
    fails(g, "s", "links are corrupt")


def test_node_count_mismatch() -> None:
    g = graph()
    g._len += 1
    fails(g, None, "node count")


def test_output_not_in_graph() -> None:
    g = graph()
    stray = Graph().add_input("stray", TensorType((1,)))
    g.set_output((node(g, "s"), stray))
    fails(g, "stray", "graph output is not defined")


def test_error_mentions_module_scope() -> None:
    g = graph()
    conv = node(g, "conv")
    conv.set_operands(conv.operands[:1])
    with pytest.raises(VerifyError, match=r"%conv \(module conv\)"):
        verify(g)
