"""Graph building and editing: names, insertion, erasure, use replacement, DCE, copy."""

from __future__ import annotations

import pytest
import torch

from qir.ir import Graph, IRError, Node, TensorType, verify
from qir.ir.graph import sanitize_name, split_operands
from qir.ir.op import Ref
from qir.ir.ops.core import Call
from qir.ir.ops.elementwise import Add, Relu

T = TensorType((1, 2))


def chain() -> tuple[Graph, list[Node]]:
    g = Graph()
    x = g.add_input("x", T)
    a = g.add_node(Relu(), [x], name="a")
    b = g.add_node(Relu(), [a], name="b")
    c = g.add_node(Add(), [a, b], name="c")
    g.set_output(c)
    return g, [a, b, c]


def names(g: Graph) -> list[str]:
    return [n.name for n in g.nodes]


def test_names_are_unique_and_sanitized() -> None:
    g = Graph()
    x = g.add_input("layer1.0.conv", T)
    assert x.name == "layer1_0_conv"
    r1 = g.add_node(Relu(), [x])
    r2 = g.add_node(Relu(), [x])
    assert (r1.name, r2.name) == ("relu", "relu_1")
    assert sanitize_name("0bad-name") == "_0bad_name"
    assert sanitize_name("class") == "class_"


def test_exact_names_are_checked() -> None:
    g = Graph()
    g.add_input("x", T, exact=True)
    with pytest.raises(IRError, match="%x is defined twice"):
        g.add_input("x", T, exact=True)
    with pytest.raises(IRError, match="not an identifier"):
        g.add_input("a.b", T, exact=True)


def test_insert_before_and_after() -> None:
    g, (a, b, c) = chain()
    n1 = g.insert_node(g.create_node(Relu(), [a], name="n1"), before=b)
    n2 = g.insert_node(g.create_node(Relu(), [c], name="n2"), after=c)
    assert names(g) == ["a", "n1", "b", "c", "n2"]
    assert len(g) == 5
    assert n1.prev is a and n1.next is b and n2.next is None
    verify(g)
    with pytest.raises(IRError, match="already in a graph"):
        g.insert_node(n1, after=c)
    with pytest.raises(ValueError, match="exactly one"):
        g.insert_node(g.create_node(Relu(), [a]))


def test_erase_requires_no_users_and_names_them() -> None:
    g, (a, b, c) = chain()
    with pytest.raises(IRError, match=r"cannot erase %a: still used by %b, %c"):
        g.erase_node(a)
    with pytest.raises(IRError, match="the graph output"):
        g.erase_node(c)
    g.set_output(b)
    g.erase_node(c)
    assert names(g) == ["a", "b"] and a.users == [b]
    verify(g)


def test_replace_all_uses_updates_users_and_output() -> None:
    g, (a, b, c) = chain()
    x = g.inputs[0]
    a.replace_all_uses_with(x)
    assert [v.name for v in b.operands] == ["x"] and [v.name for v in c.operands] == ["x", "b"]
    assert a.num_uses == 0 and x.num_uses == 3  # a itself still reads x
    c2 = g.add_node(Relu(), [c], name="c2")
    c.replace_all_uses_with(b)  # c is the output: the output moves too
    assert g.output is b and c.num_uses == 0
    assert c2.operands == (b,)


def test_operand_use_counts() -> None:
    g = Graph()
    x = g.add_input("x", T)
    d = g.add_node(Add(), [x, x])  # a shared use: two slots
    assert x.num_uses == 2 and x.users == [d]
    d.set_operand(1, g.add_input("y", T))
    assert x.num_uses == 1
    d.set_operands([])
    assert x.num_uses == 0 and x.users == []


def test_dead_code_elimination_keeps_opaque_and_output() -> None:
    g, (a, _, _) = chain()
    w = g.add_constant("w", torch.ones(1, 2))
    dead = g.add_node(Add(), [a, w], name="dead")
    g.add_node(Relu(), [dead], name="dead2")
    side = g.add_node(Call(kind="function", target="print", args=(Ref(0),)), [a], type=TensorType((1, 2)))
    assert g.eliminate_dead_code() == 3  # dead2, dead, then the unused constant
    assert names(g) == ["a", "b", "c", side.name]
    assert "w" not in g.constants
    verify(g)


def test_copy_is_independent_but_shares_tensors() -> None:
    g, (a, _, c) = chain()
    w = torch.ones(2)
    g.add_constant("w", w)
    a.meta["note"] = 1
    h = g.copy()
    assert str(h) == str(g)
    assert h.constants["w"] is w
    h_a = h.find("a")
    assert isinstance(h_a, Node) and h_a is not a and h_a.meta == {"note": 1}
    h.find("b").replace_all_uses_with(h_a)
    assert [v.name for v in c.operands] == ["a", "b"]  # original untouched
    verify(g)
    verify(h)


def test_find_names_the_missing_value() -> None:
    g, _ = chain()
    with pytest.raises(KeyError, match="no value %zz in graph @main"):
        g.find("zz")


def test_add_constant_rejects_rebinding() -> None:
    g = Graph()
    g.add_constant("k", torch.zeros(1))
    with pytest.raises(IRError, match="already bound"):
        g.add_constant("k", torch.ones(1))


def test_constants_stay_at_the_top() -> None:
    g, _ = chain()
    k = g.add_constant("k", torch.zeros(1))
    assert next(iter(g.nodes)) is k


def test_split_operands_makes_refs() -> None:
    g = Graph()
    x, y = g.add_input("x", T), g.add_input("y", T)
    operands, template = split_operands([x, (y, x, 3)], leading=1)
    assert operands == [x, y]
    assert template == (Ref(1), (Ref(2), Ref(1), 3))


def test_networkx_view() -> None:
    g, _ = chain()
    nx_g = g.to_networkx()
    assert sorted(nx_g.successors("a")) == ["b", "c"]
    assert nx_g.number_of_edges() == 4
