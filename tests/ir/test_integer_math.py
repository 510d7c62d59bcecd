"""Integer ops for PReLU, GLU, Softmax and LayerNorm.

A converted model's quantized PReLU, GLU, Softmax and LayerNorm (qint8 and qint16 LayerNorm
input) trace to ``qprelu`` / ``qglu`` / ``qsoftmax`` / ``qlayer_norm`` instead of opaque module
calls on both marches; run_graph and emit compute exactly what the converted model does with
the same state-dict keys; the text form round-trips; bad operands are refused naming the op;
the legality reports equal those of the same model traced with the modules kept opaque.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qir.frontend import trace
from qir.ir import IRError, print_graph
from qir.ir.ops.integer import IntegerModuleOp
from qir.ir.ops.integer_math import QGlu, QLayerNorm, QPrelu, QSoftmax
from qir.ir.types import DType, QuantSpec, TensorType
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from tests.ir.integer_family import assert_check_model_unchanged, assert_round_trips, assert_runs_and_emits_as

OPS = {
    "prelu": "qprelu",
    "prelu1": "qprelu",
    "glu": "qglu",
    "sm": "qsoftmax",
    "ln": "qlayer_norm",
    "ln16": "qlayer_norm",
}
FAMILY = (QPrelu, QGlu, QSoftmax, QLayerNorm)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.prelu = nn.PReLU(8, init=0.2)
        self.prelu1 = nn.PReLU()
        self.glu = nn.GLU(1)
        self.sm = nn.Softmax(-1)
        self.ln = nn.LayerNorm([8, 8])
        self.conv16 = nn.Conv2d(4, 4, 1)
        self.ln16 = nn.LayerNorm([4, 8, 8], elementwise_affine=False)
        self.dequant = DeQuantStub()
        self.dequant2 = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.glu(self.prelu1(self.prelu(self.conv(self.quant(x)))))
        b = self.ln(self.sm(a))
        return self.dequant(b), self.dequant2(self.ln16(self.conv16(a)))


def _inputs(seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)),)


def _converted(march: str) -> nn.Module:
    torch.manual_seed(0)
    qc = get_default_qat_qconfig()
    qc16 = get_default_qat_qconfig(dtype="qint16") if march == "bayes" else qc  # Bernoulli2 has no qint16 output
    with march_scope(march):
        qat = prepare_qat_fx(Net(), {"": qc, "module_name": {"conv16": qc16}}, example_inputs=_inputs(0))
        for i in range(3):
            qat(*_inputs(i))
        return convert_fx(qat.eval())


@pytest.fixture(scope="module", params=["bayes", "bernoulli2"])
def converted(request: pytest.FixtureRequest) -> nn.Module:
    return _converted(request.param)


def test_layers_trace_to_integer_ops_that_run_exactly(converted: nn.Module) -> None:
    x = _inputs(5)
    g = trace(converted, x)
    by_scope = {n.scope: n for n in g.nodes if n.scope}
    assert {s: by_scope[s].op.name for s in OPS} == OPS
    assert not [n for n in g.nodes if n.op.name == "call"]
    for s in OPS:
        n = by_scope[s]
        assert isinstance(n.op, IntegerModuleOp)
        assert n.type.quant == n.op.out and n.type.dtype is n.op.out.dtype
    want16 = DType.qint16 if by_scope["conv16"].op.march == "bayes" else DType.qint8
    assert by_scope["ln16"].operands[0].type.dtype is want16
    assert by_scope["prelu"].operands[1].type.shape == (8,)
    assert_runs_and_emits_as(g, converted, _inputs, x)


def test_text_form_round_trips(converted: nn.Module) -> None:
    x = _inputs(1)
    g = trace(converted, x)
    text = print_graph(g)
    assert "qglu(%prelu1, %glu_table" in text and 'eps_terms=(("int16", ' in text
    assert_round_trips(g, converted, x)


def test_verify_names_the_op_and_the_fault() -> None:
    out = QuantSpec((0.1,), DType.qint8)
    i8 = TensorType((2, 4, 8, 8), DType.qint8)
    i16 = TensorType((2, 4, 8, 8), DType.qint16)
    table = TensorType((256,), DType.int16)
    with pytest.raises(IRError, match=r"qsoftmax: .*qint8 codes"):
        QSoftmax(out=out, in_scales=(0.1,)).verify_([i16, table])
    with pytest.raises(IRError, match="qsoftmax: table must hold 256"):
        QSoftmax(out=out, in_scales=(0.1,)).verify_([i8, TensorType((255,), DType.int16)])
    with pytest.raises(IRError, match=r"qglu: dim 1 of .* even size"):
        QGlu(out=out, in_scales=(0.1,), sigmoid=out, dim=1).verify_([TensorType((2, 5, 8), DType.qint8), table])
    vec = TensorType((4,), DType.int32)
    with pytest.raises(IRError, match="qprelu: 4 slopes need an input with 4 channels"):
        QPrelu(out=out, in_scales=(0.1,)).verify_([TensorType((2, 3, 8), DType.qint8), vec, vec])
    with pytest.raises(IRError, match=r"qlayer_norm: input .* does not end in normalized_shape"):
        QLayerNorm(out=out, in_scales=(0.1,), normalized_shape=(4, 4)).verify_([i8, vec, vec, vec])
    with pytest.raises(IRError, match="qlayer_norm: multiplier must hold 64 integers"):
        QLayerNorm(out=out, in_scales=(0.1,), normalized_shape=(8, 8)).verify_([i8, vec, vec, vec])
    with pytest.raises(IRError, match="qlayer_norm: eps_terms names input dtype 'int7'"):
        QLayerNorm(out=out, in_scales=(0.1,), normalized_shape=(8, 8), eps_terms=(("int7", 1, 2),)).eps_term_dict()
    with pytest.raises(IRError, match="qprelu: one per-tensor input and output scale"):
        QPrelu(out=out, in_scales=(0.1, 0.2))
    with pytest.raises(IRError, match="takes integer codes"):
        QPrelu(out=out, in_scales=(0.1,)).verify_([TensorType((2, 4), DType.float32), vec, vec])


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_check_model_reports_what_the_opaque_calls_reported(march: str) -> None:
    conv = _converted(march)
    x = _inputs(2)
    assert_check_model_unchanged(conv, x, march, FAMILY, expect=set(OPS.values()), gone=set(OPS.values()))
