"""Pattern spellings a pass author reaches for: module flavours, IR op names, wildcard predicates,
one operand of a commutative op."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

from passes.patterns import P, PatternError, as_pattern, find_all
from qir.frontend import trace
from qir.ir.graph import Graph


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 3, 1)
        self.b1 = nn.BatchNorm1d(3)
        self.b2 = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = y + self.c(x)  # the conv is add's second operand
        return self.b2(z), self.b1(y.mean((2,)))


@pytest.fixture(scope="module")
def graph() -> Graph:
    return trace(Net().eval(), (torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4)))


def roots(pattern: object, g: Graph) -> list[str]:
    return [m.root.name for m in find_all(pattern, g)]  # type: ignore[arg-type]


def test_module_class_entry_matches_only_its_flavour(graph: Graph) -> None:
    assert roots((nn.BatchNorm1d,), graph) == ["b1"]
    assert roots((nn.BatchNorm2d,), graph) == ["b2"]
    assert roots(P(nn.BatchNorm2d), graph) == ["b2"]
    assert roots(({nn.BatchNorm1d, nn.BatchNorm2d},), graph) == ["b2", "b1"]
    assert str(as_pattern((nn.BatchNorm1d,))) == "batch_norm{module=BatchNorm1d}"


def test_ir_op_names_in_tuple_patterns(graph: Graph) -> None:
    assert roots(("batch_norm",), graph) == ["b2", "b1"]
    assert roots(("add", "conv2d"), graph) == ["add"]
    assert roots(P("conv2d"), graph) == ["c"]


def test_one_operand_pattern_tries_both_sides_of_a_commutative_op(graph: Graph) -> None:
    assert roots((operator.add, nn.Conv2d), graph) == ["add"]
    (m,) = find_all((operator.add, nn.Conv2d), graph)
    assert m.slots[1] == 1  # the conv was found as the second operand
    assert roots(P(operator.add, P(nn.Conv2d), commutative=False), graph) == []


def test_wildcard_where(graph: Graph) -> None:
    is_input = P.any("lhs").where(lambda v: v.name == "y")
    assert roots(P(operator.add, is_input, P.any()), graph) == ["add"]
    assert roots(P(operator.add, P.any().where(lambda v: v.name == "x"), P.any()), graph) == []
    assert "_{<lambda>} @lhs" in str(is_input)
    with pytest.raises(PatternError, match=r"wildcard has no op attributes.*P\.op\(kind, act=\.\.\.\)"):
        P.any().where(act=None)
