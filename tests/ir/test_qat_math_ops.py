"""QAT LayerNorm, Softmax, GLU, PReLU and Div are typed ops in a prepared model's IR.

``qat_layer_norm`` (affine or not), ``qat_softmax`` (its exp table's fixed-scale fake quant),
``qat_glu`` (the sigmoid's fake quant), ``qat_prelu`` (one slope or one per channel) and
``qat_div`` keep the QAT contract (tests/ir/qat_family.py); the verifier names a bad field.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qir
import qir.nn as qnn
from qir.frontend import trace
from qir.ir import IRError
from qir.ir.ops.qat import FakeQuantSpec
from qir.ir.ops.qat_math import QATGlu, QATLayerNorm, QATPrelu, QATSoftmax
from qir.ir.ops.quant import ObserverSpec
from qir.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat_fx
from tests.ir.qat_family import assert_qat_contract


class Math(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc = nn.Linear(8, 16)
        self.ln, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16, elementwise_affine=False)
        self.sm, self.glu, self.pr, self.pr4 = nn.Softmax(dim=-1), nn.GLU(dim=-1), nn.PReLU(), nn.PReLU(4)
        self.div = qnn.Div()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(self.fc(self.quant(x)))
        g = self.pr(self.glu(self.sm(y) + self.ln2(y)))
        h = self.pr4(g.reshape(2, 4, 2, 4))
        return self.dequant(self.div(h, h * h + 1.0))


def _prepared(march: str) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    qir.set_march(march)
    x = torch.randn(2, 4, 8)
    qat = prepare_qat_fx(Math(), {"": get_default_qat_qconfig()}, example_inputs=(x,))
    for _ in range(2):
        qat(torch.randn(2, 4, 8))
    return qat, x


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_math_layers_are_typed_qat_ops_keeping_the_contract(march: str) -> None:
    qat, x = _prepared(march)
    g = assert_qat_contract(qat, x, lambda: torch.randn(2, 4, 8) * 3)
    names = [n.op.name for n in g.nodes if n.op.name.startswith("qat_") and n.op.name != "qat_functional"]
    assert names == [
        "qat_quant_stub", "qat_conv", "qat_layer_norm", "qat_softmax", "qat_layer_norm", "qat_glu", "qat_prelu",
        "qat_prelu", "qat_div", "qat_dequant_stub",
    ]  # fmt: skip
    ln, ln2 = [n for n in g.nodes if isinstance(n.op, QATLayerNorm)]
    assert [v.op.key for v in ln.operands[1:3]] == ["ln.weight", "ln.bias"]  # type: ignore[attr-defined]
    assert not ln2.op.elementwise_affine and ln2.operands[1].op.key == "ln2.activation_post_process.scale"  # type: ignore[attr-defined]
    (sm,) = [n.op for n in g.nodes if isinstance(n.op, QATSoftmax)]
    assert sm.exp_fq.observer.observer == "fixed_scale" and sm.exp_fq.observer.dtype.name == "qint16"
    assert [n.op.num_parameters for n in g.nodes if isinstance(n.op, QATPrelu)] == [1, 4]


_FQ = FakeQuantSpec(ObserverSpec())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: QATLayerNorm(out_fq=_FQ, normalized_shape=(0,)), "normalized_shape must be positive sizes"),
        (lambda: QATLayerNorm(out_fq=_FQ, normalized_shape=(4,), eps=0.0), r"eps must be a number in \(0, 1\)"),
        (lambda: QATSoftmax(out_fq=_FQ, exp_fq=_FQ), "exp_fq is the exp table's fixed scale"),
        (lambda: QATGlu(out_fq=_FQ, sigmoid_fq=_FQ, dim=True), "dim must be an integer"),
        (lambda: QATPrelu(out_fq=_FQ, num_parameters=0), "num_parameters must be an integer >= 1"),
    ],
)
def test_bad_fields_are_refused_naming_them(make: object, message: str) -> None:
    with pytest.raises(IRError, match=message):
        make()  # type: ignore[operator]


def test_verify_names_the_bad_operand() -> None:
    qat, x = _prepared("bayes")
    g = trace(qat, (x,))
    ln = next(n for n in g.nodes if isinstance(n.op, QATLayerNorm))
    types = [v.type for v in ln.operands]
    with pytest.raises(IRError, match=r"does not end in normalized_shape \(8,\)"):
        QATLayerNorm(out_fq=ln.op.out_fq, normalized_shape=(8,)).verify(types)
    glu = next(n for n in g.nodes if isinstance(n.op, QATGlu))
    with pytest.raises(IRError, match="dim 3 is out of range"):
        QATGlu(out_fq=glu.op.out_fq, sigmoid_fq=glu.op.sigmoid_fq, dim=3).verify([v.type for v in glu.operands])
    pr4 = [n for n in g.nodes if isinstance(n.op, QATPrelu)][1]
    with pytest.raises(IRError, match="weight must be a float tensor of shape"):
        QATPrelu(out_fq=pr4.op.out_fq, num_parameters=1).verify([v.type for v in pr4.operands])
