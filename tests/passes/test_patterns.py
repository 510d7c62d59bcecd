"""The pattern engine (passes/patterns.py) and the rewrite driver (passes/rewrite.py).

``fusion_graphs`` below is the local random-graph strategy shared by test_absorb_bn.py
and test_fuse.py (conv/linear/bn/add/relu/relu6 chains with branches, shared uses,
shared weights, pre-fused convs and extra outputs).
"""

from __future__ import annotations

import operator
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from passes.patterns import Any as AnyP
from passes.patterns import (
    Match,
    MatchAllNode,
    MatchStats,
    OpIndex,
    OpPattern,
    P,
    PatternError,
    as_pattern,
    find_all,
    match,
    match_all,
    resolve_spelling,
)
from passes.rewrite import RewriteError, Rule, apply_rewrites
from qir.ir import Commutative, Elementwise, Graph, Node, TensorType, Value, verify
from qir.ir.ops.core import Constant
from qir.ir.ops.elementwise import Add, Relu, Relu6
from qir.ir.ops.nn import BatchNorm, Conv2d, ConvNd, ConvTranspose2d, Linear
from qir.testing.patterns import assert_pattern_maximal, brute_force_matches

# --------------------------------------------------------------------------- random graphs


@attrs.define
class _Builder:
    graph: Graph
    gen: torch.Generator
    channels: int
    linear: bool
    pool: list[Value] = attrs.field(factory=list)
    weights: list[Node] = attrs.field(factory=list)
    count: int = 0

    def scope(self, kind: str) -> str:
        self.count += 1
        return f"{kind}{self.count}"

    def const(self, key: str, t: torch.Tensor, kind: str = "parameter") -> Node:
        return self.graph.add_constant(key, t, kind=kind, scope=key.rpartition(".")[0])


def _conv(draw: Any, b: _Builder, x: Value) -> Node:
    c, g = b.channels, b.graph
    s = b.scope("fc" if b.linear else "conv")
    transpose = not b.linear and draw(st.booleans())
    groups = draw(st.sampled_from((1, c))) if not b.linear else 1
    bias = draw(st.booleans())
    if b.weights and draw(st.integers(0, 5)) == 0:
        w = b.weights[draw(st.integers(0, len(b.weights) - 1))]  # shared weight
        key: str = w.op.key  # type: ignore[attr-defined]
        shape = tuple(g.constants[key].shape)
        if b.linear != (len(shape) == 2) or transpose != (key.endswith("tweight")) or shape[1] != c // groups:
            w = None  # type: ignore[assignment]
    else:
        w = None  # type: ignore[assignment]
    if w is None:
        if b.linear:
            shape = (c, c)
        elif transpose:
            shape = (c, c // groups, 3, 3)
        else:
            shape = (c, c // groups, 3, 3)
        wt = torch.randn(shape, generator=b.gen) / (shape[1] * (9 if len(shape) == 4 else 1)) ** 0.5
        w = b.const(f"{s}.{'tweight' if transpose else 'weight'}", wt)
        b.weights.append(w)
    ops: list[Value] = [x, w]
    if bias:
        ops.append(b.const(f"{s}.bias", torch.randn(c, generator=b.gen) * 0.1))
    act = draw(st.sampled_from((None, None, None, "relu", "relu6")))
    op: Any
    if b.linear:
        op = Linear(bias=bias, act=act)
    elif transpose:
        geometry: dict[str, Any] = dict(stride=(1, 1), padding=(1, 1), output_padding=(0, 0), dilation=(1, 1))
        op = ConvTranspose2d(**geometry, groups=groups, bias=bias, act=act)
    else:
        op = Conv2d(padding=(1, 1), groups=groups, bias=bias, act=act)
    return g.add_node(op, ops, x.type, scope=s, name=s)  # shape-preserving; skips slow meta inference


def _bn(draw: Any, b: _Builder, x: Value) -> Node:
    c, s = b.channels, b.scope("bn")
    affine = draw(st.booleans())
    eps = draw(st.sampled_from((1e-5, 1e-3, 0.1)))
    params: list[Value] = []
    if affine:
        params += [
            b.const(f"{s}.weight", torch.rand(c, generator=b.gen) + 0.5),
            b.const(f"{s}.bias", torch.randn(c, generator=b.gen) * 0.2),
        ]
    params += [
        b.const(f"{s}.running_mean", torch.randn(c, generator=b.gen) * 0.2, "buffer"),
        b.const(f"{s}.running_var", torch.rand(c, generator=b.gen) + 0.5, "buffer"),
        b.const(f"{s}.num_batches_tracked", torch.tensor(7), "buffer"),
    ]
    op = BatchNorm(eps=eps, affine=affine, dims=1 if b.linear else 2)
    return b.graph.add_node(op, [x, *params], x.type, scope=s, name=s)


@st.composite
def fusion_graphs(draw: Any, max_nodes: int = 8, training: bool = False) -> Graph:
    """A random graph of conv2d / conv_transpose2d (or linear) / batch_norm / add / relu / relu6."""
    linear = draw(st.booleans())
    c = draw(st.sampled_from((2, 3, 4)))
    g = Graph("rand")
    g.training = training
    b = _Builder(g, torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))), c, linear)
    shape = (2, c) if linear else (1, c, 5, 5)
    b.pool.append(g.add_input("x", TensorType(shape)))
    if draw(st.booleans()):
        b.pool.append(g.add_input("y", TensorType(shape)))
    for _ in range(draw(st.integers(1, max_nodes))):
        src: Value = b.pool[-1] if draw(st.integers(0, 3)) else b.pool[draw(st.integers(0, len(b.pool) - 1))]
        kind = draw(st.sampled_from(("conv", "conv", "bn", "bn", "add", "relu", "relu6")))
        if kind == "conv":
            node = _conv(draw, b, src)
        elif kind == "bn":
            node = _bn(draw, b, src)
        elif kind == "add":
            other = b.pool[draw(st.integers(0, len(b.pool) - 1))]  # may be src itself: add(%a, %a)
            node = g.add_node(Add(), [src, other] if draw(st.booleans()) else [other, src], src.type, name="add")
        else:
            op = Relu() if kind == "relu" else Relu6()
            node = g.add_node(op, [src], src.type, name=kind, scope=b.scope(kind))
        b.pool.append(node)
    extra = draw(st.lists(st.sampled_from(b.pool[1:]), max_size=2)) if len(b.pool) > 1 else []
    g.set_output((b.pool[-1], *extra) if extra else b.pool[-1])
    return g


