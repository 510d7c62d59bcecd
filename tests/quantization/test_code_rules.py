"""The integer rules of the ops on codes (qir/quantization/code_ops.py, docs/semantics.md "Ops on codes"),
checked over every qint8 and qint16 code for random scales and constants, exact ties included:

* a comparison with a number on codes equals the float32 comparison of the dequantized values;
* clamp with code bounds, abs and a constant pad equal the fake quant of the float result;
* argmax / max / topk pick the same indices on codes as on the dequantized values (ties too).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from backends.common import numerics
from qir.ir.types import DType
from qir.quantization.code_convert import compare_bounds, number_comparison_error, tensor_comparison_error
from qir.quantization.code_ops import (
    COMPARISONS,
    abs_codes,
    clamp_codes,
    compare_codes,
    compare_range,
    constant_code,
    flipped,
    rounded_code,
)

CODES = {
    DType.qint8: torch.arange(-128, 128, dtype=torch.int8),
    DType.qint16: torch.arange(-32768, 32768, dtype=torch.int16),
}
f32 = st.floats(2**-20, 2**6, allow_nan=False, allow_infinity=False).map(lambda v: float(np.float32(v)))
dtypes = st.sampled_from([DType.qint8, DType.qint16])


def _fq(v: torch.Tensor, s: float, dt: DType) -> torch.Tensor:
    return numerics.dequantize(numerics.quantize(v, s, dt), s)


@st.composite
def constants(draw: st.DrawFn, s: float, dt: DType) -> float:
    """A number to compare with: anywhere, exactly a dequantized code, one float32 / float64 step
    beside one, half-way between two codes (a rounding tie), or an integer."""
    lo, hi = dt.qrange
    q = draw(st.integers(lo - 2, hi + 2))
    tie = float(numerics.dequantize(torch.tensor([q]), s)[0])
    kind = draw(st.sampled_from(["any", "tie", "f32_step", "f64_step", "half", "int"]))
    if kind == "any":
        return draw(st.floats(-(hi + 4) * s, (hi + 4) * s, allow_nan=False))
    if kind == "tie":
        return tie
    if kind == "f32_step":
        return float(np.nextafter(np.float32(tie), np.float32(draw(st.sampled_from([-1, 1])) * np.inf)))
    if kind == "f64_step":
        return math.nextafter(tie, draw(st.sampled_from([-math.inf, math.inf])))
    if kind == "half":
        return float(np.float32((q + 0.5) * s))
    return float(draw(st.integers(-3, 3)))


@given(data=st.data(), s=f32, dt=dtypes, op=st.sampled_from(sorted(COMPARISONS)))
def test_comparison_on_codes_equals_the_float_comparison(data: st.DataObject, s: float, dt: DType, op: str) -> None:
    c = data.draw(constants(s, dt))
    codes = CODES[dt]
    lo, hi = compare_range(op, c, s)
    want = COMPARISONS[op](numerics.dequantize(codes, s), c)
    assert torch.equal(compare_codes(codes, op, c, lo, hi), want)
    # a constant on the left: c <op> x == x <flipped> c
    lo, hi = compare_range(flipped(op), c, s)
    assert torch.equal(compare_codes(codes, flipped(op), c, lo, hi), COMPARISONS[op](c, numerics.dequantize(codes, s)))


def test_comparison_bounds_at_infinity_and_refusals() -> None:
    assert compare_range("gt", math.inf, 0.1) == (2**31, None)  # no code is greater
    assert compare_range("lt", math.inf, 0.1) == (None, 2**31 - 1)  # every code is less
    for bad in (math.nan, True, "1"):
        try:
            compare_range("gt", bad, 0.1)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            continue
        raise AssertionError(f"{bad!r} accepted")


@given(data=st.data(), s=f32, dt=dtypes, op=st.sampled_from(sorted(COMPARISONS)))
def test_trimmed_comparison_bounds_test_the_same_codes(data: st.DataObject, s: float, dt: DType, op: str) -> None:
    """compare_bounds (both conversions' constants) drops only bounds at or beyond the dtype's ends:
    the range test gives the same answer on every code of the dtype as compare_range's bounds."""
    c = data.draw(constants(s, dt))
    lo, hi = compare_bounds(op, c, torch.tensor([s]), dt)
    qmin, qmax = dt.qrange
    assert (lo is None or lo > qmin) and (hi is None or hi < qmax)
    codes = CODES[dt]
    assert torch.equal(compare_codes(codes, op, c, lo, hi), compare_codes(codes, op, c, *compare_range(op, c, s)))


def test_comparison_refusals_name_the_reason() -> None:
    """The checks module swapping and the quantize pass share: a float operand, two scales, a qint32
    operand and a non-number constant are refused with the fix; two qint8 codes on one scale pass."""
    s, t = torch.tensor([0.1]), torch.tensor([0.2])
    assert tensor_comparison_error([("x", s, DType.qint8), ("y", s.clone(), DType.qint16)]) is None
    assert "a float one" in str(tensor_comparison_error([("x", s, DType.qint8), ("y", None, None)]))
    assert "different scales (0.1 vs 0.2)" in str(
        tensor_comparison_error([("x", s, DType.qint8), ("y", t, DType.qint8)])
    )
    assert "operand 'y' is qint32" in str(tensor_comparison_error([("x", s, DType.qint8), ("y", s, DType.qint32)]))
    assert number_comparison_error(0.5) is None and number_comparison_error(3) is None
    assert "with bool True" in str(number_comparison_error(True))
    assert "with str" in str(number_comparison_error("1"))


@given(data=st.data(), s=f32, dt=dtypes)
def test_clamp_with_code_bounds_equals_the_fake_quant_of_the_float_clamp(
    data: st.DataObject, s: float, dt: DType
) -> None:
    lo_v = data.draw(st.none() | constants(s, dt))
    hi_v = data.draw(st.none() | constants(s, dt))
    assume(lo_v is not None or hi_v is not None)
    codes = CODES[dt]
    lo = None if lo_v is None else constant_code(lo_v, s, dt)
    hi = None if hi_v is None else constant_code(hi_v, s, dt)
    got = numerics.dequantize(clamp_codes(codes, lo, hi), s)
    want = _fq(torch.clamp(numerics.dequantize(codes, s), lo_v, hi_v), s, dt)  # also min > max: all max
    assert torch.equal(got, want)


@given(v=st.floats(allow_nan=False, allow_infinity=True, width=32), s=f32, dt=dtypes)
def test_constant_code_is_the_fake_quant_code(v: float, s: float, dt: DType) -> None:
    code = constant_code(v, s, dt)
    assert code == int(numerics.quantize(torch.tensor([v]), s, dt)[0])
    lo, hi = dt.qrange
    raw = rounded_code(v, s)
    assert (lo <= raw <= hi) == (raw == code)  # a pad value is representable exactly when it does not saturate


@given(s=f32, dt=dtypes)
def test_abs_on_codes_equals_the_fake_quant_of_abs(s: float, dt: DType) -> None:
    codes = CODES[dt]
    got = numerics.dequantize(abs_codes(codes), s)
    assert torch.equal(got, _fq(numerics.dequantize(codes, s).abs(), s, dt))
    assert int(abs_codes(codes[:1])[0]) == dt.qrange[1]  # the most negative code saturates


@given(
    s=f32, dt=dtypes, seed=st.integers(0, 2**16), spread=st.integers(1, 5), n=st.integers(1, 64), largest=st.booleans()
)
def test_selection_ties_on_codes_match_the_dequantized_values(
    s: float, dt: DType, seed: int, spread: int, n: int, largest: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-spread, spread + 1, (3, n), generator=g).to(dt.to_torch())  # many ties
    vals = numerics.dequantize(codes, s)
    for fn in (torch.argmax, torch.argmin):
        assert torch.equal(fn(codes, dim=1), fn(vals, dim=1)) and torch.equal(fn(codes), fn(vals))
    for fn2 in (torch.max, torch.min):
        assert torch.equal(fn2(codes, 1).indices, fn2(vals, 1).indices)
    k = max(1, n // 2)
    assert torch.equal(
        torch.topk(codes, k, dim=1, largest=largest).indices, torch.topk(vals, k, dim=1, largest=largest).indices
    )
