"""Integer layer ops: a converted model's conv / linear layers are ``qconv`` ops in the IR.

The front end builds them from the integer modules, the text form round-trips them, the
interpreter and emit rebuild modules that compute exactly what the converted model does
(same state-dict keys), and the legality checks read them as the float op their rows describe.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.ao.quantization import DeQuantStub, QuantStub

import qir
from qir.frontend import emit, trace
from qir.ir import IRError, parse_graph, print_graph, run_graph
from qir.ir.ops.integer import QConv
from qir.ir.types import DType, QuantSpec, TensorType
from qir.quantization import check_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.fake_quantize import default_weight_8bit_fake_quant
from qir.quantization.qconfig import QConfig


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.fc = nn.Linear(8, 5)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y = self.relu(self.conv(x))
        z = self.up(self.conv2(y)) + y  # the add fuses into the transposed conv
        return self.dequant(self.fc(z.permute(0, 2, 3, 1)))


def _converted(march: str, model: nn.Module | None = None, qconfig: object = None) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    qir.set_march(march)
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(model or Net(), {"": qconfig or get_default_qat_qconfig()}, example_inputs=(x,))
    for _ in range(3):
        qat(torch.randn(2, 3, 8, 8))
    return convert_fx(qat), x


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_converted_layers_are_qconv_ops_that_run_exactly(march: str) -> None:
    conv, x = _converted(march)
    g = trace(conv, (x,))
    qconvs = [n for n in g.nodes if isinstance(n.op, QConv)]
    kinds = [(n.op.kind, n.op.add, n.op.act) for n in qconvs]
    assert kinds == [
        ("conv2d", False, "relu"),
        ("conv2d", False, None),
        ("conv_transpose2d", True, None),
        ("linear", False, None),
    ]
    for n in qconvs:
        assert isinstance(n.type, TensorType) and n.type.quant == n.op.out and n.type.dtype is n.op.out.dtype
        assert n.op.march == march
    want = conv(x)
    assert torch.equal(run_graph(g, x), want)
    back = emit(g)
    assert torch.equal(back(x), want)
    assert sorted(back.state_dict()) == sorted(conv.state_dict())


def test_text_form_round_trips_qconv() -> None:
    conv, x = _converted("bayes")
    g = trace(conv, (x,))
    text = print_graph(g)
    assert "qconv(" in text and 'kind="conv_transpose2d"' in text
    g2 = parse_graph(text, constants=g.constants, objects=g.objects)
    assert print_graph(g2) == text
    assert torch.equal(run_graph(g2, x), conv(x))


def test_high_precision_linear_output_is_a_per_channel_qint32_spec() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.fc = nn.Linear(12, 4)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.fc(self.quant(x.flatten(1))))

    qc = get_default_qat_qconfig()
    head_qc = QConfig(activation=None, weight=default_weight_8bit_fake_quant)
    torch.manual_seed(0)
    qir.set_march("bayes")
    x = torch.randn(3, 3, 2, 2)
    qat = prepare_qat_fx(Head(), {"": qc, "module_name": {"fc": head_qc}}, example_inputs=(x,))
    qat(x)
    conv = convert_fx(qat)
    g = trace(conv, (x,))
    (fc,) = [n for n in g.nodes if isinstance(n.op, QConv)]
    assert fc.op.out.dtype is DType.qint32 and fc.op.out.axis == -1 and len(fc.op.out.scale) == 4
    assert torch.equal(run_graph(g, x), conv(x))
    assert torch.equal(emit(g)(x), conv(x))


def test_verify_refuses_float_input_and_missing_state() -> None:
    op = QConv(
        kind="conv2d",
        out=QuantSpec((0.1,)),
        in_scales=(0.05,),
        march="bayes",
        stride=(1, 1),
        padding=(0, 0),
        dilation=(1, 1),
    )
    w = TensorType((4, 3, 1, 1), DType.int8)
    state = [w, TensorType((4,), DType.int32), *[TensorType((4,), DType.int64)] * 3]
    op.verify([TensorType((1, 3, 4, 4), DType.int8), *state])
    with pytest.raises(IRError, match="integer codes"):
        op.verify([TensorType((1, 3, 4, 4), DType.float32), *state])
    with pytest.raises(IRError, match="takes 6 operands"):
        op.verify([TensorType((1, 3, 4, 4), DType.int8), *state[:-1]])
    with pytest.raises(IRError, match="kind must be"):
        QConv(kind="conv9d", out=QuantSpec((0.1,)), in_scales=(0.05,), march="bayes")
    with pytest.raises(IRError, match="input scale"):
        QConv(kind="conv2d", out=QuantSpec((0.1,)), in_scales=(0.05,), march="bayes", add=True)


def test_legality_reads_qconv_as_the_float_layer() -> None:
    conv, x = _converted("bayes")
    report = check_model(conv, (x,))
    assert report.ok
    assert {v.node for v in report.unknown} == {"permute"}  # every qconv found its nn.Conv2d / nn.Linear row
    conv, x = _converted("bernoulli2")
    report = check_model(conv, (x,))
    found = [(v.node, v.message) for v in report.violations]
    assert found == [("fc", "torch.nn.Linear is not supported on bernoulli2")]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"stride": None}, "stride must be 2 integers"),
        ({"stride": (1,)}, "stride must be 2 integers"),
        ({"dilation": (65536, 1)}, "dilation must be 2 integers"),
        ({"padding": (-1, 0)}, "padding must be"),
        ({"padding": "full"}, "padding must be"),
        ({"groups": 0}, "groups must be"),
        ({"padding_mode": "mirror"}, "unknown padding_mode"),
    ],
)
def test_conv_fields_torch_would_refuse_are_refused_at_construction(fields: dict, match: str) -> None:
    base = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1)}
    with pytest.raises(IRError, match=match):
        QConv(kind="conv2d", out=QuantSpec((0.1,)), in_scales=(0.05,), march="bayes", **{**base, **fields})
    with pytest.raises(IRError, match="padding must be"):  # torch's transposed conv takes no string padding
        QConv(
            kind="conv_transpose2d",
            out=QuantSpec((0.1,)),
            in_scales=(0.05,),
            march="bayes",
            **{**base, "padding": "same"},
        )


def test_verify_checks_each_qconv_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verifier checks a node (verify_op), then types it: QConv.infer_type's own verify_ (for callers
    that type it unchecked, such as Graph.create_node) does not run a second time there."""
    from qir.ir import verify

    conv, x = _converted("bayes")
    g = trace(conv, (x,))
    calls: list[QConv] = []
    real = QConv.verify_

    def counted(self: QConv, operand_types: list) -> None:
        calls.append(self)
        real(self, operand_types)

    monkeypatch.setattr(QConv, "verify_", counted)
    verify(g)
    qconvs = [n.op for n in g.nodes if isinstance(n.op, QConv)]
    assert len(qconvs) == 4 and calls == qconvs
    calls.clear()
    n = qconvs[0]
    types = [v.type for v in next(nd for nd in g.nodes if nd.op is n).operands]
    assert n.infer_type(types) == n.infer_verified_type(types) and len(calls) == 1  # infer_type still checks
    with pytest.raises(IRError, match="integer codes"):
        n.infer_type([TensorType(types[0].shape, DType.float32), *types[1:]])


@pytest.mark.parametrize("bad", [0.0, -0.1, 1e-46, 3.5e38, float("inf"), float("nan")])
def test_verify_refuses_a_scale_float32_cannot_hold(bad: float) -> None:
    w = TensorType((4, 3, 1, 1), DType.int8)
    state = [w, TensorType((4,), DType.int32), *[TensorType((4,), DType.int64)] * 3]
    x = TensorType((1, 3, 4, 4), DType.int8)
    conv = {"kind": "conv2d", "march": "bayes", "stride": (1, 1), "padding": (0, 0), "dilation": (1, 1)}
    QConv(out=QuantSpec((0.1,)), in_scales=(1e-45,), **conv).verify([x, *state])  # float32's least: kept
    cases = [(QuantSpec((0.1,)), (bad,))]
    if 0.0 < bad < float("inf"):  # QuantSpec itself refuses the others
        cases.append((QuantSpec((bad,)), (0.05,)))
    for out, ins in cases:
        with pytest.raises(IRError, match=r"scales must be positive and finite float32 values, got"):
            QConv(out=out, in_scales=ins, **conv).verify([x, *state])