def test_fusion_graphs_are_well_typed() -> None:
    @settings(max_examples=10)
    @given(fusion_graphs())
    def check(g: Graph) -> None:
        verify(g)  # explicit types above agree with inference

    check()


def graph_inputs(g: Graph, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for a in g.inputs:
        assert isinstance(a.type, TensorType)
        out.append(torch.randn(a.type.shape, generator=gen))
    return out


# --------------------------------------------------------------------------- fixtures


def conv_bn_add_relu(add_first: bool = True) -> Graph:
    """x -> conv -> bn -> add(., y) -> relu (the seeds' ModelForFusion)."""
    g = Graph("m")
    x = g.add_input("x", TensorType((1, 3, 6, 6)))
    y = g.add_input("y", TensorType((1, 3, 4, 4)))
    w = g.add_constant("conv.weight", torch.randn(3, 3, 3, 3), scope="conv")
    bias = g.add_constant("conv.bias", torch.randn(3), scope="conv")
    c = g.add_node(Conv2d(), [x, w, bias], scope="conv", name="conv")
    stats = [
        g.add_constant(f"bn.{k}", t, scope="bn")
        for k, t in (
            ("weight", torch.rand(3) + 0.5),
            ("bias", torch.randn(3)),
            ("running_mean", torch.randn(3)),
            ("running_var", torch.rand(3) + 0.5),
            ("num_batches_tracked", torch.tensor(1)),
        )
    ]
    bn = g.add_node(BatchNorm(), [c, *stats], scope="bn", name="bn")
    a = g.add_node(Add(), [bn, y] if add_first else [y, bn], name="add")
    r = g.add_node(Relu(), [a], scope="relu", name="relu")
    g.set_output(r)
    return g


def node(g: Graph, name: str) -> Node:
    v = g.find(name)
    assert isinstance(v, Node)
    return v


CONV = P(Conv2d, P.any("x")).named("conv")

# --------------------------------------------------------------------------- kinds


def test_kind_op_class_set_and_trait() -> None:
    g = conv_bn_add_relu()
    assert match(P(Add), node(g, "add")) is not None
    assert match(P(Relu), node(g, "add")) is None
    assert match(P({Relu, Relu6}), node(g, "relu")) is not None
    assert match(P(ConvNd), node(g, "conv")) is not None  # base classes cover subclasses
    assert match(P(Commutative), node(g, "add")) is not None
    assert match(P(Commutative), node(g, "relu")) is None
    assert match(P(Elementwise), node(g, "relu")) is not None


def test_wildcard_matches_inputs_and_captures() -> None:
    g = conv_bn_add_relu()
    m = match(P(Add, P(BatchNorm), AnyP.named("other")), node(g, "add"))
    assert m is not None and m["other"] is g.inputs[1]
    assert MatchAllNode is AnyP
    assert match(P.any("v"), g.inputs[0]) is not None


def test_repeated_name_binds_same_value() -> None:
    g = Graph()
    x = g.add_input("x", TensorType((2,)))
    y = g.add_input("y", TensorType((2,)))
    same = g.add_node(Add(), [x, x])
    diff = g.add_node(Add(), [x, y])
    g.set_output((same, diff))
    pat = P(Add, P.any("a"), P.any("a"))
    assert match(pat, same) is not None
    assert match(pat, diff) is None
    # both orders bind the same value; the slots tell them apart
    assert sorted(m.slots for m in match_all(pat, same)) == [(None, 0, 1), (None, 1, 0)]


def test_commutative_either_order_records_slot() -> None:
    for add_first, slot in ((True, 0), (False, 1)):
        g = conv_bn_add_relu(add_first)
        m = match(P(Add, P.any("other"), P(BatchNorm).named("bn")), node(g, "add"))
        assert m is not None and m.slot("bn") == slot and m.slot("other") == 1 - slot
        assert m.root is node(g, "add") and m.slots[0] is None


def test_commutative_can_be_disabled_or_forced() -> None:
    g = conv_bn_add_relu(add_first=False)  # add(y, bn)
    assert match(P(Add, P(BatchNorm), P.any(), commutative=False), node(g, "add")) is None
    assert match(P(Add, P(BatchNorm), P.any()), node(g, "add")) is not None
    # conv is not commutative; a pattern may say its operands are
    swapped = P(Conv2d, P.const("w"), P.any("x"), commutative=True)
    m = match(swapped, node(g, "conv"))
    assert m is not None and m.slot("w") == 1
    assert match(P(Conv2d, P.const(), P.any()), node(g, "conv")) is None
    with pytest.raises(PatternError, match="commutative"):
        P(Relu, P.any(), commutative=True)


def test_attribute_predicates() -> None:
    g = conv_bn_add_relu()
    c = node(g, "conv")
    assert match(P(Conv2d, act=None, bias=True), c) is not None
    assert match(P(Conv2d, act="relu"), c) is None
    assert match(P(Conv2d).where(act={None, "relu"}), c) is not None
    assert match(P(Conv2d).where(groups=lambda v: v > 1), c) is None
    assert match(P(Conv2d).where(lambda n: n.scope == "conv"), c) is not None
    with pytest.raises(PatternError, match="no attribute 'nope'"):
        P(Conv2d, nope=1)


def test_interior_nodes_single_use_by_default() -> None:
    g = conv_bn_add_relu()
    bn = node(g, "bn")
    pat = P(Add, P(BatchNorm, P(Conv2d)), P.any())
    assert match(pat, node(g, "add")) is not None
    g.set_output((node(g, "relu"), bn))  # bn now has a second use
    assert match(pat, node(g, "add")) is None
    assert match(P(Add, P(BatchNorm, P(Conv2d)).multi_use(), P.any()), node(g, "add")) is not None
    assert match(P(BatchNorm, P(Conv2d)), bn) is not None  # the root may have many users
    assert match(P(BatchNorm, P(Conv2d)).only_use(), bn) is None


def test_constant_operands() -> None:
    g = conv_bn_add_relu()
    c = node(g, "conv")
    m = match(P(Conv2d, P.any(), P.const("w"), P.const("b")), c)
    assert m is not None and isinstance(m.node("w").op, Constant)
    assert match(P(Conv2d, P.any(), P.const(tensor=lambda t: t.dim() == 4)), c) is not None
    assert match(P(Conv2d, P.any(), P.const(tensor=lambda t: t.dim() == 2)), c) is None
    assert match(P(Conv2d, P.const()), c) is None  # operand 0 is the input


def test_leading_operands_only_and_arity() -> None:
    g = conv_bn_add_relu()
    assert match(P(Conv2d, P.any()), node(g, "conv")) is not None  # weight/bias free
    too_many = P(Relu, P.any(), P.any())
    assert match(too_many, node(g, "relu")) is None


def test_match_accessors_and_errors() -> None:
    g = conv_bn_add_relu()
    m = match(P(Relu, P(Add, P(BatchNorm, CONV), P.any("y")).named("add")), node(g, "relu"))
    assert m is not None
    assert [n.name for n in m.nodes] == ["relu", "add", "bn", "conv"]
    assert m.captures == {"add": node(g, "add"), "conv": node(g, "conv"), "x": g.inputs[0], "y": g.inputs[1]}
    assert "conv" in m and "z" not in m
    with pytest.raises(KeyError, match="no capture 'z'"):
        m["z"]
    with pytest.raises(TypeError, match="graph input"):
        m.node("x")
    assert str(m.pattern) == "relu(add(batch_norm(conv2d(_ @x) @conv), _ @y) @add)"


# --------------------------------------------------------------------------- tuple form


def test_tuple_form_resolves_torch_spellings() -> None:
    assert resolve_spelling(nn.Conv2d) == (Conv2d,)
    assert resolve_spelling(nn.SyncBatchNorm) == (BatchNorm,)
    assert resolve_spelling(F.relu) == (Relu,)
    assert resolve_spelling(nn.ReLU6) == (Relu6,)
    for add in (torch.add, operator.add, torch.ao.nn.quantized.FloatFunctional.add, torch.Tensor.add, "add"):
        assert resolve_spelling(add) == (Add,), add

    class MyConv(nn.Conv2d):
        pass

    assert resolve_spelling(MyConv) == (Conv2d,)


def test_tuple_form_unresolvable_entry_is_named() -> None:
    def my_op(x: Any) -> Any:
        return x

    with pytest.raises(PatternError, match="my_op"):
        as_pattern((F.relu, (my_op, MatchAllNode)))

    class Mystery(nn.Module):
        pass

    with pytest.raises(PatternError, match="Mystery"):
        as_pattern((Mystery, nn.Conv2d))


def test_tuple_form_seed_patterns_match_both_sides() -> None:
    from torch.ao.quantization.utils import MatchAllNode as TorchMatchAll

    for add_first in (True, False):
        g = conv_bn_add_relu(add_first)
        for spec in (
            (nn.ReLU, (operator.add, (nn.BatchNorm2d, nn.Conv2d), MatchAllNode)),
            (F.relu, (torch.add, MatchAllNode, (nn.SyncBatchNorm, nn.Conv2d))),
            (nn.ReLU, (torch.ao.nn.quantized.FloatFunctional.add, (nn.BatchNorm2d, nn.Conv2d), TorchMatchAll)),
        ):
            m = match(spec, node(g, "relu"))
            assert m is not None, spec
            # which add operand the bn was
            assert m.slots[m.values.index(node(g, "bn"))] == (0 if add_first else 1)
        assert match((nn.ReLU6, (operator.add, nn.Conv2d, MatchAllNode)), node(g, "relu")) is None


def seed_fusion_patterns() -> list[tuple[Any, ...]]:
    """Every tuple ``register_fusion_patterns`` in the seeds registers."""
    convs = (nn.Conv2d, nn.ConvTranspose2d, nn.Conv3d, nn.Linear)
    bns = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    adds: list[Any] = [torch.ao.nn.quantized.FloatFunctional.add, torch.add, operator.add]
    try:
        from qir.nn.quantized import FloatFunctional  # type: ignore[import-not-found]

        adds.append(FloatFunctional.add)
    except ImportError:  # not written yet in every checkout
        pass
    relus = (nn.ReLU, nn.ReLU6, F.relu, F.relu6)
    out: list[tuple[Any, ...]] = []
    for conv in convs:
        for bn in bns:
            for add in adds:
                for relu in relus:
                    out += [
                        (bn, conv),
                        (relu, conv),
                        (add, conv, MatchAllNode),
                        (add, MatchAllNode, conv),
                        (relu, (bn, conv)),
                        (add, (bn, conv), MatchAllNode),
                        (add, MatchAllNode, (bn, conv)),
                        (relu, (add, conv, MatchAllNode)),
                        (relu, (add, MatchAllNode, conv)),
                        (relu, (add, (bn, conv), MatchAllNode)),
                        (relu, (add, MatchAllNode, (bn, conv))),
                    ]
    return out


def test_every_seed_registration_resolves() -> None:
    patterns = [as_pattern(spec) for spec in seed_fusion_patterns()]
    g = conv_bn_add_relu()
    roots = {m.root.name for p in patterns for m in find_all(p, g)}
    assert roots == {"bn", "add", "relu"}


def test_tuple_form_head_alternatives_and_bare_entry() -> None:
    g = conv_bn_add_relu()
    assert match(({nn.ReLU, nn.ReLU6}, operator.add), node(g, "relu")) is not None
    assert match(nn.Conv2d, node(g, "conv")) is not None
    assert isinstance(as_pattern((nn.Conv2d,)), OpPattern)


# --------------------------------------------------------------------------- find_all


def test_find_all_graph_order_and_kind_index() -> None:
    g = Graph()
    x = g.add_input("x", TensorType((2,)))
    vals: list[Value] = [x]
    for i in range(6):
        vals.append(g.add_node(Relu() if i % 2 else Relu6(), [vals[-1]], name=f"r{i}"))
    g.set_output(vals[-1])
    ms = find_all(P({Relu, Relu6}, P.any()), g)
    assert [m.root.name for m in ms] == [f"r{i}" for i in range(6)]
    stats = MatchStats()
    ms = find_all(P(Relu6, P(Relu)), g, stats=stats, index=OpIndex(g))
    assert [m.root.name for m in ms] == ["r2", "r4"]
    assert (stats.tried, stats.matched) == (3, 2)  # only relu6 nodes were tried


SEED_PATTERNS: list[Any] = [
    (nn.ReLU, (operator.add, (nn.BatchNorm2d, nn.Conv2d), MatchAllNode)),
    (torch.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)),
    (torch.add, nn.Conv2d, MatchAllNode),
    (F.relu6, (nn.BatchNorm1d, nn.Linear)),
    (nn.BatchNorm2d, nn.ConvTranspose2d),
    (operator.add, MatchAllNode, MatchAllNode),
]
BUILT_PATTERNS: list[Any] = [
    P(Add, P.any("a"), P.any("a")),
    P({Relu, Relu6}, P(Add, P((ConvNd, Linear), P.any()).where(act=None), P.any())),
    P(BatchNorm, P((Conv2d, ConvTranspose2d, Linear), P.any(), P.const()).multi_use()),
    P(Add, P(Relu, P.any("x")), P(Relu6, P.any("x"))),
    P(Commutative, P(BatchNorm), P(BatchNorm)),
    P(Add, P.any("a").only_use(), P(Add).named("inner")),
]


