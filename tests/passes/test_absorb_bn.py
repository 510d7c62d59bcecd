"""absorb-bn: fold batch norms into the conv / conv_transpose / linear before them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_patterns import fusion_graphs, graph_inputs

from passes import run_pipeline
from passes.absorb_bn import AbsorbBatchNorm, bn_pattern, fold_batch_norm, folded_in_dtype
from passes.base import PassContext
from passes.patterns import find_all
from passes.rewrite import fused_from
from qir.ir import Graph, Node, TensorType, Value, run_graph, verify
from qir.ir.ops.elementwise import Relu
from qir.ir.ops.nn import (
    BatchNorm,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Linear,
)
from qir.testing.patterns import assert_pattern_maximal


def _bn_params(g: Graph, c: int, affine: bool, gen: torch.Generator, bn: str = "bn") -> list[Value]:
    out: list[Value] = []
    if affine:
        out += [
            g.add_constant(f"{bn}.weight", torch.rand(c, generator=gen) + 0.5, scope=bn),
            g.add_constant(f"{bn}.bias", torch.randn(c, generator=gen), scope=bn),
        ]
    out += [
        g.add_constant(f"{bn}.running_mean", torch.randn(c, generator=gen), "buffer", scope=bn),
        g.add_constant(f"{bn}.running_var", torch.rand(c, generator=gen) + 0.1, "buffer", scope=bn),
        g.add_constant(f"{bn}.num_batches_tracked", torch.tensor(5), "buffer", scope=bn),
    ]
    return out


def conv_bn(
    op: Any,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    c_out: int,
    *,
    bias: bool = True,
    affine: bool = True,
    eps: float = 1e-5,
    seed: int = 0,
) -> Graph:
    gen = torch.Generator().manual_seed(seed)
    g = Graph("m")
    x = g.add_input("x", TensorType(x_shape))
    ops: list[Value] = [x, g.add_constant("conv.weight", torch.randn(w_shape, generator=gen), scope="conv")]
    if bias:
        ops.append(g.add_constant("conv.bias", torch.randn(c_out, generator=gen), scope="conv"))
    c = g.add_node(op, ops, scope="conv", name="conv")
    bn = g.add_node(BatchNorm(eps=eps, affine=affine), [c, *_bn_params(g, c_out, affine, gen)], scope="bn", name="bn")
    g.set_output(bn)
    verify(g)
    return g


def _tr(dims: int, **kw: Any) -> dict[str, Any]:
    geometry = dict(stride=(2,) * dims, padding=(1,) * dims, output_padding=(1,) * dims, dilation=(1,) * dims)
    return {**geometry, **kw}


CASES = {
    "conv1d": lambda bias: (Conv1d(bias=bias, groups=2), (2, 4, 9), (6, 2, 3), 6),
    "conv2d": lambda bias: (Conv2d(bias=bias, padding=(1, 1)), (2, 3, 6, 6), (5, 3, 3, 3), 5),
    "conv2d-depthwise": lambda bias: (Conv2d(bias=bias, groups=4), (1, 4, 5, 5), (4, 1, 3, 3), 4),
    "conv3d": lambda bias: (Conv3d(bias=bias), (1, 2, 4, 4, 4), (3, 2, 2, 2, 2), 3),
    "conv_transpose1d": lambda bias: (ConvTranspose1d(**_tr(1, bias=bias)), (2, 4, 5), (4, 3, 3), 3),
    "conv_transpose2d-groups": lambda bias: (
        ConvTranspose2d(**_tr(2, bias=bias, groups=2)),
        (1, 4, 4, 4),
        (4, 3, 3, 3),
        6,
    ),
    "conv_transpose3d": lambda bias: (ConvTranspose3d(**_tr(3, bias=bias)), (1, 2, 3, 3, 3), (2, 3, 2, 2, 2), 3),
    "linear": lambda bias: (Linear(bias=bias), (4, 7), (5, 7), 5),
}


def _absorb(g: Graph, check_types: bool = True, **kw: Any) -> Graph:
    out = g.copy()
    AbsorbBatchNorm(**kw).apply(PassContext(), out)
    verify(out, check_types=check_types)
    return out


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_folds_and_keeps_outputs(case: str, bias: bool, affine: bool) -> None:
    op, x_shape, w_shape, c_out = CASES[case](bias)
    g = conv_bn(op, x_shape, w_shape, c_out, bias=bias, affine=affine, eps=1e-3)
    x = torch.randn(x_shape)
    after = _absorb(g)
    assert [n.op.name for n in after.nodes if n.op.name != "constant"] == [op.name]
    conv = after.find("conv")
    assert isinstance(conv, Node) and conv.op.bias and conv.scope == "conv"  # type: ignore[attr-defined]
    assert sorted(after.constants) == ["conv.bias", "conv.weight"]  # the conv's keys; bn's are gone
    assert [f.role for f in fused_from(conv)] == ["bn"] and fused_from(conv)[0].scope == "bn"
    torch.testing.assert_close(run_graph(after, x), run_graph(g, x), rtol=1e-4, atol=1e-4)


def test_fold_math_matches_torch_fusion_utility() -> None:
    conv, bn = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, eps=1e-2)
    mean, var = bn.running_mean, bn.running_var
    assert mean is not None and var is not None
    mean.uniform_(-1, 1)
    var.uniform_(0.5, 2)
    bn.weight.data.uniform_(0.5, 2)
    bn.eval()
    conv.eval()
    ref = torch.nn.utils.fusion.fuse_conv_bn_eval(conv, bn)
    w, b = fold_batch_norm(Conv2d(), conv.weight, conv.bias, mean, var, bn.weight, bn.bias, bn.eps)
    torch.testing.assert_close(w.float(), ref.weight.detach())
    assert ref.bias is not None
    torch.testing.assert_close(b.float(), ref.bias.detach())


@pytest.mark.parametrize(
    ("op", "w_shape", "dtype"),
    [
        (Conv2d(), (300, 16, 3, 3), torch.float32),  # one block, not full
        (Conv2d(groups=4), (8000, 4, 3, 3), torch.float32),  # blocks of 7281 channels, the last one partial
        (Linear(), (3, 300000), torch.float32),  # a row larger than a block: one row at a time
        (Conv1d(), (64, 8, 5), torch.float16),
        (ConvTranspose2d(**_tr(2, bias=True, groups=2)), (8, 3, 3, 3), torch.float32),
    ],
)
def test_fold_in_dtype_is_the_float64_fold_rounded_once(op: Any, w_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """The blockwise fold gives the bits of the float64 fold rounded to the weight's dtype."""
    gen = torch.Generator().manual_seed(0)
    c_out = w_shape[1] * op.groups if isinstance(op, ConvTranspose2d) else w_shape[0]
    weight = (torch.randn(w_shape, generator=gen) * 3).to(dtype)
    bias, mean = torch.randn(c_out, generator=gen).to(dtype), torch.randn(c_out, generator=gen).to(dtype)
    var = (torch.rand(c_out, generator=gen) + 1e-3).to(dtype)
    gamma, beta = torch.randn(c_out, generator=gen).to(dtype), torch.randn(c_out, generator=gen).to(dtype)
    w64, b64 = fold_batch_norm(op, weight, bias, mean, var, gamma, beta, 1e-5)
    w, b = folded_in_dtype(op, weight, bias, mean, var, gamma, beta, 1e-5)
    assert w.dtype == dtype and w.shape == weight.shape
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    assert torch.equal(w.view(bits), w64.to(dtype).view(bits))
    assert b.dtype == torch.float64 and torch.equal(b, b64)


