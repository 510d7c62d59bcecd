"""The shared integer rules (backends.common.numerics), checked against exact rational arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from backends.common import numerics as nx
from qir.ir.types import DType
from qir.march import March

MARCHES = ["bayes", "bernoulli2"]


def f32(v: float) -> float:
    return float(np.float32(v))


def half_up(fr: Fraction) -> int:
    return math.floor(fr + Fraction(1, 2))


def sat(v: int, dtype: str) -> int:
    lo, hi = nx.qrange(dtype)
    return max(lo, min(hi, v))


log_scales = st.floats(min_value=-20.0, max_value=4.0).map(lambda e: f32(2.0**e * 1.2345))
int8_dtypes = st.sampled_from(["qint8", "qint16"])


# -- round half up / quantize / dequantize ------------------------------------------------------


def test_quantize_ties_round_half_up_not_to_even() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -128.5, -129.0])
    q = nx.quantize(x, 1.0, "qint8")
    assert q.tolist() == [1, 2, 3, 0, -1, -2, 127, 127, -128, -128]
    assert q.dtype == torch.int8


def test_round_half_up_is_exact_below_one_half() -> None:
    v = torch.tensor([np.nextafter(np.float32(0.5), np.float32(0))], dtype=torch.float32)
    assert float(torch.floor(v + 0.5)) == 1.0  # the naive formula rounds this up
    assert float(nx.round_half_up(v)) == 0.0


@given(st.floats(min_value=-1e6, max_value=1e6, width=32), log_scales, int8_dtypes)
def test_quantize_is_half_up_of_the_float32_quotient(x: float, s: float, dtype: str) -> None:
    q = int(nx.quantize(torch.tensor([x]), s, dtype)[0])
    quotient = Fraction(float(np.float32(x) / np.float32(s)))  # one IEEE float32 division
    assert q == sat(half_up(quotient), dtype)


@given(st.data(), log_scales, int8_dtypes)
def test_round_trip_error_at_most_half_a_scale(data: st.DataObject, s: float, dtype: str) -> None:
    lo, hi = nx.qrange(dtype)
    x = f32(data.draw(st.floats(min_value=lo * s, max_value=hi * s)))
    x = min(max(x, lo * s), hi * s)
    back = float(nx.dequantize(nx.quantize(torch.tensor([x]), s, dtype), s)[0])
    # Half a scale, plus float32 rounding: the scale is stored as float32 and q * s is one
    # float32 product, each off by up to half an ulp of |x| (qint16 codes reach 2**15).
    assert abs(back - x) <= s / 2 * (1 + 1e-6) + abs(x) * 2.0**-22 + 1e-30


def test_per_channel_quantize_uses_the_axis() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    q = nx.quantize(x, torch.tensor([0.5, 0.25, 1.0]), "qint8", axis=1)
    assert q.tolist() == [[2, 4, 1], [2, 4, 1]]
    assert nx.dequantize(q, torch.tensor([0.5, 0.25, 1.0]), axis=-1).tolist() == x.tolist()
    with pytest.raises(ValueError, match="pass axis"):
        nx.quantize(x, torch.tensor([0.5, 0.25, 1.0]), "qint8")


def test_dtype_spellings() -> None:
    assert nx.qdtype("QINT16") is DType.qint16 and nx.qdtype(torch.qint8) is DType.qint8
    assert nx.qdtype("qi8") is DType.qint8
    with pytest.raises(ValueError, match="not a quantized dtype"):
        nx.qdtype(DType.float32)


# -- requantization -----------------------------------------------------------------------------


@st.composite
def scale_pairs(draw: st.DrawFn, march: str) -> tuple[float, float]:
    lim = nx.requant_limits(march)
    in_s = f32(2.0 ** draw(st.floats(-40.0, 0.0)))
    log_ratio = draw(st.floats(-34.0, math.log2(lim.max_multiplier)))
    out_s = f32(in_s / 2.0**log_ratio)
    assume_ratio = Fraction(in_s) / Fraction(out_s)
    if assume_ratio >= lim.max_multiplier:  # float32 rounding pushed it over the limit
        out_s = f32(out_s * 1.01)
    return in_s, out_s


@pytest.mark.parametrize("march", MARCHES)
@given(data=st.data())
def test_requant_params_within_limits_and_optimal(march: str, data: st.DataObject) -> None:
    in_s, out_s = data.draw(scale_pairs(march))
    lim = nx.requant_limits(march)
    m_t, s_t = nx.requant_params(in_s, out_s, march, "qint8")
    m, s = int(m_t), int(s_t)
    assert 0 <= m <= lim.max_multiplier and 0 <= s <= lim.max_shift
    r = Fraction(in_s) / Fraction(out_s)
    assert m == half_up(r * 2**s)  # multiplier is the rounded scaled ratio
    if s < lim.max_shift:  # one more shift bit would overflow the multiplier
        assert half_up(r * 2 ** (s + 1)) > lim.max_multiplier


@pytest.mark.parametrize("march", MARCHES)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_requantize_within_one_of_exact_rounding(march: str, data: st.DataObject, seed: int) -> None:
    in_s, out_s = data.draw(scale_pairs(march))
    m, s = nx.requant_params(in_s, out_s, march, "qint8")
    r = Fraction(in_s) / Fraction(out_s)
    reach = min(2**31 - 1, int(200 / r) + 1)  # covers the whole output range and saturation
    g = torch.Generator().manual_seed(seed)
    near = torch.randint(-reach, reach + 1, (48,), generator=g, dtype=torch.int64)
    anywhere = torch.randint(-(2**31), 2**31, (16,), generator=g, dtype=torch.int64)
    acc = torch.cat([near, anywhere]).to(torch.int32)
    got = nx.requantize(acc, m, s, "qint8")
    for a, o in zip(acc.tolist(), got.tolist(), strict=True):
        assert abs(o - sat(half_up(a * r), "qint8")) <= 1
        # and bit-exact with the integer formula written with Python ints
        mi, si = int(m), int(s)
        assert o == sat((a * mi + ((1 << si) >> 1)) >> si, "qint8")


@given(data=st.data(), seed=st.integers(0, 2**31))
def test_bayes_int16_requant_within_one_over_all_int32(data: st.DataObject, seed: int) -> None:
    # The pre-rounding error can exceed 1 LSB only beyond full scale, where saturation absorbs it.
    in_s, out_s = data.draw(scale_pairs("bayes"))
    m, s = nx.requant_params(in_s, out_s, "bayes", "qint16")
    r = Fraction(in_s) / Fraction(out_s)
    g = torch.Generator().manual_seed(seed)
    reach = min(2**31 - 1, int(40000 / r) + 1)
    acc = torch.cat(
        [
            torch.randint(-reach, reach + 1, (48,), generator=g, dtype=torch.int64),
            torch.randint(-(2**31), 2**31, (16,), generator=g, dtype=torch.int64),
        ]
    )
    got = nx.requantize(acc, m, s, "qint16")
    for a, o in zip(acc.tolist(), got.tolist(), strict=True):
        assert abs(o - sat(half_up(a * r), "qint16")) <= 1


def test_requant_rejects_what_the_march_cannot_do() -> None:
    with pytest.raises(ValueError, match="exceeds the multiplier limit 255"):
        nx.requant_params(1.0, 1 / 300, "bernoulli2")
    with pytest.raises(ValueError, match="cannot requantize to qint16"):
        nx.requant_params(0.1, 0.2, March.BERNOULLI2, "qint16")
    with pytest.raises(ValueError, match="high-precision output"):
        nx.requant_params(0.1, 0.2, "bayes", "qint32")
    with pytest.raises(ValueError, match="unknown"):
        nx.requant_params(0.1, 0.2, "x3")


def test_tiny_ratio_gives_zero_multiplier_and_zero_output() -> None:
    m, s = nx.requant_params(2.0**-40, 1.0, "bayes")
    assert int(m) == 0 and int(s) == 31
    acc = torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int64)
    assert nx.requantize(acc, m, s, "qint8").tolist() == [0, 0]


def test_per_channel_conv_requant_matches_channel_by_channel() -> None:
    torch.manual_seed(1)
    in_s, out_s = 0.02, 0.05
    w_s = torch.rand(4) * 0.01 + 1e-3
    m, s = nx.conv_requant_params(in_s, w_s, out_s, "bayes")
    acc = torch.randint(-(2**20), 2**20, (2, 4, 3, 3), dtype=torch.int32)
    out = nx.requantize(acc, m, s, "qint8", axis=1)
    acc_scale = nx.accumulator_scale(in_s, w_s)
    for c in range(4):
        mc, sc = nx.multiplier_shift(acc_scale[c] / f32(out_s), 32767, 31)
        assert (int(mc), int(sc)) == (int(m[c]), int(s[c]))
        assert torch.equal(out[:, c], nx.requantize(acc[:, c], mc, sc, "qint8"))
    with pytest.raises(ValueError, match="pass axis"):
        nx.requantize(acc, m, s, "qint8")


def test_bias_is_int32_at_the_accumulator_scale() -> None:
    b = torch.tensor([0.1, -0.2])
    q = nx.quantize_bias(b, 0.5, torch.tensor([0.01, 0.02]))
    assert q.dtype == torch.int32
    assert q.tolist() == [round(0.1 / 0.005), round(-0.2 / 0.01)]


# -- add ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("march", MARCHES)
@given(
    sx=log_scales.filter(lambda v: v < 4),
    ratio_y=st.floats(-6.0, 6.0),
    ratio_o=st.floats(-1.0, 3.0),
    seed=st.integers(0, 2**31),
)
def test_add_params_limits_and_error(march: str, sx: float, ratio_y: float, ratio_o: float, seed: int) -> None:
    sy, so = f32(sx * 2.0**ratio_y), f32(sx * 2.0**ratio_o)
    p = nx.add_params(sx, sy, so, march, "qint8")
    assert 0 <= p.shift <= 23 and 0 <= p.qscale <= 32767 and 0 <= p.out_shift <= 31
    assert p.multiplier <= nx.requant_limits(march).max_multiplier
    a_s, b_s = (sy, sx) if p.swap else (sx, sy)
    assert p.qscale == half_up(Fraction(b_s) * 2**p.shift / Fraction(a_s))
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (64,), generator=g)
    y = torch.randint(-128, 128, (64,), generator=g)
    out = nx.add_int(x.to(torch.int8), y.to(torch.int8), p, "qint8")
    # Bayes (int16 multipliers): within 1 LSB. Bernoulli2's 8-bit output multiplier has a
    # relative error up to 2**-8 of the *accumulator*, which under cancellation (large
    # x and y, small sum) can exceed the output: the bound adds that worst case
    # (docs/semantics.md, "Elementwise add").
    m_exact = Fraction(p.multiplier, 2**p.out_shift)
    r2 = Fraction(a_s) / (2**p.shift * Fraction(so))
    slack = 128 * 2**p.shift * abs(m_exact - r2) + 128 * abs(p.qscale * m_exact - Fraction(b_s) / Fraction(so))
    bound = 1 if march == "bayes" else 1 + slack
    for xi, yi, o in zip(x.tolist(), y.tolist(), out.tolist(), strict=True):
        exact = (xi * Fraction(sx) + yi * Fraction(sy)) / Fraction(so)
        assert abs(o - sat(half_up(exact), "qint8")) <= bound


def test_add_int16_shift_limit_and_int_formula() -> None:
    p = nx.add_params(0.001, 0.0005, 0.002, "bayes", "qint16")
    assert p.shift <= 15 and not p.swap
    x = torch.tensor([32767, -32768, 100], dtype=torch.int16)
    y = torch.tensor([-32768, 32767, -7], dtype=torch.int16)
    out = nx.add_int(x, y, p, "qint16")
    for xi, yi, o in zip(x.tolist(), y.tolist(), out.tolist(), strict=True):
        acc = (xi << p.shift) + yi * p.qscale
        assert abs(acc) < 2**31  # fits the int32 accumulator
        assert o == sat((acc * p.multiplier + ((1 << p.out_shift) >> 1)) >> p.out_shift, "qint16")


# -- table lookup -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "ref"),
    [
        (lambda t: t * t, lambda v: v * v),
        (torch.relu, lambda v: max(v, 0.0)),
        (torch.sigmoid, lambda v: 1.0 / (1.0 + math.exp(-v))),
        (torch.tanh, math.tanh),
    ],
)
@given(in_s=st.floats(1e-3, 0.2).map(f32), out_s=st.floats(1e-3, 0.2).map(f32))
def test_lut_int8_matches_direct_evaluation(fn: object, ref: object, in_s: float, out_s: float) -> None:
    table = nx.lut_int8(fn, in_s, out_s, "qint8")  # type: ignore[arg-type]
    assert table.shape == (256,) and table.dtype == torch.int8
    q = torch.arange(-128, 128, dtype=torch.int8)
    looked_up = nx.lut_apply(table, q)
    for qi, t in zip(q.tolist(), looked_up.tolist(), strict=True):
        v = ref(qi * in_s) / out_s  # type: ignore[operator]
        if abs(v - math.floor(v) - 0.5) < 1e-9:
            continue  # a tie within libm's error: either side is a faithful evaluation
        assert t == sat(math.floor(v + 0.5), "qint8")


def test_lut_rejects_nan_and_non_elementwise_functions() -> None:
    with pytest.raises(ValueError, match="NaN"):
        nx.lut_int8(torch.log, 0.1, 0.1)
    with pytest.raises(ValueError, match="elementwise"):
        nx.lut_int8(lambda t: t.sum().reshape(1), 0.1, 0.1)


def test_qint32_quantize_saturates_without_wrapping() -> None:
    q = nx.quantize(torch.tensor([3e9, -3e9, 2.5]), 1.0, "qint32")
    assert q.dtype == torch.int32 and q.tolist() == [2**31 - 1, -(2**31), 3]
