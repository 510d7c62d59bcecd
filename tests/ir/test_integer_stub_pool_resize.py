"""Integer ops for stubs, ReLU / ReLU6 / Identity, table lookups, pools, resize and Div.

A converted model's QuantStub, DeQuantStub, ReLU, ReLU6, UnaryLUT, MaxPool2d, AvgPool2d,
AdaptiveAvgPool2d, Interpolate (nearest, bilinear, run-time size), Div and Identity trace to
integer ops instead of opaque module calls; run_graph and emit compute exactly what the
converted model does with the same state-dict keys; the text form round-trips; the legality
reports equal those of the same model traced with the modules kept opaque.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qir
from qir.frontend import emit, trace
from qir.ir import IRError, parse_graph, print_graph, run_graph, verify
from qir.ir.ops.integer import IntegerModuleOp
from qir.ir.ops.integer_elementwise import QDiv, QLut, QRelu, QRelu6
from qir.ir.ops.integer_pool import QAdaptiveAvgPool2d, QAvgPool2d, QMaxPool2d
from qir.ir.ops.integer_resize import QInterpolate
from qir.ir.ops.integer_stubs import QDequantStub, QQuantStub
from qir.ir.types import DType, QuantSpec, SequenceType, TensorType
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from qir.quantization.fake_quantize import default_weight_8bit_fake_quant
from qir.quantization.qconfig import QConfig
from tests.ir.integer_family import assert_check_model_unchanged, assert_round_trips, assert_runs_and_emits_as, same

OPS = {
    "quant": "qquant_stub",
    "quant2": "qquant_stub",
    "mp": "qmax_pool2d",
    "relu2": "qrelu",
    "relu6": "qrelu6",
    "ap": "qavg_pool2d",
    "sig": "qlut",
    "up": "qinterpolate",
    "_generated_interpolate_0": "qinterpolate",
    "drop": "qidentity",
    "div": "qdiv",
    "idn": "qidentity",
    "gap": "qadaptive_avg_pool2d",
    "dequant": "qdequant_stub",
    "dequant2": "qdequant_stub",
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.quant2 = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.mp = nn.MaxPool2d(2)
        self.relu2 = nn.ReLU()
        self.relu6 = nn.ReLU6()
        self.ap = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.sig = nn.Sigmoid()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.drop = nn.Dropout(0.1)
        self.div = qir.nn.Div()
        self.idn = nn.Identity()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.dequant = DeQuantStub()
        self.dequant2 = DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.quant(x)
        a = self.relu6(self.relu2(self.mp(self.relu(self.conv(x)))))
        c = self.up(self.sig(self.ap(a)))
        d = F.interpolate(c, size=x.shape[2:], mode="bilinear", align_corners=False)
        e = self.div(self.drop(d), self.quant2(y))
        return self.dequant(self.gap(self.idn(e))), self.dequant2(e)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, 8, 8, 8, generator=g) + 0.5


def _converted(march: str, model: nn.Module | None = None, qconfig: object = None) -> nn.Module:
    torch.manual_seed(0)
    with march_scope(march):
        qat = prepare_qat_fx(model or Net(), {"": qconfig or get_default_qat_qconfig()}, example_inputs=_inputs(0))
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
        if s.startswith("dequant"):
            assert n.type == TensorType(n.type.shape, DType.float32)
        else:
            assert n.type.quant == n.op.out and n.type.dtype is n.op.out.dtype
    assert by_scope["_generated_interpolate_0"].op.run_time_size
    assert isinstance(by_scope["_generated_interpolate_0"].operands[1].type, SequenceType)
    assert_runs_and_emits_as(g, converted, _inputs, x)


def test_text_form_round_trips(converted: nn.Module) -> None:
    x = _inputs(1)
    g = trace(converted, x)
    text = print_graph(g)
    assert 'qinterpolate(%up, %getitem, mode="bilinear"' in text and "qlut(%ap, %sig_table" in text
    assert_round_trips(g, converted, x)


def _family() -> list[type]:
    """The integer op classes of this family (traced as opaque calls in the check_model test)."""
    from qir.ir.ops.integer_elementwise import QIdentity
    from qir.ir.ops.integer_pool import QAdaptiveAvgPool2d

    return [
        QQuantStub,
        QDequantStub,
        QRelu,
        QRelu6,
        QLut,
        QDiv,
        QMaxPool2d,
        QAvgPool2d,
        QInterpolate,
        QIdentity,
        QAdaptiveAvgPool2d,
    ]


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_check_model_reports_what_the_opaque_calls_reported(march: str) -> None:
    conv = _converted(march)
    x = _inputs(2)
    assert_check_model_unchanged(
        conv, x, march, _family(), expect={"qlut", "qdiv", "qquant_stub", "qinterpolate"}, gone={"qlut"}
    )


def test_per_channel_dequant_stub_of_a_high_precision_output() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(3, 4, 1)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.conv(self.quant(x)))

    qc = get_default_qat_qconfig()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    with march_scope("bayes"):
        qat = prepare_qat_fx(
            Head(), {"": qc, "module_name": {"conv": QConfig(activation=None, weight=default_weight_8bit_fake_quant)}}
        )
        qat(x)
        conv = convert_fx(qat.eval())
    g = trace(conv, (x,))
    (dq,) = [n for n in g.nodes if isinstance(n.op, QDequantStub)]
    assert dq.op.axis == -3 and len(dq.op.in_scales) == 4
    assert torch.equal(run_graph(g, x), conv(x))
    back = emit(g)
    assert torch.equal(back(x), conv(x)) and sorted(back.state_dict()) == sorted(conv.state_dict())


def test_int16_codes_keep_their_dtype_through_scale_keeping_ops() -> None:
    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.mp = nn.MaxPool2d(2)
            self.relu = nn.ReLU()
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.up(self.relu(self.mp(self.conv(self.quant(x))))))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    with march_scope("bayes"):
        qat = prepare_qat_fx(Body(), {"": get_default_qat_qconfig(dtype="qint16")})
        qat(x)
        conv = convert_fx(qat.eval())
    g = trace(conv, (x,))
    names = [n.op.name for n in g.nodes if n.scope]
    assert names == ["qquant_stub", "qconv", "qmax_pool2d", "qrelu", "qinterpolate", "qdequant_stub"]
    for n in g.nodes:
        if n.op.name in ("qmax_pool2d", "qrelu", "qinterpolate"):
            assert n.op.out.dtype is DType.qint16 and n.type.dtype is DType.qint16
    assert torch.equal(run_graph(g, x), conv(x))
    assert torch.equal(emit(g)(x), conv(x))


def test_verify_names_the_fault() -> None:
    spec = QuantSpec((0.1,))
    i8, f32 = TensorType((1, 4, 4, 4), DType.int8), TensorType((1, 4, 4, 4), DType.float32)
    with pytest.raises(IRError, match="keeps its input's dtype"):
        QRelu(out=QuantSpec((0.1,), DType.qint16)).verify([i8])
    with pytest.raises(IRError, match="quantize the input first"):
        QRelu(out=spec).verify([f32])
    with pytest.raises(IRError, match="takes a float tensor"):
        QQuantStub(out=spec).verify([i8])
    with pytest.raises(IRError, match="per-tensor qint8 / qint16"):
        QQuantStub(out=QuantSpec((0.1,), DType.qint32))
    with pytest.raises(IRError, match="do not fit"):
        QDequantStub(in_scales=(0.1, 0.2), axis=-3).verify([i8])
    with pytest.raises(IRError, match="need a channel axis"):
        QDequantStub(in_scales=(0.1, 0.2))
    lut = QLut(function="Sigmoid", out=spec, in_scales=(0.1,))
    t8, t16, none = TensorType((256,), DType.int8), TensorType((513,), DType.int32), TensorType((0,), DType.int32)
    with pytest.raises(IRError, match="256 integer entries"):
        lut.verify([i8, TensorType((255,), DType.int8), t16])
    with pytest.raises(IRError, match="a version-1 table16 holds 513 knot values"):
        lut.verify([i8, t8, TensorType((512,), DType.int32)])
    with pytest.raises(IRError, match=r"a version-2 table16 is \(2, n\)"):
        attrs.evolve(lut, table16_version=2).verify([i8, t8, t16])
    for dt in (DType.float32, DType.bool):
        with pytest.raises(IRError, match="table16 holds integers"):
            lut.verify([i8, t8, TensorType((513,), dt)])
    attrs.evolve(lut, table16_version=2).verify([TensorType((1, 4), DType.int16), t8, TensorType((2, 7), DType.int32)])
    with pytest.raises(IRError, match="table16_version must be one of 1, 2"):
        QLut(function="Sigmoid", out=spec, in_scales=(0.1,), table16_version=3)
    with pytest.raises(IRError, match=r"qlut \(Sigmoid\): qint16 input needs the segmented table16"):
        lut.verify([TensorType((1, 4), DType.int16), t8, none])
    with pytest.raises(IRError, match="read qint8 or qint16 codes"):
        lut.verify([TensorType((1, 4), DType.int32), t8, t16])
    with pytest.raises(IRError, match="out dtype qint32"):
        QLut(function="Sigmoid", out=QuantSpec((0.1,), DType.qint32), in_scales=(0.1,))
    lut.verify([i8, t8, none])  # no segmented table: qint8 input only
    lut.verify([TensorType((1, 4), DType.int16), t8, t16])
    with pytest.raises(IRError, match="takes 2 operands"):
        QDiv(out=spec, in_scales=(0.1, 0.2), multiplier=3, shift=2).verify([i8])
    with pytest.raises(IRError, match="mode must be"):
        QInterpolate(mode="bicubic", out=spec, in_scales=(0.1,))
    with pytest.raises(IRError, match="nearest copies codes"):
        QInterpolate(mode="nearest", out=spec, in_scales=(0.2,))
    with pytest.raises(IRError, match="run-time size is a sequence"):
        QInterpolate(mode="nearest", out=spec, in_scales=(0.1,), run_time_size=True).verify([i8, i8])
    with pytest.raises(IRError, match="one per-tensor input"):
        QAvgPool2d(out=spec, in_scales=(0.1, 0.2))


def test_verify_refuses_what_would_fail_at_run_time() -> None:
    """Edits of the text that the modules would reject when run are refused by verify."""
    spec = QuantSpec((0.1,))
    i8 = TensorType((1, 4, 6, 6), DType.int8)
    with pytest.raises(IRError, match="positive and finite float32"):
        QRelu(out=QuantSpec((1e-320,))).verify([i8])  # zero as a float32 buffer
    with pytest.raises(IRError, match="exceeds half the window"):
        QMaxPool2d(out=spec, kernel_size=3, stride=1, padding=(1, 2)).verify([i8])
    pool = QAvgPool2d(out=spec, in_scales=(0.1,), kernel_size=(4, 3), stride=(1, 1), padding=(1, 1))
    with pytest.raises(IRError, match="12 integer entries"):
        pool.verify([i8, TensorType((9,), DType.int64), TensorType((9,), DType.int64)])
    with pytest.raises(IRError, match="do not broadcast"):
        QDiv(out=spec, in_scales=(0.1, 0.2), multiplier=3, shift=2).verify([i8, TensorType((8, 3, 3, 3), DType.int8)])
    with pytest.raises(IRError, match="shift must be an integer"):
        QDiv(out=spec, in_scales=(0.1, 0.2), multiplier=3, shift=(2,))  # type: ignore[arg-type]
    with pytest.raises(IRError, match="march must be one of"):
        QAdaptiveAvgPool2d(out=spec, in_scales=(0.1,), march="torch.load")
    with pytest.raises(IRError, match="exactly one of size / scale_factor"):
        QInterpolate(mode="nearest", out=spec, in_scales=(0.1,)).verify([i8])
    with pytest.raises(IRError, match="over 268435456 elements"):
        QInterpolate(mode="nearest", out=spec, in_scales=(0.1,), scale_factor=1e5).verify([i8])
    with pytest.raises(IRError, match="declared type"):  # the shape a scale-keeping layer gives is checked
        text = """graph @g(%x: tensor<1x4x6x6xi8>) {
  %r: tensor<1x4x3x3xqi8,scale=[0.5]> = qrelu(%x, out=QuantSpec(scale=(0.5,)))
  return %r
}"""
        verify(parse_graph(text))


def test_compiled_program_equals_the_converted_model(converted: nn.Module) -> None:
    compiled = compile_model(converted, list(_inputs(0)), opt=0, check=False)  # the march the modules hold
    ops = [inst.op for inst in compiled.program.instructions]
    for kernel in ("quantize", "dequantize", "clamp", "lut", "div", "maxpool2d", "avgpool2d"):
        assert kernel in ops
    assert {"adaptive_avgpool2d", "resize_nearest", "resize_bilinear"} <= set(ops)
    for seed in range(3):
        x = _inputs(seed)
        assert same(compiled(*x), converted(*x))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_each_march_lowers_these_ops_with_op_rules(march: str) -> None:
    from backends.common.lower import get_kernel_policy, module_rule, op_rule
    from backends.common.rules_layers import OP_RULES
    from qir.nn import quantized as Q

    get_kernel_policy(march)  # loads the march's backend: backends/<march>/rules.py registers its families
    for name in OP_RULES:
        assert op_rule(march, name) is OP_RULES[name]
    for cls in (Q.QuantStub, Q.DeQuantStub, Q.ReLU, Q.UnaryLUT, Q.AvgPool2d, Q.Interpolate, Q.Div, Q.Identity):
        assert module_rule(march, cls()) is None  # no module-keyed rule left for these layers
