"""fuse: conv/linear [+ bn] [+ add] [+ relu/relu6] -> one conv node."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_patterns import conv_bn_add_relu, fusion_graphs, graph_inputs, node

from passes import run_pipeline
from passes.absorb_bn import bn_pattern
from passes.base import PassContext
from passes.fuse import Fuse, act_pattern, add_pattern
from passes.patterns import find_all
from passes.rewrite import FusedFrom, fused_from
from qir.ir import Graph, Node, TensorType, Value, run_graph, verify
from qir.ir.ops.elementwise import Add, Relu, Relu6
from qir.ir.ops.nn import Conv2d, Linear


def _fuse(g: Graph, check_types: bool = True, **kw: Any) -> tuple[Graph, PassContext]:
    out = g.copy()
    ctx = PassContext()
    Fuse(**kw).apply(ctx, out)
    verify(out, check_types=check_types)
    return out, ctx


def _ops(g: Graph) -> list[str]:
    return [n.op.name for n in g.nodes if n.op.name != "constant"]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 3, 6, 6), torch.randn(1, 3, 4, 4)


def test_seed_model_fuses_to_one_conv() -> None:
    for add_first in (True, False):
        g = conv_bn_add_relu(add_first)
        after, ctx = _fuse(g)
        assert _ops(after) == ["conv2d"]
        conv = node(after, "conv")
        op: Any = conv.op
        assert (op.add, op.act, op.bias) == (True, "relu", True)
        assert conv.operands[0] is after.inputs[0] and conv.operands[-1] is after.inputs[1]
        assert conv.scope == "conv" and after.output is conv
        assert fused_from(conv) == (
            FusedFrom("bn", "batch_norm", "bn", "bn"),
            FusedFrom("add", "add", "add", None, 0 if add_first else 1),
            FusedFrom("act", "relu", "relu", "relu"),
        )
        assert sorted(after.constants) == ["conv.bias", "conv.weight"]
        assert ctx.stats["fuse.fuse-add.applied"] == ctx.stats["fuse.fuse-act.applied"] == 1
        x, y = _inputs()
        torch.testing.assert_close(run_graph(after, x, y), run_graph(g, x, y), rtol=1e-4, atol=1e-4)


EXPECTED = """\
graph @m(%x: tensor<1x3x6x6xf32>, %y: tensor<1x3x4x4xf32>) {
  %conv_weight: tensor<3x3x3x3xf32> = constant(key="conv.weight") @conv
  %conv_bias: tensor<3xf32> = constant(key="conv.bias") @conv
  %conv: tensor<1x3x4x4xf32> = conv2d(%x, %conv_weight, %conv_bias, %y, add=True, act="relu") @conv
  return %conv
}"""


def test_golden_ir() -> None:
    after, _ = _fuse(conv_bn_add_relu(add_first=False))
    assert str(after).strip() == EXPECTED


def _chain(act: type | None, conv_extra_use: bool = False, act_first: bool = False) -> Graph:
    """x -> linear -> [act ->] add(., y) [-> act]; optionally the linear's output is also returned."""
    g = Graph("chain")
    x = g.add_input("x", TensorType((2, 4)))
    y = g.add_input("y", TensorType((2, 4)))
    w = g.add_constant("fc.weight", torch.randn(4, 4), scope="fc")
    v: Value = g.add_node(Linear(bias=False), [x, w], scope="fc", name="fc")
    fc = v
    if act is not None and act_first:
        v = g.add_node(act(), [v], name="act")
    v = g.add_node(Add(), [y, v], name="add")
    if act is not None and not act_first:
        v = g.add_node(act(), [v], name="act")
    g.set_output((v, fc) if conv_extra_use else v)
    return g


def test_relu6_and_linear() -> None:
    after, _ = _fuse(_chain(Relu6))
    op: Any = node(after, "fc").op
    assert _ops(after) == ["linear"] and (op.add, op.act) == (True, "relu6")


def test_add_whose_conv_has_other_users_is_not_fused() -> None:
    after, ctx = _fuse(_chain(Relu, conv_extra_use=True))
    assert _ops(after) == ["linear", "add", "relu"]
    assert ctx.stats["fuse.fuse-add.applied"] == 0