def test_keeps_parameter_kind_and_inputs_untouched() -> None:
    op, x_shape, w_shape, c_out = CASES["conv2d"](False)
    g = conv_bn(op, x_shape, w_shape, c_out, bias=False)
    w0 = g.constants["conv.weight"].clone()
    g.constants["conv.weight"] = torch.nn.Parameter(g.constants["conv.weight"])
    before = str(g)
    after = _absorb(g)
    assert str(g) == before and torch.equal(g.constants["conv.weight"].detach(), w0)
    assert isinstance(after.constants["conv.weight"], torch.nn.Parameter)
    assert isinstance(after.constants["conv.bias"], torch.nn.Parameter)
    bias_node = after.find("conv_bias")
    assert isinstance(bias_node, Node) and bias_node.op.kind == "parameter"  # type: ignore[attr-defined]


EXPECTED = """\
graph @m(%x: tensor<2x3x6x6xf32>) {
  %conv_weight: tensor<5x3x3x3xf32> = constant(key="conv.weight") @conv
  %conv_bias: tensor<5xf32> = constant(key="conv.bias") @conv
  %conv: tensor<2x5x6x6xf32> = conv2d(%x, %conv_weight, %conv_bias, padding=(1, 1)) @conv
  return %conv
}"""


def test_golden_ir() -> None:
    op, x_shape, w_shape, c_out = CASES["conv2d"](False)
    after = _absorb(conv_bn(op, x_shape, w_shape, c_out, bias=False))
    assert str(after).strip() == EXPECTED