@settings()
@given(fusion_graphs(), st.sampled_from(SEED_PATTERNS + BUILT_PATTERNS))
def test_find_all_agrees_with_brute_force(g: Graph, pattern: Any) -> None:
    assert_pattern_maximal(pattern, g)


def test_brute_force_sees_what_the_engine_sees() -> None:
    g = conv_bn_add_relu(add_first=False)
    spec = (operator.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d))
    bindings = brute_force_matches(spec, g)
    assert [b.root.name for b in bindings] == ["add"]
    assert bindings[0].slots == (None, 0, 1, 0)


def test_assert_pattern_maximal_reports_a_wrong_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import qir.testing.patterns as tp

    g = conv_bn_add_relu()
    monkeypatch.setattr(tp, "find_all", lambda p, graph: [])
    with pytest.raises(AssertionError, match="missing: \\['%add'\\]"):
        tp.assert_pattern_maximal((operator.add, MatchAllNode, MatchAllNode), g)


# --------------------------------------------------------------------------- rewrite driver


def _relu_chain(n: int) -> Graph:
    g = Graph()
    v: Value = g.add_input("x", TensorType((2,)))
    for _ in range(n):
        v = g.add_node(Relu(), [v], name="r")
    g.set_output(v)
    return g


def _drop_double_relu(graph: Graph, m: Match) -> Value:
    return m.node("inner")