def test_relu_whose_input_has_other_users_is_not_fused() -> None:
    g = _chain(None)
    r = g.add_node(Relu(), [node(g, "add")], name="act")
    g.set_output((r, node(g, "add")))
    after, _ = _fuse(g)
    # the add fuses into the linear; the relu reads a value with two uses and stays
    assert _ops(after) == ["linear", "relu"]
    op: Any = node(after, "fc").op
    assert (op.add, op.act) == (True, None)


def test_activation_before_add_blocks_the_add() -> None:
    after, _ = _fuse(_chain(Relu, act_first=True))
    assert _ops(after) == ["linear", "add"]  # relu(fc) fused; add after an activation cannot be
    op: Any = node(after, "fc").op
    assert (op.add, op.act) == (False, "relu")


def test_addend_with_another_shape_is_not_fused() -> None:
    g = Graph()
    x = g.add_input("x", TensorType((1, 2, 3, 3)))
    b = g.add_input("b", TensorType((1, 2, 1, 1)))  # broadcast: the fused op does not broadcast
    w = g.add_constant("c.weight", torch.randn(2, 2, 1, 1))
    c = g.add_node(Conv2d(bias=False), [x, w], name="c")
    a = g.add_node(Add(), [c, b], name="a")
    g.set_output(a)
    after, _ = _fuse(g)
    assert _ops(after) == ["conv2d", "add"]


def test_add_of_two_convs_fuses_one_of_them() -> None:
    g = Graph()
    x = g.add_input("x", TensorType((1, 2, 3, 3)))
    convs = []
    for name in ("c1", "c2"):
        w = g.add_constant(f"{name}.weight", torch.randn(2, 2, 1, 1))
        convs.append(g.add_node(Conv2d(bias=False), [x, w], name=name, scope=name))
    a = g.add_node(Add(), convs, name="a")
    r = g.add_node(Relu(), [a], name="r")
    g.set_output(r)
    after, _ = _fuse(g)
    assert _ops(after) == ["conv2d", "conv2d"]
    fused = node(after, "c1")
    assert fused.operands[-1] is node(after, "c2") and fused.op.attributes()["act"] == "relu"
    xin = torch.randn(1, 2, 3, 3)
    torch.testing.assert_close(run_graph(after, xin), run_graph(g, xin))


def test_without_absorb_bn_the_bn_blocks_fusion() -> None:
    after, ctx = _fuse(conv_bn_add_relu(), absorb_bn=False)
    assert _ops(after) == ["conv2d", "batch_norm", "add", "relu"]
    assert "fuse.absorb-bn.applied" not in ctx.stats


def test_pipeline_absorb_then_fuse_and_idempotence() -> None:
    g = conv_bn_add_relu(add_first=False)
    result = run_pipeline(g, "absorb-bn,fuse")
    assert result.changed == (True, True)
    assert _ops(result.graph) == ["conv2d"]
    again = result.graph.copy()
    assert not Fuse().apply(PassContext(), again)
    assert str(again) == str(result.graph)
    assert _ops(g) == ["conv2d", "batch_norm", "add", "relu"]  # the caller's graph is untouched


@settings()
@given(fusion_graphs(), st.integers(0, 2**16))
def test_fuse_preserves_outputs_and_is_maximal(g: Graph, seed: int) -> None:
    args = graph_inputs(g, seed)
    ref = run_graph(g, *args)
    after, _ = _fuse(g, check_types=False)  # unit tests check inferred types; meta inference is slow
    got = run_graph(after, *args)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # nothing fusable is left: every remaining match is one the rules must decline
    assert find_all(add_pattern(), after) == []
    assert find_all(act_pattern(), after) == []
    for m in find_all(bn_pattern(), after):
        conv = m.node("conv")
        assert any(v.num_uses > 1 for v in conv.operands[1:])  # a shared weight
    # fused nodes keep their scope and say what they absorbed
    for n in after.nodes:
        for f in fused_from(n):
            assert f.role in ("bn", "add", "act")
            assert isinstance(n, Node) and n.scope is not None


@settings()
@given(fusion_graphs())
def test_fuse_patterns_are_maximal(g: Graph) -> None:
    from qir.testing.patterns import assert_pattern_maximal

    for p in (add_pattern(), act_pattern(), bn_pattern()):
        assert_pattern_maximal(p, g)