def _declines(g: Graph, **kw: Any) -> None:
    after = g.copy()
    ctx = PassContext()
    changed = AbsorbBatchNorm(**kw).apply(ctx, after)
    assert not changed and str(after) == str(g)


def test_declines_when_conv_has_other_users() -> None:
    op, x_shape, w_shape, c_out = CASES["conv2d"](True)
    g = conv_bn(op, x_shape, w_shape, c_out)
    g.set_output((g.find("bn"), g.find("conv")))
    _declines(g)


def test_declines_fused_conv_shared_weight_and_runtime_weight() -> None:
    # already fused with an activation: bn after relu is not linear in the conv output
    op, x_shape, w_shape, c_out = CASES["conv2d"](True)
    g = conv_bn(Conv2d(padding=(1, 1), act="relu"), x_shape, w_shape, c_out)
    _declines(g)
    # a weight shared with another conv
    g = conv_bn(op, x_shape, w_shape, c_out)
    other = g.add_node(Conv2d(bias=False, padding=(1, 1)), [g.inputs[0], g.find("conv_weight")], name="other")
    g.set_output((g.find("bn"), other))
    _declines(g)
    # a weight computed at run time
    g = Graph()
    x = g.add_input("x", TensorType((1, 2, 4, 4)))
    w = g.add_input("w", TensorType((2, 2, 1, 1)))
    c = g.add_node(Conv2d(bias=False), [x, w], name="conv")
    bn = g.add_node(BatchNorm(), [c, *_bn_params(g, 2, True, torch.Generator().manual_seed(0))], name="bn")
    g.set_output(bn)
    _declines(g)


def test_declines_linear_whose_channels_are_not_axis_1() -> None:
    g = conv_bn(Linear(), (2, 5, 7), (5, 7), 5)  # bn on (N, L, C) normalises L (here L == C)
    _declines(g)


def test_training_graph_needs_force() -> None:
    op, x_shape, w_shape, c_out = CASES["conv2d"](True)
    g = conv_bn(op, x_shape, w_shape, c_out)
    g.training = True
    _declines(g)
    after = _absorb(g, force=True)
    assert not any(isinstance(n.op, BatchNorm) for n in after.nodes)


def test_conv_without_bias_gets_a_free_key() -> None:
    g = Graph()
    x = g.add_input("x", TensorType((1, 2, 3, 3)))
    w = g.add_constant("w", torch.randn(2, 2, 1, 1))
    g.add_constant("w_bias", torch.zeros(1))  # taken by something else
    c = g.add_node(Conv2d(bias=False), [x, w], name="c")
    bn = g.add_node(BatchNorm(), [c, *_bn_params(g, 2, True, torch.Generator().manual_seed(1))], name="bn")
    r = g.add_node(Relu(), [bn])
    g.set_output(r)
    after = _absorb(g)
    assert "w_bias_1" in after.constants
    torch.testing.assert_close(run_graph(after, torch.ones(1, 2, 3, 3)), run_graph(g, torch.ones(1, 2, 3, 3)))


