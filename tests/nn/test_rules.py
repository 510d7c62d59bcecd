"""The module library's own integer rules: fused conv + add, average pool, bilinear weights, division."""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from backends.common import numerics
from backends.common.integer_rules import (
    FUSED_ADD_MAX_EXTRA_BITS,
    FUSED_ADD_MID_MAX_MULTIPLIER,
    avg_pool_params,
    bilinear_taps,
    div_int,
    f32,
    fused_add_int,
    fused_add_params,
)

_SCALES = st.floats(min_value=1e-4, max_value=1.0)


def _exact_round(v: Fraction) -> int:
    """floor(v + 1/2) on an exact rational."""
    return int((v + Fraction(1, 2)).__floor__())


@given(
    s_in=_SCALES,
    s_w=st.lists(st.floats(min_value=1e-4, max_value=0.05), min_size=1, max_size=4),
    s_add=_SCALES,
    out_ratio=st.floats(min_value=0.1, max_value=8.0),
    data=st.data(),
    march=st.sampled_from(["bayes", "bernoulli2"]),
    dtype=st.sampled_from(["qint8", "qint16"]),
)
def test_fused_add_error_bound(
    s_in: float, s_w: list[float], s_add: float, out_ratio: float, data: st.DataObject, march: str, dtype: str
) -> None:
    """|fused_add_int - sat(round(acc*s_acc/s_out + a*s_add/s_out))| <= 1 on both marches and dtypes,
    for any int32 accumulator and addend code."""
    if march == "bernoulli2" and dtype == "qint16":
        return  # Bernoulli2 has no int16 requantization
    s_out = f32(s_add * out_ratio)
    acc_scale = numerics.accumulator_scale(s_in, torch.tensor(s_w))
    try:
        p = fused_add_params(acc_scale, s_add, s_out, march, dtype)
    except ValueError:  # only when even p = 0 cannot represent a ratio
        top = max(f32(s_add), float(acc_scale.max())) / s_out
        assert top >= FUSED_ADD_MID_MAX_MULTIPLIER + 0.5
        return
    assert 0 <= p.extra_bits <= FUSED_ADD_MAX_EXTRA_BITS
    lo, hi = numerics.qrange(dtype)
    c = len(s_w)
    # accumulators mostly near the output range (where rounding matters), sometimes anywhere in int32
    near = [min(int(2 * hi * s_out / float(acc_scale[i])) + 1, 2**31 - 1) for i in range(c)]
    acc_st = [st.one_of(st.integers(-near[i], near[i]), st.integers(-(2**31), 2**31 - 1)) for i in range(c)]
    acc = torch.tensor([[data.draw(acc_st[i]) for i in range(c)] for _ in range(8)])
    add = torch.tensor([[data.draw(st.integers(lo, hi)) for _ in range(c)] for _ in range(8)])
    out = fused_add_int(
        acc, add, p.acc_multiplier, p.acc_shift, p.add_multiplier, p.add_shift, p.extra_bits, dtype, axis=1
    )
    so = Fraction(f32(s_out))
    sa = Fraction(f32(s_add))
    bound = 1
    for n in range(8):
        for i in range(c):
            exact = Fraction(int(acc[n, i])) * Fraction(float(acc_scale[i])) / so + Fraction(int(add[n, i])) * sa / so
            want = min(max(_exact_round(exact), lo), hi)
            assert abs(int(out[n, i]) - want) <= bound


def test_avg_pool_divisors_match_torch() -> None:
    """The divisor map AvgPool2d derives equals torch's: sum / d reproduces avg_pool2d exactly in float64."""
    from qir.nn.quantized.pool import AvgPool2d

    x = torch.randint(-128, 128, (1, 2, 7, 6), dtype=torch.int64).to(torch.float64)
    for k, s, p, ceil, cip, div in [
        (3, 2, 1, False, True, None),
        (3, 2, 1, True, True, None),
        (3, 2, 1, True, False, None),
        (2, 3, 1, True, False, None),
        (3, 1, 1, False, True, 4),
    ]:
        m = AvgPool2d()
        m.kernel_size, m.stride, m.padding = (k, k), (s, s), (p, p)
        m.ceil_mode, m.count_include_pad, m.divisor_override = ceil, cip, div
        d = m._divisor(7, 6, x)
        sums = F.avg_pool2d(x, k, s, p, ceil, True, 1)
        ref = F.avg_pool2d(x, k, s, p, ceil, cip, div)
        assert torch.allclose(sums / d, ref, rtol=0, atol=1e-12)


def test_avg_pool_params_within_one_lsb() -> None:
    mult, shift = avg_pool_params(0.02, 0.015, 9, "bayes")
    for d in range(1, 10):
        sums = torch.arange(-128 * d, 127 * d + 1)
        out = numerics.requantize(sums, mult[d - 1], shift[d - 1], "qint8")
        exact = numerics.quantize(sums.to(torch.float64) * f32(0.02) / (d * f32(0.015)), 1.0, "qint8")
        assert int((out.to(torch.int64) - exact.to(torch.int64)).abs().max()) <= 1


def test_bilinear_taps_match_torch_weights() -> None:
    """Integer taps reproduce torch's bilinear resize of a ramp within the weight rounding (2**-bits)."""
    for n_in, n_out, scale, ac in [(8, 16, 2.0, False), (8, 5, None, False), (7, 13, None, True), (6, 4, 0.75, False)]:
        i0, i1, w0, w1 = bilinear_taps(n_in, n_out, scale, ac, 12)
        assert bool(((w0 + w1) == 4096).all())
        ramp = torch.arange(n_in, dtype=torch.float64) ** 2
        ours = (ramp[i0] * w0 + ramp[i1] * w1) / 4096
        kw = {"scale_factor": scale} if scale is not None else {"size": n_out}
        ref = F.interpolate(ramp.reshape(1, 1, -1), mode="linear", align_corners=ac, **kw).reshape(-1)
        assert torch.allclose(ours, ref, atol=2 * float(ramp.max()) / 4096)


@given(
    x=st.lists(st.integers(-128, 127), min_size=1, max_size=16),
    y=st.lists(st.integers(-128, 127), min_size=16, max_size=16),
    m=st.integers(1, 32767),
    s=st.integers(0, 31),
)
def test_div_int_is_exact_half_up(x: list[int], y: list[int], m: int, s: int) -> None:
    xs = torch.tensor(x)
    ys = torch.tensor(y[: len(x)])
    out = div_int(xs, ys, m, s, "qint16")
    for a, b, o in zip(x, y, out.tolist(), strict=False):
        if b == 0:
            assert o == (32767 if a > 0 else -32768 if a < 0 else 0)
        else:
            want = _exact_round(Fraction(a * m, b * 2**s))
            assert o == min(max(want, -32768), 32767)
