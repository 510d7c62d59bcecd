"""Graph outputs that are dicts / lists (torch.fx's immutable containers) print and parse back."""

from __future__ import annotations

import torch
from torch import nn

from qir.frontend import trace
from qir.ir.parser import parse_graph
from qir.ir.printer import print_graph


class DictOut(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"a": x.relu(), "b": [x + 1, (x * 2,)]}


def test_dict_and_list_outputs_round_trip() -> None:
    g = trace(DictOut(), (torch.randn(2, 3),))
    text = print_graph(g)
    assert 'return {"a": %relu, "b": [%add, (%mul,)]}' in text
    assert print_graph(parse_graph(text)) == text
    assert type(g.output) is dict and type(g.output["b"]) is list
