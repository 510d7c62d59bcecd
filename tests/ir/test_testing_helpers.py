"""qir.testing: the strategies produce what they promise; the assertions catch broken passes."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qir.testing
from passes.base import Pass, PassContext
from qir.ir import Graph, IRError, Node, TensorType, verify
from qir.ir.ops.core import Identity
from qir.ir.ops.elementwise import Relu
from qir.testing import (
    assert_graphs_equal,
    assert_preserves_semantics,
    assert_roundtrip,
    graphs,
    inputs_for,
    supported_ops,
)


@given(graphs(max_nodes=6, channels=(2, 3), size=(2, 3)))
def test_graphs_verify_and_have_no_dead_code(g: Graph) -> None:
    verify(g)
    for n in g.nodes:
        assert n.num_uses > 0, f"%{n.name} is dead"
        if isinstance(n.type, TensorType) and n.op.name != "constant":
            assert n.type.shape[1] in (2, 3)
    for key, t in g.constants.items():
        if key.endswith("running_var"):
            assert bool((t > 0).all())


@given(graphs(ops=("relu",), max_nodes=3, allow_branches=False, multiple_outputs=False))
def test_chain_without_branches_is_linear(g: Graph) -> None:
    nodes = list(g.nodes)
    assert g.output is nodes[-1]
    assert all(n.operands[0] is (nodes[i - 1] if i else g.inputs[0]) for i, n in enumerate(nodes))


@given(graphs(ops=("relu", "add"), max_nodes=4), st.data())
def test_inputs_for_matches_declared_types(g: Graph, data: st.DataObject) -> None:
    (x,) = data.draw(inputs_for(g))
    assert isinstance(g.inputs[0].type, TensorType)
    assert tuple(x.shape) == g.inputs[0].type.shape and x.dtype == torch.float32


def test_supported_ops() -> None:
    assert {"conv2d", "batch_norm", "relu", "relu6", "add"} <= set(supported_ops())


@settings(max_examples=1)
@given(st.data())
def test_unknown_op_is_reported(data: st.DataObject) -> None:
    with pytest.raises(IRError, match="no generator for op 'layer_norm'; supported: "):
        data.draw(graphs(ops=("layer_norm",)))


@attrs.frozen
class ReluToIdentity(Pass):
    """Wrong on purpose: changes the meaning of every relu."""

    name: ClassVar[str] = "test-relu-to-identity"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        for n in list(graph.nodes):
            if n.op.name == "relu":
                new = graph.insert_node(graph.create_node(Identity(), n.operands, n.type), before=n)
                n.replace_all_uses_with(new)
                graph.erase_node(n)
        return True


@attrs.frozen
class ScaleWeightsInPlace(Pass):
    """Wrong on purpose: edits constant tensors shared with the original graph."""

    name: ClassVar[str] = "test-scale-in-place"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        for t in graph.constants.values():
            t.mul_(1.0)  # harmless
        next(iter(graph.constants.values())).add_(1.0)
        return True


@attrs.frozen
class Dangling(Pass):
    """Wrong on purpose: leaves a node reading a value from another graph."""

    name: ClassVar[str] = "test-dangling"

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        n = next(n for n in graph.nodes if n.op.name == "relu")
        n.set_operand(0, Graph().add_input("y", n.operands[0].type))
        return True


def relu_graph() -> Graph:
    g = Graph()
    x = g.add_input("x", TensorType((2, 3)))
    w = g.add_constant("w", torch.ones(2, 3))
    from qir.ir.ops.elementwise import Add

    g.set_output(g.add_node(Relu(), [g.add_node(Add(), [x, w])]))
    return g


def test_semantics_checker_catches_wrong_results() -> None:
    with pytest.raises(AssertionError, match="changed the result: output:"):
        assert_preserves_semantics(ReluToIdentity(), relu_graph(), inputs=[-torch.ones(2, 3) * 5])


def test_semantics_checker_catches_shared_tensor_edits() -> None:
    with pytest.raises(AssertionError, match="edited constant 'w' in place"):
        assert_preserves_semantics(ScaleWeightsInPlace(), relu_graph())


def test_semantics_checker_catches_invalid_graphs() -> None:
    with pytest.raises(AssertionError, match="does not verify: %relu: operand 0 %y belongs to another graph"):
        assert_preserves_semantics(Dangling(), relu_graph())


def test_semantics_checker_accepts_pipelines_sequences_and_callables() -> None:
    g = relu_graph()
    out = assert_preserves_semantics("dce", g)
    assert_graphs_equal(out, g)
    assert_preserves_semantics([ReluToIdentity()], g, inputs=[torch.ones(2, 3)])
    assert_preserves_semantics(lambda graph: graph.eliminate_dead_code(), g)


@settings(max_examples=20)
@given(graphs(max_nodes=6))
def test_absorb_bn_and_dce_keep_meaning(g: Graph) -> None:
    out = assert_preserves_semantics("absorb-bn, dce", g, atol=1e-4, rtol=1e-4)
    assert_roundtrip(out)


def test_graph_equality_reports_the_first_difference() -> None:
    a, b = relu_graph(), relu_graph()
    assert_graphs_equal(a, b, check_constants=False)
    relu = next(n for n in b.nodes if n.op.name == "relu")
    assert isinstance(relu, Node)
    relu.op = Relu(inplace=True)
    with pytest.raises(AssertionError, match=r"nodes differ:\n  %relu: .* = relu\(%add\)\n  %relu: .*inplace=True"):
        assert_graphs_equal(a, b)
    b.name = "other"
    with pytest.raises(AssertionError, match="graph names differ"):
        assert_graphs_equal(a, b)


def test_pattern_helpers_are_reexported_lazily() -> None:
    from qir.testing import patterns

    assert qir.testing.assert_pattern_maximal is patterns.assert_pattern_maximal
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = qir.testing.nope


@settings(max_examples=1)
@given(st.data())
def test_graphs_argument_checks(data: st.DataObject) -> None:
    with pytest.raises(ValueError, match="channels must be"):
        data.draw(graphs(channels=(3, 2)))
    with pytest.raises(ValueError, match="min_nodes"):
        data.draw(graphs(min_nodes=5, max_nodes=2))


@settings(max_examples=5)
@given(graphs(ops=("conv2d",), channels=2, size=3, batch=1, max_nodes=2))
def test_graphs_int_ranges(g: Graph) -> None:
    t = g.inputs[0].type
    assert isinstance(t, TensorType) and t.shape[0] == 1 and t.shape[1] <= 2 and t.shape[2] <= 3
