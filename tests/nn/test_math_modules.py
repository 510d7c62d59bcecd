"""PReLU, GLU, Softmax, LayerNorm: QAT modules, integer modules, and their integer rules.

Bounds (docs/semantics.md): the integer output is within 1 LSB of the QAT output (2 for a
qint16 GLU, where a float32 tie in the QAT sigmoid adds one); the rules match Python-integer
evaluations of their documented formulas exactly and exact arithmetic within their stated error.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from nn_helpers import QC8, QC16, RoundTrip, codes, storages
from torch import nn

from backends.common import math_rules as R
from backends.common import numerics
from qir.nn import QAT_MODULE_MAP, QUANTIZED_MODULE_MAP, qat, quantized
from qir.quantization import disable_fake_quant, disable_observer

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


def _prelu_c() -> nn.Module:
    m = nn.PReLU(3)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([0.25, -0.5, 0.0]))
    return m


def _ln_affine() -> nn.Module:
    m = nn.LayerNorm([6, 6])
    with torch.no_grad():
        m.weight.uniform_(-2, 2)
        m.bias.uniform_(-1, 1)
    return m


#: name -> (float module factory, input shape, input scale)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], float]] = {
    "PReLU": (nn.PReLU, (4, 3, 6, 6), 0.05),
    "PReLU-channels": (_prelu_c, (4, 3, 6, 6), 0.05),
    "GLU": (lambda: nn.GLU(1), (4, 6, 6, 6), 0.05),
    "GLU-last": (lambda: nn.GLU(-1), (4, 3, 10), 0.1),
    "Softmax": (lambda: nn.Softmax(1), (4, 16, 6, 6), 0.05),
    "Softmax-last": (lambda: nn.Softmax(-1), (4, 3, 200), 0.1),
    "LayerNorm": (lambda: nn.LayerNorm([6]), (4, 3, 6, 6), 0.05),
    "LayerNorm-affine": (_ln_affine, (4, 3, 6, 6), 0.02),
    "LayerNorm-plain": (lambda: nn.LayerNorm([3, 6, 6], elementwise_affine=False), (4, 3, 6, 6), 0.05),
}
#: documented bound in output LSB against the QAT output
BOUND = {("GLU", "qint16"): 2, ("GLU-last", "qint16"): 2}


def _trip(name: str, qc: object = QC8, seed: int = 0) -> RoundTrip:
    make, shape, scale = CASES[name]
    torch.manual_seed(seed)
    return RoundTrip(make(), [shape], [scale], qconfig=qc, seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("out_dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("name", list(CASES))
def test_integer_output_matches_qat(name: str, out_dtype: str) -> None:
    for seed in (0, 1, 2):
        rt = _trip(name, QC8 if out_dtype == "qint8" else QC16, seed)
        assert rt.q_out.dtype == numerics.qdtype(out_dtype).to_torch()
        assert rt.max_lsb() <= BOUND.get((name, out_dtype), 1), f"{name}: {rt.max_lsb()} LSB off"


@pytest.mark.parametrize("name", list(CASES))
def test_trace_buffers_and_maps(name: str) -> None:
    rt = _trip(name)
    traced = torch.jit.trace(rt.quant, tuple(rt.q_in))
    for seed in (5, 6):
        q, _ = codes(CASES[name][1], CASES[name][2], torch.Generator().manual_seed(seed))
        assert torch.equal(traced(q), rt.quant(q))
    assert rt.fq is not None and torch.equal(rt.quant.scale, rt.fq.scale) and rt.quant.dtype is rt.fq.dtype
    assert QUANTIZED_MODULE_MAP[type(rt.qat)] is type(rt.quant)
    assert type(rt.quant).__module__.startswith("qir.nn.quantized")


@pytest.mark.parametrize("name", list(CASES))
def test_from_float_copies_and_leaves_float_untouched(name: str) -> None:
    fl = CASES[name][0]()
    fl.train(False)
    before = copy.deepcopy(fl.state_dict())
    m = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8)  # type: ignore[attr-defined]
    assert not (storages(fl) & storages(m)), "QAT module shares a tensor with the float module"
    assert not m.training
    _, x = codes(CASES[name][1], CASES[name][2], torch.Generator().manual_seed(0))
    m(x)
    after = fl.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    if isinstance(fl, (nn.PReLU, nn.LayerNorm)) and fl.weight is not None:
        assert torch.equal(m.weight, fl.weight)


@pytest.mark.parametrize("name", list(CASES))
def test_equals_float_with_fake_quant_disabled(name: str) -> None:
    fl = CASES[name][0]().eval()
    m = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8).eval()  # type: ignore[attr-defined]
    disable_fake_quant(m)
    _, x = codes(CASES[name][1], CASES[name][2], torch.Generator().manual_seed(1))
    if isinstance(fl, nn.GLU):  # a * sigmoid(b) vs F.glu's own kernel: rounding apart
        torch.testing.assert_close(m(x), fl(x), rtol=0, atol=1e-6)
    else:
        assert torch.equal(m(x), fl(x))


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_flow(name: str) -> None:
    fl = CASES[name][0]()
    m = QAT_MODULE_MAP[type(fl)].from_float(fl, QC8)  # type: ignore[attr-defined]
    x = (torch.randn(CASES[name][1], generator=torch.Generator().manual_seed(2)) * 2).requires_grad_(True)
    out = m(x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all()) and bool(x.grad.abs().sum() > 0)
    for p in m.parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and bool(p.grad.abs().sum() > 0)


def test_softmax_row_maximum_keeps_its_gradient() -> None:
    """The exp scale 1/32767 holds exp(0) = 1 unsaturated: the clip-aware fake quant passes the max's gradient."""
    m = qat.Softmax.from_float(nn.Softmax(-1), QC8)
    m(torch.tensor([[6.0, 0.0, 0.0]]))  # output scale ~ 1/128: the probabilities below stay unsaturated
    disable_observer(m)
    x = torch.tensor([[2.0, 0.5, -1.0]], requires_grad=True)
    (m(x)[0, 0]).backward()
    assert x.grad is not None and float(x.grad[0, 0]) > 0 and float(x.grad[0, 1]) < 0
    assert m.exp_post_process.has_fixed_scale and float(m.exp_post_process.scale) == R.SOFTMAX_EXP_SCALE


