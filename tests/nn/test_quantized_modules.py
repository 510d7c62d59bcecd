"""Quantized modules: integer output vs the QAT fake-quant output, tracing, buffers, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nn_cases import ALL_CASES, Case
from nn_helpers import QC8, QC16, RoundTrip, codes
from torch import nn

import qir.nn as qnn
from backends.common import numerics
from qir.ir.types import DType
from qir.nn import QUANTIZED_MODULE_MAP, qat, quantized
from qir.nn.intrinsic import ConvAdd2d, ConvReLU62d
from qir.quantization import DeQuantStub, QuantStub, disable_observer, get_default_qat_out_qconfig

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


def _trip(case: Case, seed: int = 0, **kw: object) -> RoundTrip:
    torch.manual_seed(seed)
    return RoundTrip(case.make(), case.shapes, case.scales, seed=seed, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_integer_output_matches_qat(case: Case) -> None:
    for seed in (0, 1):
        rt = _trip(case, seed)
        assert not rt.q_out.is_floating_point()
        assert rt.max_lsb() <= (0 if case.exact else 1), f"{case.name}: {rt.max_lsb()} LSB off"


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_trace_and_buffers(case: Case) -> None:
    rt = _trip(case)
    traced = torch.jit.trace(rt.quant, tuple(rt.q_in))
    assert torch.equal(traced(*rt.q_in), rt.q_out)
    q = rt.quant
    assert q.scale.dtype == torch.float32
    assert [float(s) for s in q.input_scales] == pytest.approx(list(case.scales))
    buffers = dict(q.named_buffers())
    assert "scale" in buffers and "input_scale_0" in buffers
    if rt.fq is not None:
        assert q.dtype is rt.fq.dtype
        assert rt.q_out.dtype == rt.fq.dtype.to_torch()
        assert torch.equal(q.scale, rt.fq.scale)
    else:  # scale preserving: output keeps the input's scale and dtype
        assert float(q.scale) == pytest.approx(case.scales[0])
        assert rt.q_out.dtype == rt.q_in[0].dtype


_INT16_CASES = [
    "ReLU",
    "MaxPool2d",
    "Interpolate-nearest",
    "AvgPool2d",
    "AdaptiveAvgPool2d",
    "Conv2d",
    "ConvAddReLU2d",
    "Linear",
    "Interpolate-bilinear",
    "Interpolate-align",
]


@pytest.mark.parametrize("name", _INT16_CASES)
def test_int16_inputs(name: str) -> None:
    case = next(c for c in ALL_CASES if c.name == name)
    rt = _trip(case, qconfig=QC16, in_dtype="qint16")
    assert rt.q_out.dtype in (torch.int16,)
    assert rt.max_lsb() <= (0 if case.exact else 1)


def test_high_precision_conv_and_dequant() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3)
    rt = RoundTrip(conv, [(2, 3, 6, 6)], [0.02], qconfig=get_default_qat_out_qconfig())
    q = rt.quant
    assert q.dtype is DType.qint32 and rt.q_out.dtype == torch.int32
    assert q.scale.shape == (5, 1, 1)
    deq = quantized.DeQuantStub.from_qat(qat.DeQuantStub.from_float(DeQuantStub()), [q.scale], "bayes")
    out = deq(rt.q_out)
    assert out.dtype == torch.float32
    assert torch.allclose(out, rt.qat_out, atol=1e-4, rtol=1e-5)
    # a linear's per-channel scale broadcasts along the last axis
    lin = RoundTrip(nn.Linear(6, 4), [(3, 6)], [0.02], qconfig=get_default_qat_out_qconfig())
    assert lin.quant.scale.shape == (4,)
    deq = quantized.DeQuantStub.from_qat(qat.DeQuantStub(), [lin.quant.scale], "bayes")
    assert torch.allclose(deq(lin.q_out), lin.qat_out, atol=1e-4, rtol=1e-5)


def test_relu6_bound_is_round_6_over_scale() -> None:
    torch.manual_seed(0)
    rt = RoundTrip(ConvReLU62d(nn.Conv2d(3, 4, 1)), [(1, 3, 4, 4)], [0.1])
    s = float(rt.quant.scale)
    assert int(rt.quant.relu6_bound[0]) == int(numerics.quantize(torch.tensor([6.0]), s, "qint8")[0])
    assert int(rt.q_out.max()) <= int(rt.quant.relu6_bound[0])


def test_quant_stub_scale_buffer_and_dequant() -> None:
    q_stub = qat.QuantStub.from_float(QuantStub(scale=1 / 128), QC8)
    q = quantized.QuantStub.from_qat(q_stub, [], "bayes")
    x = torch.tensor([0.5, 1.0, -1.0, 2.0, 0.00390625])  # 1/256: a half-up tie
    assert torch.equal(q(x), torch.tensor([64, 127, -128, 127, 1], dtype=torch.int8))
    assert torch.equal(q(x), numerics.quantize(q_stub(x), 1 / 128, "qint8"))
    q.scale.fill_(1.0)  # what the YUV deployment recipe does
    assert torch.equal(q(torch.tensor([3.0, -7.4])), torch.tensor([3, -7], dtype=torch.int8))
    traced = torch.jit.trace(q, (x,))
    q.scale.fill_(0.5)
    assert torch.equal(traced(torch.tensor([3.0])), torch.tensor([6], dtype=torch.int8))


def test_lut_takes_qint8_and_qint16_codes_only() -> None:
    rt = RoundTrip(qnn.Exp(), [(4,)], [0.02])
    assert rt.quant(torch.zeros(4, dtype=torch.int16)).dtype == rt.quant(torch.zeros(4, dtype=torch.int8)).dtype
    with pytest.raises(TypeError, match=r"Exp: table lookup takes qint8 or qint16 codes, got torch\.int32"):
        rt.quant(torch.zeros(4, dtype=torch.int32))


def test_fused_add_high_precision_is_not_implemented() -> None:
    m = qat.ConvAdd2d.from_float(ConvAdd2d(nn.Conv2d(2, 2, 1)), get_default_qat_out_qconfig())
    m(torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3))
    with pytest.raises(NotImplementedError, match="high-precision"):
        quantized.ConvAdd2d.from_qat(m, [torch.tensor([0.1]), torch.tensor([0.1])], "bayes")


def test_bernoulli2_rejects_int16_outputs() -> None:
    m = qat.Conv2d.from_float(nn.Conv2d(2, 2, 1), QC16)
    m(torch.randn(1, 2, 3, 3))
    with pytest.raises(ValueError, match="bernoulli2"):
        quantized.Conv2d.from_qat(m, [torch.tensor([0.1])], "bernoulli2")


@pytest.mark.parametrize("name", ["Conv2d", "ConvAddReLU2d", "LinearReLU", "AvgPool2d", "Interpolate-bilinear"])
def test_bernoulli2_int8_within_bound(name: str) -> None:
    case = next(c for c in ALL_CASES if c.name == name)
    # 8-bit multipliers still keep one requantization within 1 LSB; the fused add aligns with 31 bits
    assert _trip(case, march="bernoulli2").max_lsb() <= 1


def test_input_scale_count_and_per_channel_inputs_are_checked() -> None:
    m = qat.Conv2d.from_float(nn.Conv2d(2, 2, 1), QC8)
    m(torch.randn(1, 2, 3, 3))
    with pytest.raises(ValueError, match="expected 1 input scale"):
        quantized.Conv2d.from_qat(m, [torch.tensor([0.1])] * 2, "bayes")
    with pytest.raises(ValueError, match="per-channel"):
        quantized.Conv2d.from_qat(m, [torch.tensor([0.1, 0.2])], "bayes")
    with pytest.raises(TypeError, match="from_qat takes a QAT"):
        quantized.Linear.from_qat(m, [torch.tensor([0.1])], "bayes")


def test_weight_scale_follows_current_weight_without_touching_qat() -> None:
    m = qat.Conv2d.from_float(nn.Conv2d(2, 3, 1), QC8)
    x = torch.randn(1, 2, 3, 3)
    m(x)
    with torch.no_grad():
        m.weight.mul_(2.0)  # an optimizer step after the last forward
    before = m.weight_fake_quant.scale.clone()
    q = quantized.Conv2d.from_qat(m, [torch.tensor([0.05])], "bayes")
    assert torch.equal(m.weight_fake_quant.scale, before)  # the QAT module is not touched
    # the integer weight is what the next QAT forward would use: the doubled weight, fake-quantized
    m(x)
    w_fq = m.weight_fake_quant(m.weight).detach()
    assert torch.equal(numerics.dequantize(q.weight, m.weight_fake_quant.scale, axis=0), w_fq)


def test_div() -> None:
    gen = torch.Generator().manual_seed(0)
    xq, xf = codes((64,), 0.05, gen)
    sign = torch.where(torch.rand(64, generator=gen) < 0.5, -1, 1)
    yq = (torch.randint(20, 128, (64,), generator=gen) * sign).to(torch.int8)
    yf = numerics.dequantize(yq, 0.04)
    m = qat.Div.from_float(qnn.Div(), QC8).eval()
    m(xf, yf)
    disable_observer(m)
    ref = m(xf, yf)
    q = quantized.Div.from_qat(m, [torch.tensor([0.05]), torch.tensor([0.04])], "bayes")
    out = q(xq, yq)
    fq = m.activation_post_process
    assert fq is not None
    assert int((out.to(torch.int64) - numerics.quantize(ref, fq.scale, "qint8")).abs().max()) <= 1
    by_zero = q(torch.tensor([5, -5, 0], dtype=torch.int8), torch.zeros(3, dtype=torch.int8))
    assert by_zero.tolist() == [127, -128, 0]  # like a saturated ±inf; 0/0 -> 0


def test_map_covers_every_qat_class() -> None:
    for cls in set(qnn.QAT_MODULE_MAP.values()):
        assert cls in QUANTIZED_MODULE_MAP, cls


@pytest.mark.parametrize(("in_dtype", "groups"), [("qint8", 1), ("qint8", 4), ("qint16", 1)])
def test_accumulator_is_exact_in_either_float_width(in_dtype: str, groups: int) -> None:
    """float32 (bounded partial sums) and float64 kernels both give the exact int64 accumulator."""
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 32, 3, padding=1, groups=groups)
    with torch.no_grad():
        conv.weight.uniform_(-1, 1)  # full-range int8 weights: the largest partial sums
    m = qat.Conv2d.from_float(conv, QC8)
    m(torch.randn(1, 64, 4, 4))
    q = quantized.Conv2d.from_qat(m, [torch.tensor([0.01])], "bayes")
    lo, hi = numerics.qrange(in_dtype)
    x = numerics.saturate(torch.randint(lo, hi + 1, (2, 64, 9, 9)), in_dtype)
    # exact reference in int64 by unfolding: sum of products of integers
    cols = torch.nn.functional.unfold(x.to(torch.float64), 3, padding=1).to(torch.int64)  # (N, C*9, L)
    w = q.weight.to(torch.int64)
    cpg = 64 // groups
    ref = torch.cat(
        [
            torch.einsum(
                "ok,nkl->nol",
                w[g * (32 // groups) : (g + 1) * (32 // groups)].reshape(32 // groups, -1),
                cols[:, g * cpg * 9 : (g + 1) * cpg * 9],
            )
            for g in range(groups)
        ],
        dim=1,
    ).reshape(2, 32, 9, 9) + q.bias.to(torch.int64).reshape(1, -1, 1, 1)
    assert torch.equal(q._accumulate(x), ref)
    if in_dtype == "qint8":
        assert q.weight_l1_max * 128 < 2**24  # this case runs the float32 kernel


def test_lut_with_qint16_output() -> None:
    qc = QC8._replace(activation=QC16.activation)
    rt = RoundTrip(nn.Sigmoid(), [(2, 3, 8, 8)], [0.05], qconfig=qc)
    assert rt.quant.table.dtype == torch.int16 and rt.q_out.dtype == torch.int16
    assert rt.max_lsb() <= 1


@given(
    s_in=st.floats(min_value=1e-3, max_value=0.5),
    w_mag=st.floats(min_value=1e-3, max_value=3.0),
    act=st.sampled_from([None, "relu", "relu6"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=15)
def test_conv_within_one_lsb_over_scales(s_in: float, w_mag: float, act: str | None, seed: int) -> None:
    torch.manual_seed(seed)
    conv = nn.Conv2d(4, 3, 3, padding=1)
    with torch.no_grad():
        conv.weight.mul_(w_mag)
    fl = conv if act is None else qnn.intrinsic.fused_class(nn.Conv2d, False, act)(conv)
    rt = RoundTrip(fl, [(1, 4, 5, 5)], [s_in], seed=seed)
    assert rt.max_lsb() <= 1


def test_scales_stay_float32_under_half_and_double() -> None:
    case = next(c for c in ALL_CASES if c.name == "ConvAddReLU2d")
    rt = _trip(case)
    q = rt.quant.half()
    assert q.scale.dtype == torch.float32 and q.input_scale_1.dtype == torch.float32
    assert torch.equal(q(*rt.q_in), rt.q_out)
    assert rt.quant.double().scale.dtype == torch.float32


@given(
    s_in=st.floats(min_value=1e-3, max_value=0.5),
    which=st.sampled_from(
        ["AvgPool2d-pad-excl", "AdaptiveAvgPool2d", "Interpolate-bilinear-size", "Interpolate-align"]
    ),
    march=st.sampled_from(["bayes", "bernoulli2"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=15)
def test_pools_and_resize_within_one_lsb_over_scales(s_in: float, which: str, march: str, seed: int) -> None:
    case = next(c for c in ALL_CASES if c.name == which)
    rt = RoundTrip(case.make(), case.shapes, [s_in], march=march, seed=seed)
    assert rt.max_lsb() <= 1