def test_pipeline_name_and_idempotence() -> None:
    op, x_shape, w_shape, c_out = CASES["conv_transpose2d-groups"](False)
    g = conv_bn(op, x_shape, w_shape, c_out, bias=False)
    once = run_pipeline(g, "absorb-bn").graph
    assert not any(isinstance(n.op, BatchNorm) for n in once.nodes)
    twice = once.copy()
    assert not AbsorbBatchNorm().apply(PassContext(), twice)
    assert str(twice) == str(once)


@settings()
@given(fusion_graphs(), st.integers(0, 2**16))
def test_absorb_preserves_outputs(g: Graph, seed: int) -> None:
    args = graph_inputs(g, seed)
    ref = run_graph(g, *args)
    after = _absorb(g, check_types=False)  # the unit tests check inferred types; meta inference is slow
    got = run_graph(after, *args)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # nothing left that the pass could fold, except what it must decline (shared weights)
    for m in find_all(bn_pattern(), after):
        conv = m.node("conv")
        assert conv.operands[1].num_uses > 1 or (conv.attrs["bias"] and conv.operands[2].num_uses > 1)
    assert_pattern_maximal(bn_pattern(), g)


def _tower(sites: int, *, bias: bool, same_bn: bool = True) -> Graph:
    """One conv + batch norm module pair called at ``sites`` places (a head over FPN levels)."""
    gen = torch.Generator().manual_seed(3)
    g = Graph("m")
    xs = [g.add_input(f"x{i}", TensorType((1, 3, 5, 5))) for i in range(sites)]
    w = g.add_constant("conv.weight", torch.randn(4, 3, 3, 3, generator=gen), scope="conv")
    conv_ops: list[Value] = [w]
    if bias:
        conv_ops.append(g.add_constant("conv.bias", torch.randn(4, generator=gen), scope="conv"))
    stats = _bn_params(g, 4, True, gen)
    outs: list[Value] = []
    for i, x in enumerate(xs):
        c = g.add_node(Conv2d(bias=bias, padding=(1, 1)), [x, *conv_ops], scope="conv", name=f"conv{i}")
        scope = "bn"
        if not same_bn and i == sites - 1:  # the last site has a batch norm of its own
            scope = "last_bn"
            stats = _bn_params(g, 4, True, gen, scope)
        outs.append(g.add_node(BatchNorm(), [c, *stats], scope=scope, name=f"bn{i}"))
    g.set_output(tuple(outs))
    verify(g)
    return g


@pytest.mark.parametrize("bias", [True, False])
def test_a_conv_bn_pair_called_at_several_places_folds_once(bias: bool) -> None:
    g = _tower(3, bias=bias)
    xs = [torch.randn(1, 3, 5, 5) for _ in range(3)]
    ctx = PassContext()
    after = g.copy()
    AbsorbBatchNorm().apply(ctx, after)
    verify(after)
    assert [n.op.name for n in after.nodes if n.op.name != "constant"] == ["conv2d"] * 3
    assert sorted(after.constants) == ["conv.bias", "conv.weight"]  # one folded weight for every site
    convs = [n for n in after.nodes if n.op.name == "conv2d"]
    assert all(c.operands[1] is convs[0].operands[1] and c.operands[2] is convs[0].operands[2] for c in convs)
    assert [fused_from(c)[0].scope for c in convs] == ["bn"] * 3
    for a, b in zip(run_graph(after, *xs), run_graph(g, *xs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_shared_conv_followed_by_different_batch_norms_does_not_fold() -> None:
    g = _tower(2, bias=True, same_bn=False)
    after = _absorb(g)
    assert [n.op.name for n in after.nodes if n.op.name != "constant"].count("batch_norm") == 2