def test_driver_reaches_fixed_point_and_counts() -> None:
    g = _relu_chain(7)
    rules: list[Any] = [
        ("relu-relu", P(Relu, P(Relu).named("inner")), _drop_double_relu),
        Rule("never", P(BatchNorm), lambda graph, m: None),
    ]
    stats = apply_rewrites(g, rules)
    assert len(g) == 1 and stats.rules["relu-relu"].applied == 6
    assert stats.rules["never"].tried == stats.rules["never"].matched == stats.rules["never"].applied == 0
    assert "never" in str(stats) and stats.changed
    verify(g)
    again = apply_rewrites(g, rules)
    assert not again.changed


def test_driver_declined_rewrite_tries_next_binding() -> None:
    g = Graph()
    x = g.add_input("x", TensorType((2,)))
    a, b = g.add_node(Relu(), [x], name="a"), g.add_node(Relu6(), [x], name="b")
    s = g.add_node(Add(), [a, b], name="s")
    g.set_output(s)
    seen: list[str] = []

    def only_relu6(graph: Graph, m: Match) -> Value | None:
        seen.append(m.node("act").name)
        return m["other"] if isinstance(m.node("act").op, Relu6) else None

    stats = apply_rewrites(g, [("r", P(Add, P({Relu, Relu6}).named("act"), P.any("other")), only_relu6)])
    assert seen == ["a", "b"] and stats.rules["r"].matched == 2 and stats.rules["r"].applied == 1
    assert g.output is a  # add(a, b) -> a, and b died with the add
    assert [n.name for n in g.nodes] == ["a"]


