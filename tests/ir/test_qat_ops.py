"""QAT layer ops: a prepared model's conv / linear layers and stubs are typed ops in the IR.

The front end builds ``qat_conv`` / ``qat_quant_stub`` / ``qat_dequant_stub`` from the QAT
modules (fake quants as ``FakeQuantSpec`` attributes, their state as constants keyed by
state-dict name), the text form round-trips them, the interpreter computes what the prepared
model computes (observer updates included), and emit rebuilds a trainable model with the same
state-dict keys.
"""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
from torch import nn

import qir
from qir.frontend import emit, trace
from qir.ir import IRError, parse_graph, print_graph, run_graph
from qir.ir.ops.core import Call
from qir.ir.ops.qat import FakeQuantSpec, QATConv, QATDequantStub, QATQuantStub
from qir.ir.ops.quant import ObserverSpec
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.integer_grid import bind_integer_grid, set_integer_grid


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.fc = nn.Linear(8, 5)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        y = self.relu(self.bn(self.conv(x)))
        z = self.up(self.conv2(y)) + y  # the add fuses into the transposed conv
        return self.dequant(self.fc(z.permute(0, 2, 3, 1)))


def _prepared(march: str = "bayes") -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    qir.set_march(march)
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()}, example_inputs=(x,))
    for _ in range(2):
        qat(torch.randn(2, 3, 8, 8))
    return qat, x


def test_prepared_layers_are_typed_qat_ops() -> None:
    qat, x = _prepared()
    g = trace(qat, (x,))
    assert not [n for n in g.nodes if isinstance(n.op, Call) and n.op.kind == "module"]
    convs = [n for n in g.nodes if isinstance(n.op, QATConv)]
    assert [(n.op.kind, n.op.add, n.op.act) for n in convs] == [
        ("conv2d", False, "relu"),
        ("conv2d", False, None),
        ("conv_transpose2d", True, None),
        ("linear", False, None),
    ]
    stubs = [type(n.op) for n in g.nodes if isinstance(n.op, (QATQuantStub, QATDequantStub))]
    assert stubs == [QATQuantStub, QATDequantStub]
    conv = convs[0]
    assert conv.op.weight_fq.observer.axis == 0 and conv.op.out_fq is not None
    assert conv.op.out_fq.observer.observer == "moving_average_minmax"
    keys = [v.op.key for v in conv.operands[1:]]  # type: ignore[attr-defined]
    assert keys[:3] == ["conv.weight", "conv.bias", "conv.weight_fake_quant.scale"]
    assert "conv.activation_post_process.observer.max_val" in keys


def test_text_form_round_trips_qat_ops() -> None:
    qat, x = _prepared()
    g = trace(qat, (x,))
    text = print_graph(g)
    assert "qat_conv(" in text and "FakeQuantSpec(" in text and "qat_quant_stub(" in text
    g2 = parse_graph(text, constants=g.constants, objects=g.objects)
    assert print_graph(g2) == text


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_run_graph_is_the_prepared_model_with_observer_updates(march: str) -> None:
    qat, x = _prepared(march)
    set_integer_grid(qat, False)  # an op rebuilds its module unbound: float fake quantization
    other = copy.deepcopy(qat)
    g = trace(other, (x,))
    for _ in range(2):  # training: both observe, and the next step sees the updated scales
        batch = torch.randn(2, 3, 8, 8) * 3
        assert torch.equal(run_graph(g, batch), qat(batch))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in qat.state_dict().items())
    qat.eval()
    g.training = False
    assert torch.equal(run_graph(g, x), qat(x))


def test_emit_rebuilds_a_trainable_model_with_the_same_state() -> None:
    qat, x = _prepared()
    g = trace(qat, (x,))
    back = emit(g)
    assert list(back.state_dict()) == list(qat.state_dict())
    assert type(back.conv) is type(qat.conv) and type(back.quant) is type(qat.quant)
    assert back.conv.weight_fake_quant.observer.averaging_constant == 1.0
    bind_integer_grid(back, "bayes")  # the binding prepare_qat_fx makes, on the emitted model
    ref = copy.deepcopy(qat)
    assert torch.equal(back(x), ref(x))  # the integer grid, observer updates and all
    back(x).sum().backward()
    assert back.conv.weight.grad is not None and back.fc.bias.grad is not None
    set_fake_quantize(back, "validation")
    assert back.conv.activation_post_process.observer_enabled is False


def test_check_model_reads_qat_ops_as_float_layers() -> None:
    qat, x = _prepared("bernoulli2")
    report = check_model(qat, x, march="bernoulli2")
    assert {(v.module, v.spelling) for v in report.violations} == {("fc", "torch.nn.Linear")}


def test_a_fake_quant_without_a_data_form_keeps_the_module_opaque() -> None:
    from qir.quantization.lsq import LSQFakeQuantize
    from qir.quantization.qconfig import QConfig

    qc = get_default_qat_qconfig()
    lsq = QConfig(activation=LSQFakeQuantize.with_args(dtype="qint8"), weight=qc.weight)
    torch.manual_seed(0)
    qir.set_march("bayes")
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(Net(), {"": qc, "module_name": {"conv2": lsq}}, example_inputs=(x,))
    qat(x)
    set_integer_grid(qat, False)
    g = trace(qat, (x,))
    (opaque,) = [n for n in g.nodes if isinstance(n.op, Call) and n.op.kind == "module"]
    assert opaque.op.target == "conv2" and "LSQFakeQuantize" in opaque.meta["frontend_note"]
    assert len([n for n in g.nodes if isinstance(n.op, QATConv)]) == 3
    ref = copy.deepcopy(qat)  # before the emitted model observes: it shares the state tensors
    assert torch.equal(emit(g)(x), ref(x))


def _op(**kw: object) -> QATConv:
    spec = FakeQuantSpec(ObserverSpec("moving_average_per_channel_minmax", axis=0))
    fields = {
        "kind": "conv2d",
        "in_channels": 3,
        "out_channels": 8,
        "weight_fq": spec,
        "out_fq": FakeQuantSpec(ObserverSpec()),
        "kernel_size": (3, 3),
        "stride": (1, 1),
        "padding": (1, 1),
        "dilation": (1, 1),
    }
    fields.update(kw)
    return QATConv(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "conv4d"}, "kind must be one of"),
        ({"act": "gelu"}, "act must be one of"),
        ({"stride": (1,)}, "stride must be 2 positive integers"),
        ({"groups": 0}, "groups must be >= 1"),
        ({"out_fq": None, "add": True}, "a fused add needs an output fake quant"),
        ({"out_fq": FakeQuantSpec(ObserverSpec(axis=1))}, "output fake quant must be per tensor"),
        ({"weight_fq": FakeQuantSpec(ObserverSpec(axis=2))}, "channel axis must be 0"),
    ],
)
def test_qat_conv_refuses_bad_fields(fields: dict[str, object], message: str) -> None:
    with pytest.raises(IRError, match=message):
        _op(**fields)


def test_verify_names_the_bad_operand() -> None:
    qat, x = _prepared()
    g = trace(qat, (x,))
    (conv,) = [n for n in g.nodes if isinstance(n.op, QATConv) and n.scope == "conv"]
    with pytest.raises(IRError, match="weight must be a float tensor of shape"):
        attrs.evolve(conv.op, out_channels=4).verify([v.type for v in conv.operands])
    with pytest.raises(IRError, match="takes 15 operands"):
        conv.op.verify([v.type for v in conv.operands[:-1]])
    with pytest.raises(IRError, match="fake quant state must be one of"):
        FakeQuantSpec(ObserverSpec(), state="frozen")