def test_glu_sigmoid_fake_quant_sets_the_table_scale() -> None:
    rt = _trip("GLU")
    sig = rt.qat.sigmoid_post_process
    assert torch.equal(rt.quant.sigmoid_scale, sig.scale) and rt.quant.sigmoid_dtype is sig.dtype
    table = numerics.lut_int8(torch.sigmoid, 0.05, float(sig.scale), sig.dtype)
    assert torch.equal(rt.quant.table, table)


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_module_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"Softmax.*no dim.*nn\.Softmax\(dim=1\)"):
        qat.Softmax.from_float(nn.Softmax(), QC8)
    with pytest.raises(TypeError, match=r"PReLU\.from_float takes nn\.PReLU"):
        qat.PReLU.from_float(nn.ReLU(), QC8)
    glu = qat.GLU.from_float(nn.GLU(1), QC8)
    with pytest.raises(ValueError, match="GLU: dimension 1 of the input has odd size 3"):
        glu(torch.randn(1, 3, 2))
    sm = _trip("Softmax")
    with pytest.raises(NotImplementedError, match=r"Softmax: only qint8 input.*qint8 qconfig"):
        sm.quant(torch.zeros(1, 16, 2, 2, dtype=torch.int16))
    g = _trip("GLU")
    with pytest.raises(NotImplementedError, match="GLU: only qint8 input"):
        g.quant(torch.zeros(1, 6, 2, 2, dtype=torch.int16))
    p = _trip("PReLU-channels")
    with pytest.raises(ValueError, match="PReLU: 3 slopes need an input with 3 channels"):
        p.quant(torch.zeros(1, 4, 2, 2, dtype=torch.int8))
    ln = _trip("LayerNorm")
    with pytest.raises(ValueError, match="does not end in normalized_shape"):
        ln.quant(torch.zeros(1, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match="march bernoulli2 cannot produce qint16"):
        quantized.Softmax.from_qat(_trip("Softmax", QC16).qat, [torch.tensor([0.05])], "bernoulli2")


def test_layer_norm_ranges() -> None:
    big = qat.LayerNorm.from_float(nn.LayerNorm([2**10, 2**10 + 1]), QC8)
    with pytest.raises(ValueError, match=r"LayerNorm: normalized_shape \(1024, 1025\) has 1049600 elements"):
        quantized.LayerNorm.from_qat(big, [torch.tensor([0.05])], "bayes")
    wide = qat.LayerNorm.from_float(nn.LayerNorm([160, 160]), QC8)  # 25600 elements: fine for qint8 only
    q = quantized.LayerNorm.from_qat(wide, [torch.tensor([0.05])], "bayes")
    assert q(torch.ones(1, 160, 160, dtype=torch.int8)).dtype == torch.int8
    with pytest.raises(ValueError, match=r"exceed the integer rule's range.*use qint8 input"):
        q(torch.ones(1, 160, 160, dtype=torch.int16))
    eps = qat.LayerNorm.from_float(nn.LayerNorm([4], eps=1e12), QC8)
    qe = quantized.LayerNorm.from_qat(eps, [torch.tensor([1e-4])], "bayes")
    with pytest.raises(ValueError, match="eps is too large for the input scale"):
        qe(torch.ones(1, 4, dtype=torch.int8))


def test_layer_norm_constant_rows_give_the_bias() -> None:
    m = nn.LayerNorm([5])
    with torch.no_grad():
        m.bias.copy_(torch.tensor([0.5, -0.25, 0.0, 1.0, -1.0]))
    rt = RoundTrip(m, [(2, 5)], [0.05], qconfig=QC8)
    out = rt.quant(torch.full((3, 5), 7, dtype=torch.int8))
    want = numerics.requantize(rt.quant.bias, 1, R.LN_EXTRA_BITS, "qint8")  # the bias at s_out / 2**8, rounded
    assert torch.equal(out, want.expand(3, 5))
    assert int((want.to(torch.int64) - numerics.quantize(m.bias.detach(), rt.quant.scale, "qint8")).abs().max()) <= 1


# ----------------------------------------------------------------------------- rules: properties


def f32(v: float) -> float:
    return float(np.float32(v))


def half_up(fr: Fraction) -> int:
    return math.floor(fr + Fraction(1, 2))


def sat(v: int, dtype: str) -> int:
    lo, hi = numerics.qrange(dtype)
    return max(lo, min(hi, v))


def rshift_half_up(v: int, s: int) -> int:
    return (v + ((1 << s) >> 1)) >> s


log_scales = st.floats(min_value=-10.0, max_value=0.0).map(lambda e: f32(2.0**e * 1.2345))


@given(n=st.one_of(st.integers(0, 2**20), st.integers(0, 2**62 - 1)))
def test_isqrt_and_bit_length(n: int) -> None:
    from backends.common.kernels.layer_norm import _bit_length, _isqrt

    t = torch.tensor([n, max(n - 1, 0), n // 3], dtype=torch.int64)
    want_root = [math.isqrt(v) for v in t.tolist()]
    want_bits = [v.bit_length() for v in t.tolist()]
    assert R.isqrt(t).tolist() == want_root and _isqrt(t).tolist() == want_root
    assert R.bit_length(t).tolist() == want_bits and _bit_length(t).tolist() == want_bits


@given(
    s_in=log_scales,
    s_out=log_scales,
    slopes=st.lists(st.floats(-4.0, 4.0, width=32), min_size=1, max_size=3),
    march=st.sampled_from(["bayes", "bernoulli2"]),
    dtype=st.sampled_from(["qint8", "qint16"]),
    seed=st.integers(0, 2**16),
)
def test_prelu_rule(s_in: float, s_out: float, slopes: list[float], march: str, dtype: str, seed: int) -> None:
    if march == "bernoulli2":
        dtype = "qint8"
    slope = torch.tensor(slopes, dtype=torch.float32)
    ratios = [s_in / s_out] + [abs(a) * s_in / s_out for a in slopes]  # the rule's float64 ratios
    if max(ratios) >= numerics.requant_limits(march).max_multiplier + 0.5:
        with pytest.raises(ValueError):
            R.prelu_params(s_in, s_out, slope, march, dtype)
        return
    p = R.prelu_params(s_in, s_out, slope, march, dtype)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-32768 if dtype == "qint16" else -128, 128, (2, len(slopes), 5), generator=gen)
    q = q.to(torch.int16 if dtype == "qint16" else torch.int8)
    out = R.prelu_int(q, p, dtype)
    nm, ns = p.neg_multiplier.tolist(), p.neg_shift.tolist()
    for (i, c, j), v in np.ndenumerate(q.numpy()):
        v = int(v)
        m, s = (p.pos_multiplier, p.pos_shift) if v >= 0 else (nm[c if len(nm) > 1 else 0], ns[c if len(ns) > 1 else 0])
        got = int(out[i, c, j])
        assert got == sat(rshift_half_up(v * m, s), dtype)
        a = Fraction(1) if v >= 0 else Fraction(f32(slopes[c if len(slopes) > 1 else 0]))
        exact = half_up(Fraction(v) * a * Fraction(s_in) / Fraction(s_out))
        assert abs(got - sat(exact, dtype)) <= 1


@given(
    s_in=st.floats(min_value=-9.0, max_value=0.0).map(lambda e: f32(2.0**e * 3.7)),
    s_out=st.sampled_from([1 / 127.5, 1 / 100.0, 1 / 32767.5, 1 / 20000.0]),
    length=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_softmax_rule(s_in: float, s_out: float, length: int, seed: int) -> None:
    dtype = "qint8" if s_out > 1e-3 else "qint16"
    s_out = f32(s_out)
    table = R.softmax_exp_table(s_in)
    s_e = Fraction(R.SOFTMAX_EXP_SCALE)
    for d in range(-255, 1, 17):  # the table is the documented formula (ties within libm's error aside)
        v = Fraction(math.exp(d * s_in)) / s_e
        if abs(v - math.floor(v) - Fraction(1, 2)) > Fraction(1, 10**6):
            assert int(table[d + 255]) == min(half_up(v), R.SOFTMAX_EXP_MAX)
    m, k = R.softmax_params(s_out, dtype, "bayes")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (3, length), generator=gen, dtype=torch.int8)
    out = R.softmax_int(q, table, m, k, -1, dtype)
    for row in range(3):
        xs = [int(v) for v in q[row]]
        e = [int(table[v - max(xs) + 255]) for v in xs]
        total = sum(e)
        for i in range(length):
            got = int(out[row, i])
            assert got == sat(half_up(Fraction(e[i] * m, total << k)), dtype)
            # vs the exact quotient of the table values: rounding plus the 31-bit reciprocal's error
            exact = Fraction(e[i]) / (total * Fraction(s_out))
            if exact < numerics.qrange(dtype)[1]:
                assert abs(got - exact) <= Fraction(1, 2) + exact * Fraction(1, 2**29)


def ln_reference(
    q: list[int],
    s_in: float,
    s_out: float,
    eps: float,
    w: list[float],
    b: list[float],
    dtype: str,
    in_dtype: torch.dtype,
) -> list[int]:
    """The documented LayerNorm rule in Python integers (math.isqrt, exact shifts)."""
    n = len(q)
    f = R.layer_norm_eps_bits(n, in_dtype)
    e = int(round_half_up_f64(eps * n * n * 4.0**f / (f32(s_in) * f32(s_in))))
    p = R.layer_norm_params(s_in, s_out, (n,), eps, torch.tensor(w), torch.tensor(b), "bayes", dtype)
    s1, s2 = sum(q), sum(v * v for v in q)
    t = ((n * s2 - s1 * s1) << (2 * f)) + e
    k = max(0, (60 - t.bit_length()) // 2)
    root = max(math.isqrt(t << (2 * k)), 1)
    out = []
    for j, v in enumerate(q):
        z = half_up(Fraction((n * v - s1) << (f + k + R.LN_Z_BITS), root))
        mm, sh = int(p.multiplier[j]), int(p.shift[j])
        mid = sat(rshift_half_up(z * mm, sh), "qint32") + int(p.bias[j])
        out.append(sat(rshift_half_up(mid, R.LN_EXTRA_BITS), dtype))
    return out


def round_half_up_f64(v: float) -> float:
    return float(numerics.round_half_up(torch.tensor(v, dtype=torch.float64)))


@given(
    n=st.integers(2, 24),
    s_in=log_scales,
    eps=st.sampled_from([1e-5, 1e-3, 0.1, 0.0]),
    in16=st.booleans(),
    out16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layer_norm_rule(n: int, s_in: float, eps: float, in16: bool, out16: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    in_dtype, lo, hi = (torch.int16, -32768, 32767) if in16 else (torch.int8, -128, 127)
    dtype = "qint16" if out16 else "qint8"
    q = torch.randint(lo, hi + 1, (2, n), generator=gen, dtype=torch.int64)
    q[1] = q[1] // 64  # a second, narrower row
    q = q.to(in_dtype)
    w = (torch.rand(n, generator=gen) * 4 - 2).tolist()
    b = (torch.rand(n, generator=gen) * 2 - 1).tolist()
    s_out = f32(4.0 * (max(abs(v) for v in w) * math.sqrt(n) + 1) / numerics.qrange(dtype)[1])
    p = R.layer_norm_params(s_in, s_out, (n,), eps, torch.tensor(w), torch.tensor(b), "bayes", dtype)
    out = R.layer_norm_int(q, 1, p, dtype)
    for row in range(2):
        xs = [int(v) for v in q[row]]
        ref = ln_reference(xs, s_in, s_out, eps, w, b, dtype, in_dtype)
        assert out[row].tolist() == ref
        if len(set(xs)) == 1:
            continue  # a constant row: the float reference divides 0 by sqrt(eps)
        # against layer norm of the real values (float64): within 1 LSB
        x = torch.tensor(xs, dtype=torch.float64) * f32(s_in)
        y = (
            F.layer_norm(
                x,
                (n,),
                torch.tensor(w, dtype=torch.float32).double(),
                torch.tensor(b, dtype=torch.float32).double(),
                eps,
            )
            / s_out
        )
        assert float((out[row].double() - y.clamp(*numerics.qrange(dtype))).abs().max()) <= 1.0