def test_driver_raises_when_rules_do_not_converge() -> None:
    g = _relu_chain(2)

    def flip(graph: Graph, m: Match) -> Value:
        r = m.root
        new = graph.create_node(Relu6() if isinstance(r.op, Relu) else Relu(), r.operands)
        graph.insert_node(new, before=r)
        return new

    with pytest.raises(RewriteError, match=r"did not converge.*flip"):
        apply_rewrites(g, [("flip", P({Relu, Relu6}), flip)], max_iterations=20)


def test_driver_rule_names_unique_and_rule_shape_checked() -> None:
    with pytest.raises(ValueError, match="unique"):
        twice: list[Any] = [("a", P(Relu), _drop_double_relu), ("a", P(Relu), _drop_double_relu)]
        apply_rewrites(Graph(), twice)
    with pytest.raises(TypeError, match="rule"):
        apply_rewrites(Graph(), [("a", P(Relu))])  # type: ignore[list-item]


def _conv_bn_relu_chain(blocks: int) -> Graph:
    g = Graph("chain")

    def const(key: str, t: torch.Tensor) -> Node:
        # appended in place (O(1)); Graph.add_constant scans the constants block per call
        g.constants[key] = t
        op = Constant(key=key)
        return g.add_node(op, (), op.type_for(t), name=key)

    ty = TensorType((1, 2, 4, 4))  # given explicitly: meta-tensor inference would dominate the build
    v: Value = g.add_input("x", ty)
    for i in range(blocks):
        w = const(f"b{i}.conv.weight", torch.randn(2, 2, 1, 1))
        v = g.add_node(Conv2d(bias=False), [v, w], ty, scope=f"b{i}.conv", name="conv")
        bn = [
            const(f"b{i}.bn.{k}", t)
            for k, t in (
                ("weight", torch.ones(2)),
                ("bias", torch.zeros(2)),
                ("running_mean", torch.zeros(2)),
                ("running_var", torch.ones(2)),
                ("num_batches_tracked", torch.tensor(0)),
            )
        ]
        v = g.add_node(BatchNorm(), [v, *bn], ty, scope=f"b{i}.bn", name="bn")
        v = g.add_node(Relu(), [v], ty, scope=f"b{i}.relu", name="relu")
    g.set_output(v)
    return g


def _work_per_node(blocks: int) -> float:
    """Matcher attempts plus visited nodes per graph node for one fuse run: a deterministic
    cost measure (wall time belongs in benchmarks/pipeline_cost.py, not in tests)."""
    from passes.absorb_bn import absorb_bn_rule
    from passes.fuse import fuse_rules
    from passes.rewrite import apply_rewrites

    g = _conv_bn_relu_chain(blocks)
    n = len(g)
    stats = apply_rewrites(g, [absorb_bn_rule(False), *fuse_rules()])
    assert [n.op.act for n in g.nodes if isinstance(n.op, Conv2d)] == ["relu"] * blocks
    work = stats.visited + sum(r.tried for r in stats.rules.values())
    return work / n


def test_driver_work_is_linear_in_graph_size() -> None:
    # The worklist driver must not rescan the graph after each rewrite: the work per node
    # stays the same from 100 to 2,000 blocks (a rescanning driver grows with the size).
    small, large = _work_per_node(100), _work_per_node(2000)
    assert large <= small * 1.05, (small, large)


def test_docs_examples_run() -> None:
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "patterns.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    for block in blocks:
        exec(compile(block, "docs/patterns.md", "exec"), {})
