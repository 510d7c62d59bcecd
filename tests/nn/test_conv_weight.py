"""qir.nn.quantized.conv_weight: a weight's observation, codes and L1 norms in one native pass give the
torch path's scale and codes bit for bit, remember the codes' exact L1 norms, and write no state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qir.nn.quantized.conv_weight as cw
from backends.common.kernels import native
from qir.ir.numerics import abs_sums
from qir.ir.types import DType
from qir.quantization import get_default_qat_qconfig
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.observer import (
    MinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
)

needs_native = pytest.mark.skipif(native.library() is None, reason=f"no native kernels: {native.status()}")

#: the weight fake quants the tests convert with: name -> factory
FAKE_QUANTS = {
    "default": lambda dtype: get_default_qat_qconfig(weight_qkwargs={"dtype": dtype}).weight(),
    "min_max": lambda dtype: FakeQuantize(observer=MinMaxObserver, dtype=dtype, ch_axis=0),
    "moving_average": lambda dtype: FakeQuantize(
        observer=MovingAveragePerChannelMinMaxObserver, dtype=dtype, ch_axis=0, averaging_constant=0.5
    ),
    "per_tensor": lambda dtype: FakeQuantize(observer=MovingAveragePerTensorMinMaxObserver, dtype=dtype),
}


@st.composite
def weights(draw: st.DrawFn) -> torch.Tensor:
    """A float32 weight of 1-6 output channels, its values at one of many magnitudes, with signed
    zeros, halves and repeated values sprinkled in, some rows of one sign (values from a drawn seed:
    drawing each float costs hypothesis more than the test)."""
    rows, k = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    w = torch.rand(rows, k, generator=g) * 2 - 1
    special = torch.tensor([0.0, -0.0, 0.5, -0.5, 1.0, -1.0])
    at = torch.rand(rows, k, generator=g) < draw(st.sampled_from([0.0, 0.2, 0.8]))
    w = torch.where(at, special[torch.randint(0, 6, (rows, k), generator=g)], w)
    w = w * torch.tensor(10.0 ** draw(st.integers(-36, 37)), dtype=torch.float32)
    if draw(st.booleans()):
        w = w.abs() * draw(st.sampled_from([1.0, -1.0]))  # every row of one sign
    return w.reshape(rows, 1, k, 1) if draw(st.booleans()) else w


def _both(fq: FakeQuantize, w: torch.Tensor) -> tuple[tuple, tuple]:
    out = []
    for on in (True, False):
        cw.NATIVE = on
        try:
            out.append(cw.weight_codes(fq, w, "Conv2d", 0))
        finally:
            cw.NATIVE = True
    return out[0], out[1]


def _assert_same(a: tuple, b: tuple) -> None:
    (s1, d1, c1), (s2, d2, c2) = a, b
    assert d1 is d2 and s1.dtype == s2.dtype and s1.shape == s2.shape
    assert torch.equal(s1.view(torch.int32), s2.view(torch.int32)), (s1, s2)  # bits: NaN scales too
    assert c1.dtype == c2.dtype and torch.equal(c1, c2)
    want = c2.reshape(c2.shape[0], -1).to(torch.int64).abs().sum(1)
    assert torch.equal(abs_sums(c1, 0), want) and torch.equal(abs_sums(c2, 0), want)


@needs_native
@settings(max_examples=100)  # each example converts twice; 100 cover the modes and dtypes many times
@given(w=weights(), previous=weights(), kind=st.sampled_from(sorted(FAKE_QUANTS)), wide=st.booleans())
def test_the_native_pass_gives_the_torch_paths_scale_and_codes(
    w: torch.Tensor, previous: torch.Tensor, kind: str, wide: bool
) -> None:
    fq = FAKE_QUANTS[kind]("qint16" if wide else "qint8")
    prev = previous[: w.shape[0]]
    if prev.shape[0] == w.shape[0]:
        fq(prev.reshape(prev.shape[0], -1).repeat(1, 2))  # a QAT step's weight: the observer's state
    before = {k: (v.clone(), v._version) for k, v in fq.state_dict().items()}
    native_out, torch_out = _both(fq, w)
    _assert_same(native_out, torch_out)
    for k, v in fq.state_dict().items():  # nothing written, on either path
        assert torch.equal(v, before[k][0]) and v._version == before[k][1]


@needs_native
def test_the_default_weight_fake_quant_is_observed_in_the_native_pass() -> None:
    """The fused pass (observation included) runs for the default qconfig's settled weight fake quant
    and for a running min / max; the others get the torch observation, then the native codes."""
    torch.manual_seed(0)
    w = torch.randn(8, 3, 3, 3)
    for kind, fused in (("default", True), ("min_max", True), ("moving_average", False), ("per_tensor", False)):
        fq = FAKE_QUANTS[kind]("qint8")
        fq(w * 0.5)
        assert (cw._observed_natively(fq, w, 0) is not None) is fused, kind
        native_out, torch_out = _both(fq, w)
        _assert_same(native_out, torch_out)
        assert cw.native_weight_codes(w, torch_out[0], DType.qint8, 0 if torch_out[0].numel() > 1 else None) is not None


@needs_native
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_weight_the_native_pass_does_not_cover_takes_the_torch_path(bad: float) -> None:
    torch.manual_seed(0)
    fq = FAKE_QUANTS["default"]("qint8")
    fq(torch.randn(4, 6))
    w = torch.randn(4, 6)
    w[2, 3] = bad
    assert cw._observed_natively(fq, w, 0) is None
    assert cw.native_weight_codes(w, torch.ones(4), DType.qint8, 0) is None
    native_out, torch_out = _both(fq, w)
    assert torch.equal(native_out[0], torch_out[0]) and torch.equal(native_out[2], torch_out[2])


@needs_native
def test_observer_states_and_calls_outside_the_plain_update_take_the_torch_observation() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 6)
    fresh = FAKE_QUANTS["default"]("qint8")  # never observed: the observer's first-batch path
    assert cw._observed_natively(fresh, w, 0) is None
    hooked = FAKE_QUANTS["default"]("qint8")
    hooked(w)
    calls: list[int] = []
    hooked.observer.register_forward_hook(lambda *a: calls.append(1))
    assert cw._observed_natively(hooked, w, 0) is None
    cw.weight_codes(hooked, w, "Linear", 0)
    assert calls == [1]  # the observer ran as a module, its hook with it
    far = FAKE_QUANTS["default"]("qint8")
    far(torch.full((4, 6), 3e38))
    huge = torch.full((4, 6), -3e38)  # new - old overflows: lerp(old, new, 1) is NaN, not new
    assert cw._observed_natively(far, huge, 0) is None
    _assert_same(*_both(far, huge))
    transposed = FAKE_QUANTS["default"]("qint8")
    transposed(w)
    assert cw._observed_natively(transposed, w, 1) is None  # channels along axis 1 (a transposed conv)
    assert cw._observed_natively(transposed, w.t().contiguous().t(), 0) is None  # not contiguous


def test_native_codes_refuse_scales_torch_must_decide() -> None:
    w = torch.randn(3, 5)
    for scale in (
        torch.tensor([1.0, 0.0, 1.0]),
        torch.tensor([1.0, math.nan, 1.0]),
        torch.ones(3, dtype=torch.float64),
    ):
        assert cw.native_weight_codes(w, scale, DType.qint8, 0) is None
    assert cw.native_weight_codes(w.double(), torch.ones(3), DType.qint8, 0) is None
    assert cw.native_weight_codes(w, torch.ones(3), DType.qint32, 0) is None


@needs_native
def test_ties_round_half_up_as_numerics_quantize() -> None:
    """Quotients exactly half-way (and just below half-way: 0.5 - 2**-25, which float32 w / s + 0.5
    rounds up) against numerics.quantize."""
    from qir.ir.numerics import quantize

    s = torch.tensor([0.25, 3.0, 1e-6], dtype=torch.float32)
    below = float(np.nextafter(np.float32(0.5), np.float32(0.0)))
    q = torch.tensor([-128.5, -2.5, -0.5, 0.5, 1.5, 126.5, 127.5, below, -below, 0.0], dtype=torch.float32)
    w = (q[None, :] * s[:, None]).contiguous()
    got = cw.native_weight_codes(w, s, DType.qint8, 0)
    assert got is not None and torch.equal(got, quantize(w, s, DType.qint8, axis=0))


@needs_native
@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
def test_rows_longer_than_the_kernels_sum_blocks(dtype: str) -> None:
    """The kernel sums |codes| in int32 over blocks of 2**15 values: a row of 70,000 (a wide linear's
    input) crosses two block boundaries."""
    torch.manual_seed(0)
    fq = FAKE_QUANTS["default"](dtype)
    fq(torch.randn(2, 70_000))
    w = torch.randn(2, 70_000)
    w[0] = w[0].abs() * 1e3  # every code of row 0 near the top of the range: the largest sums
    assert cw._observed_natively(fq, w, 0) is not None
    _assert_same(*_both(fq, w))
