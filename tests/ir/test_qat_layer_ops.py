"""QAT pools, activations, table lookups and resizes are typed ops in a prepared model's IR.

``qat_max_pool2d`` / ``qat_avg_pool2d`` / ``qat_adaptive_avg_pool2d``, ``qat_relu`` / ``qat_relu6``
/ ``qat_identity`` / ``qat_dropout``, ``qat_lut`` (a table lookup's function by name and literal
arguments) and ``qat_interpolate`` keep the QAT contract (tests/ir/qat_family.py), and the
verifier names a bad field.
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
from qir.ir.ops.qat_activation import QATDropout, QATLut
from qir.ir.ops.qat_pool import QATAdaptiveAvgPool2d, QATAvgPool2d, QATMaxPool2d
from qir.ir.ops.qat_resize import QATInterpolate
from qir.ir.ops.quant import ObserverSpec
from qir.ir.types import DType, TensorType
from qir.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat_fx
from tests.ir.qat_family import assert_qat_contract


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool, self.avg, self.gap = nn.MaxPool2d(2), nn.AvgPool2d(3, 1, 1), nn.AdaptiveAvgPool2d((None, 1))
        self.sig, self.lrelu, self.exp = nn.Sigmoid(), nn.LeakyReLU(0.2), qnn.Exp()
        self.up = qnn.Interpolate(scale_factor=2, mode="bilinear", align_corners=False)
        self.near = qnn.Interpolate(scale_factor=2, mode="nearest")
        self.relu, self.relu6, self.drop, self.id = nn.ReLU(), nn.ReLU6(), nn.Dropout(0.0), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv(self.quant(x)) + 0.0)
        z = self.sig(self.pool(y)) + self.lrelu(self.avg(y[:, :, ::2, ::2]))
        z = self.up(z) + self.near(self.relu6(z))
        z = self.exp(self.drop(self.id(z)))
        return self.dequant(z + self.gap(z))


def _prepared(march: str) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    qir.set_march(march)
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(Layers(), {"": get_default_qat_qconfig()}, example_inputs=(x,))
    for _ in range(2):
        qat(torch.randn(2, 3, 8, 8))
    return qat, x


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_layers_are_typed_qat_ops_keeping_the_contract(march: str) -> None:
    qat, x = _prepared(march)
    g = assert_qat_contract(qat, x, lambda: torch.randn(2, 3, 8, 8) * 3)
    names = [n.op.name for n in g.nodes if n.op.name.startswith("qat_") and n.op.name != "qat_functional"]
    assert names == [
        "qat_quant_stub", "qat_conv", "qat_relu", "qat_max_pool2d", "qat_lut", "qat_avg_pool2d", "qat_lut",
        "qat_interpolate", "qat_relu6", "qat_interpolate", "qat_identity", "qat_dropout", "qat_lut",
        "qat_adaptive_avg_pool2d", "qat_dequant_stub",
    ]  # fmt: skip
    luts = [n.op for n in g.nodes if isinstance(n.op, QATLut)]
    assert [(op.function, op.function_args) for op in luts] == [
        ("Sigmoid", ()),
        ("LeakyReLU", (("inplace", False), ("negative_slope", 0.2))),
        ("Exp", ()),
    ]
    up, near = [n.op for n in g.nodes if isinstance(n.op, QATInterpolate)]
    assert up.out_fq is not None and near.out_fq is None
    (gap,) = [n for n in g.nodes if isinstance(n.op, QATAdaptiveAvgPool2d)]
    assert gap.op.output_size == (None, 1) and gap.operands[1].op.key == "gap.activation_post_process.scale"  # type: ignore[attr-defined]


def test_a_run_time_resize_size_is_an_operand() -> None:
    class Lateral(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.up = qnn.Interpolate(mode="bilinear", align_corners=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.quant(x)
            return self.dequant(self.up(x[:, :, ::2, ::2], size=x.shape[2:]) + x)

    qir.set_march("bayes")
    x = torch.randn(2, 3, 8, 8)
    qat = prepare_qat_fx(Lateral(), {"": get_default_qat_qconfig()}, example_inputs=(x,))
    qat(x)
    g = trace(qat, (x,))
    (up,) = [n for n in g.nodes if isinstance(n.op, QATInterpolate)]
    assert up.op.run_time_size and up.op.num_inputs() == 2
    assert_qat_contract(qat, x, lambda: torch.randn(2, 3, 8, 8))


_FQ = FakeQuantSpec(ObserverSpec())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: QATMaxPool2d(kernel_size=0), "kernel_size, stride and dilation must be >= 1"),
        (lambda: QATMaxPool2d(kernel_size=2, padding=3), "padding .* exceeds half the window"),
        (lambda: QATAvgPool2d(out_fq=_FQ, kernel_size=2, divisor_override=0), "divisor_override must be None or"),
        (lambda: QATAvgPool2d(out_fq=FakeQuantSpec(ObserverSpec(axis=1))), "must be per tensor"),
        (lambda: QATAdaptiveAvgPool2d(out_fq=_FQ, output_size=(1, 2, 3)), "output_size must be an int or a pair"),
        (lambda: QATDropout(p=1.5), r"p must be a probability in \[0, 1\]"),
        (lambda: QATDropout(kind="AlphaDropout"), "kind must be one of"),
        (lambda: QATLut(out_fq=_FQ, function="os.system"), "function must name a function module"),
        (lambda: QATLut(out_fq=_FQ, function="ELU", function_args=(("b", 1), ("a", 2))), "sorted by unique name"),
        (lambda: QATLut(out_fq=_FQ, function="ELU", function_args=(("alpha", [1]),)), "must be a bool, int"),
        (lambda: QATInterpolate(out_fq=None, mode="bicubic", scale_factor=2), "mode must be one of"),
        (lambda: QATInterpolate(out_fq=None, mode="bilinear", scale_factor=2), "bilinear has an output fake quant"),
        (
            lambda: QATInterpolate(out_fq=None, mode="nearest").verify([TensorType((1, 1, 2, 2), DType.float32)]),
            "give exactly one of size / scale_factor",
        ),
    ],
)
def test_bad_fields_are_refused_naming_them(make: object, message: str) -> None:
    with pytest.raises(IRError, match=message):
        make()  # type: ignore[operator]


def test_the_lut_builder_rebuilds_only_known_functions() -> None:
    from qir.ir.ops.qat import _builder

    build = _builder("qat_lut")
    with pytest.raises(ValueError, match="unknown function 'Eval'"):
        build(QATLut(out_fq=_FQ, function="Eval"), {})
    with pytest.raises(ValueError, match="ELU has no attribute 'beta'"):
        build(QATLut(out_fq=_FQ, function="ELU", function_args=(("beta", 1.0),)), {})


def test_verify_names_the_bad_operand() -> None:
    qat, x = _prepared("bayes")
    g = trace(qat, (x,))
    (avg,) = [n for n in g.nodes if isinstance(n.op, QATAvgPool2d)]
    types = [v.type for v in avg.operands]
    with pytest.raises(IRError, match="takes 7 operands"):
        avg.op.verify(types[:-1])
    with pytest.raises(IRError, match="rejects its input"):
        QATAvgPool2d(out_fq=avg.op.out_fq, kernel_size=9).verify(types)
