"""Hypothesis properties of the IR core on random graphs (profiles: tests/conftest.py).

* the text form round-trips exactly (graphs and attribute literals);
* the verifier rejects each kind of corruption, naming the corrupted node;
* the interpreter agrees with torch.nn modules run directly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

from qir.ir import DType, Graph, Node, QuantSpec, Ref, TensorType, Value, VerifyError, run_graph, verify
from qir.ir.graph import map_values
from qir.ir.ops.core import Call
from qir.ir.ops.elementwise import Relu
from qir.ir.parser import MAX_INT_LITERAL, parse_value
from qir.ir.printer import format_value
from qir.testing import (
    assert_graphs_equal,
    assert_outputs_close,
    assert_roundtrip,
    graphs,
    inputs_for,
    supported_ops,
)

# ----------------------------------------------------------------------------- round trip

_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-MAX_INT_LITERAL, MAX_INT_LITERAL),  # the text form's bound on integer literals
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.just(...),
    st.sampled_from([torch.float32, torch.int8, torch.bool, DType.qint8, math.inf]),
    st.builds(slice, st.none() | st.integers(-3, 3), st.none() | st.integers(-3, 3), st.none() | st.integers(1, 3)),
    st.builds(lambda s: QuantSpec(s, DType.qint8), st.floats(1e-6, 10.0)),
)
literals = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4) | st.integers(-(2**64), 2**64), inner, max_size=3),
    ),
    max_leaves=10,
)


@given(literals)
def test_attribute_literals_round_trip(value: Any) -> None:
    text = format_value(value)
    back = parse_value(text)
    assert format_value(back) == text
    assert back == value


@given(graphs(max_nodes=10))
def test_random_graphs_round_trip(g: Graph) -> None:
    assert_roundtrip(g)
    assert_graphs_equal(g.copy(), g)


@given(graphs(ops=supported_ops(), max_nodes=6))
def test_graphs_over_every_supported_op_round_trip(g: Graph) -> None:
    verify(g)
    assert_roundtrip(g)


@given(graphs(ops=("relu", "add"), max_nodes=4), st.lists(st.integers(0, 5), min_size=1, max_size=4), literals)
def test_refs_in_opaque_calls_round_trip(g: Graph, picks: list[int], extra: Any) -> None:
    values: list[Value] = [*g.inputs, *g.nodes]
    operands = [values[i % len(values)] for i in picks]  # repeats give %<index> refs
    args = (*[Ref(i) for i in range(len(operands))], extra)
    call = g.add_node(
        Call(kind="function", target="f", args=args, kwargs={"k": [Ref(0)]}), operands, type=TensorType((1,))
    )
    g.set_output((g.output, call))
    g.objects["f"] = print  # the text names "f"; parsing resolves it through the graph's objects
    parsed = assert_roundtrip(g)
    assert list(parsed.nodes)[-1].op == call.op


# ----------------------------------------------------------------------------- verifier

CORRUPTIONS = (
    "use_before_def",
    "foreign_operand",
    "arity",
    "bad_shape",
    "duplicate_name",
    "missing_constant",
    "broken_links",
)


def corrupt(g: Graph, kind: str, data: st.DataObject) -> str:
    """Break ``g`` in one way; return the name of the node the verifier must blame."""
    nodes = list(g.nodes)
    computed = [n for n in nodes if n.op.name != "constant"]
    if kind == "use_before_def":  # read a value defined at or after the reader (a cycle when equal)
        i = data.draw(st.integers(0, len(computed) - 1))
        reader, later = computed[i], data.draw(st.sampled_from(computed[i:]))
        reader.set_operand(0, later)
        return reader.name
    if kind == "foreign_operand":
        n = data.draw(st.sampled_from(computed))
        i = data.draw(st.integers(0, len(n.operands) - 1))
        n.set_operand(i, Graph("other").add_input("y", n.operands[i].type))
        return n.name
    if kind == "arity":
        n = data.draw(st.sampled_from(computed))
        if data.draw(st.booleans()):
            n.set_operands([*n.operands, g.inputs[0]])
        else:
            n.set_operands(n.operands[:-1])
        return n.name
    if kind == "bad_shape":
        n = data.draw(st.sampled_from(nodes))
        assert isinstance(n.type, TensorType)
        shape = n.type.shape
        n.type = TensorType((shape[0] + 1, *shape[1:]) if shape else (2,), n.type.dtype)
        return n.name
    if kind == "duplicate_name":
        values: list[Value] = [*g.inputs, *nodes]
        j = data.draw(st.integers(1, len(values) - 1))
        victim = values[j]
        victim.name = values[data.draw(st.integers(0, j - 1))].name
        return victim.name
    if kind == "missing_constant":
        consts = [n for n in nodes if n.op.name == "constant"]
        assume(consts)  # graphs of only relu / add have no constants
        n = data.draw(st.sampled_from(consts))
        del g.constants[n.op.key]  # type: ignore[attr-defined]
        return n.name
    n = data.draw(st.sampled_from(nodes))  # broken_links
    n.prev = n
    return n.name


@pytest.mark.parametrize("kind", CORRUPTIONS)
@given(g=graphs(max_nodes=6), data=st.data())
def test_verifier_names_the_corrupted_node(g: Graph, kind: str, data: st.DataObject) -> None:
    verify(g)
    blamed = corrupt(g, kind, data)
    try:
        verify(g)
    except VerifyError as e:
        assert e.node == blamed, f"{kind}: blamed %{e.node}, expected %{blamed}: {e}"
        assert f"%{blamed}" in str(e)
    else:
        raise AssertionError(f"{kind} corruption of %{blamed} was not detected")


# ----------------------------------------------------------------------------- interpreter


def run_with_modules(g: Graph, x: torch.Tensor) -> Any:
    """Evaluate a conv / batch-norm / relu / add graph with torch.nn modules, not the ops."""
    env: dict[Value, Any] = {g.inputs[0]: x}
    for n in g.nodes:
        a = [env[v] for v in n.operands]
        op: Any = n.op
        if op.name == "constant":
            out = g.constants[op.key]
        elif op.name == "conv2d":
            w = a[1]
            m: nn.Module = nn.Conv2d(
                w.shape[1] * op.groups,
                w.shape[0],
                tuple(w.shape[2:]),
                padding=op.padding,
                groups=op.groups,
                bias=op.bias,
            )
            m.load_state_dict({"weight": w, **({"bias": a[2]} if op.bias else {})})
            out = m(a[0])
        elif op.name == "batch_norm":
            m = nn.BatchNorm2d(a[1].shape[0], eps=op.eps).eval()
            m.load_state_dict(
                dict(zip(("weight", "bias", "running_mean", "running_var", "num_batches_tracked"), a[1:], strict=True))
            )
            out = m(a[0])
        elif op.name in ("relu", "relu6"):
            out = (nn.ReLU() if op.name == "relu" else nn.ReLU6())(a[0])
        elif op.name == "add":
            out = torch.add(a[0], a[1])
        else:
            raise AssertionError(f"unexpected op {op.name}")
        env[n] = out
    return map_values(g.output, lambda v: env[v])


@given(graphs(max_nodes=8), st.data())
def test_interpreter_agrees_with_torch_modules(g: Graph, data: st.DataObject) -> None:
    (x,) = data.draw(inputs_for(g))
    with torch.no_grad():
        assert_outputs_close(run_graph(g, x), run_with_modules(g, x), atol=1e-6, rtol=1e-5)


def test_relu_node_is_reported_when_fed_a_later_value() -> None:
    # a fixed example of the property above, readable on its own
    g = Graph()
    x = g.add_input("x", TensorType((1,)))
    a = g.add_node(Relu(), [x], name="a")
    b = g.add_node(Relu(), [a], name="b")
    g.set_output(b)
    a.set_operand(0, b)
    try:
        verify(g)
    except VerifyError as e:
        assert e.node == "a" and isinstance(g.find("a"), Node)
    else:
        raise AssertionError("cycle not detected")
