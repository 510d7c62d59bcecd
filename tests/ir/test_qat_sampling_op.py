"""``qat_grid_sample``: a prepared model's GridSample (bilinear with its output fake quant, nearest
without) is a typed op keeping the QAT contract (tests/ir/qat_family.py); bad fields are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qir
import qir.nn as qnn
from qir.frontend import emit, trace
from qir.ir import IRError, parse_graph, print_graph, run_graph
from qir.ir.ops.core import Call
from qir.ir.ops.qat import FakeQuantSpec
from qir.ir.ops.qat_sampling import QATGridSample
from qir.ir.ops.quant import ObserverSpec
from qir.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.integer_grid import set_integer_grid


class Warp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.grid_quant, self.dequant = QuantStub(), QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bilinear = qnn.GridSample(mode="bilinear", padding_mode="zeros", align_corners=False)
        self.nearest = qnn.GridSample(mode="nearest", padding_mode="border", align_corners=True)

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        y, g = self.conv(self.quant(x)), self.grid_quant(grid)
        return self.dequant(self.bilinear(y, g) + self.nearest(y, g))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, 8, 8), torch.rand(2, 5, 6, 2) * 2 - 1


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_grid_samples_are_typed_qat_ops_keeping_the_contract(march: str) -> None:
    torch.manual_seed(0)
    qir.set_march(march)
    x = _inputs()
    qat = prepare_qat_fx(Warp(), {"": get_default_qat_qconfig()}, x)
    qat(*_inputs())
    set_integer_grid(qat, False)
    other = copy.deepcopy(qat)
    g = trace(other, x)
    assert not [n for n in g.nodes if isinstance(n.op, Call) and n.scope]
    text = print_graph(g)
    assert print_graph(parse_graph(text, constants=g.constants, objects=g.objects)) == text
    for _ in range(2):
        b = _inputs()
        assert torch.equal(run_graph(g, *b), qat(*b))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in qat.state_dict().items())
    qat.eval()
    g.training = False
    back = emit(g)
    assert list(back.state_dict()) == list(qat.state_dict()) and torch.equal(back.eval()(*x), qat(*x))
    ops = [n.op for n in g.nodes if isinstance(n.op, QATGridSample)]
    assert [(op.mode, op.out_fq is None) for op in ops] == [("bilinear", False), ("nearest", True)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "bicubic"}, "mode must be one of"),
        ({"padding_mode": "reflection"}, "padding_mode must be one of"),
        ({"align_corners": None}, "align_corners must be a boolean"),
        ({"out_fq": None}, "bilinear has an output fake quant"),
    ],
)
def test_bad_fields_are_refused_naming_them(fields: dict[str, object], message: str) -> None:
    with pytest.raises(IRError, match=message):
        QATGridSample(**{"out_fq": FakeQuantSpec(ObserverSpec()), "mode": "bilinear", **fields})  # type: ignore[arg-type]


def test_verify_names_a_grid_of_the_wrong_shape() -> None:
    qir.set_march("bayes")
    x = _inputs()
    qat = prepare_qat_fx(Warp(), {"": get_default_qat_qconfig()}, x)
    g = trace(qat, x)
    node = next(n for n in g.nodes if isinstance(n.op, QATGridSample))
    types = [v.type for v in node.operands]
    types[1] = types[0]
    with pytest.raises(IRError, match=r"grid must be \(N=2, Ho, Wo, 2\)"):
        node.op.verify(types)
