"""qint16 input to table-lookup ops: the segmented table (knots by an error bound, interpolated; the
version-1 uniform 513 knots still read), its error in LSBs."""

from __future__ import annotations

import itertools

import pytest
import torch
from nn_helpers import QC8, QC16
from torch import nn

import qir.nn as qnn
from backends.common.lut_segmented import KNOT_BUDGET, KNOTS, SHIFT, lut_int16, lut_int16_apply, method_table16
from qir.ir.numerics import round_half_up
from qir.ir.ops.integer_elementwise import KNOTS16
from qir.ir.table16 import LATEST, table16_problem
from qir.ir.types import DType
from qir.march import march_scope
from qir.nn import qat, quantized
from qir.nn.qat import LUT_FLOAT_CLASSES
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    disable_observer,
    float_fake_quant,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

CODES = torch.arange(-32768, 32768, dtype=torch.int16)
#: the version-1 knots
UNIFORM = -32768 + 128 * torch.arange(KNOTS, dtype=torch.int64)
#: every torch activation that converts to a table, and some of qir.nn's unary modules
FUNCTIONS = [cls() for cls in LUT_FLOAT_CLASSES] + [qnn.Exp(), qnn.Sin(), qnn.Atan(), qnn.Erf()]


def _table(fmod: nn.Module, s_in: float, qconfig: object) -> quantized.UnaryLUT:
    m = qat.UnaryLUT.from_float(fmod, qconfig)  # type: ignore[arg-type]
    m.eval()
    m(CODES.float() * s_in)
    disable_observer(m)
    return quantized.UnaryLUT.from_qat(m, [torch.tensor([s_in])], "bayes")


def _interval_bounds(fn: object, s_in: float, s_out: float, dt: object, knots: torch.Tensor) -> torch.Tensor:
    """Per interval of ``knots``: ``w**2 / 8 * max|D2 g|`` over its inner codes, ``g`` the clamped ideal."""
    lo, hi = dt.qrange  # type: ignore[attr-defined]
    codes = torch.arange(-32768, 32769, dtype=torch.float64)
    g = (fn(codes * float(torch.tensor(s_in, dtype=torch.float32))) / s_out).clamp(lo, hi)  # type: ignore[operator]
    d2 = torch.zeros_like(g)
    d2[1:-1] = (g[2:] - 2 * g[1:-1] + g[:-2]).abs()
    pairs = list(itertools.pairwise(knots.tolist()))
    inner = [d2[a + 32768 + 1 : b + 32768] for a, b in pairs]
    return torch.tensor(
        [(b - a) ** 2 / 8 * float(t.max()) if t.numel() else 0.0 for (a, b), t in zip(pairs, inner, strict=True)]
    )


@pytest.mark.parametrize("fmod", FUNCTIONS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize(("amax", "qconfig"), [(6.0, QC8), (6.0, QC16), (2.0, QC16)], ids=["8", "16", "16-narrow"])
def test_error_in_lsb_against_float(fmod: nn.Module, amax: float, qconfig: object) -> None:
    s_in = amax / 32767.5
    q = _table(fmod, s_in, qconfig)
    y = q(CODES)
    assert y.dtype == q.dtype.to_torch() and q.table16_version == LATEST == 2
    knots = q.table16[0].to(torch.int64)
    assert q.table16.shape[0] == 2 and 2 <= q.table16.shape[1] <= KNOT_BUDGET + 1
    assert table16_problem(q.table16, 2, q.dtype) is None
    fn = qat.UnaryLUT.from_float(fmod, qconfig).function()  # type: ignore[arg-type]
    s_out = float(q.scale[0])
    measured = lut_int16(fn, s_in, s_out, q.dtype)
    assert torch.equal(measured.entries, q.table16) and measured.version == 2
    lo, hi = q.dtype.qrange
    x = CODES.double() * float(torch.tensor(s_in, dtype=torch.float32))
    ideal = (fn(x) / s_out).clamp(lo, hi)
    err = float((y.double() - ideal).abs().max())
    assert err == pytest.approx(measured.max_error_lsb)
    # 1 LSB of rounding (knots and interpolation) plus each interval's interpolation bound
    bounds = _interval_bounds(fn, s_in, s_out, q.dtype, knots)
    assert err <= 1.0 + float(bounds.max()) + 1e-9
    if q.dtype.name == "qint8":
        assert err <= 1.0 + 1e-9
    # the knots went where the bound is largest: no interval, split in two, would beat the worst
    # unsplit one by enough to pay for a knot (a split divides an interval's bound by >= 4)
    v1 = lut_int16(fn, s_in, s_out, q.dtype, version=1)
    assert float(bounds.max()) <= float(_interval_bounds(fn, s_in, s_out, q.dtype, UNIFORM).max()) + 1e-9
    assert err <= v1.max_error_lsb + 0.25


def test_the_integer_rule() -> None:
    m = _table(nn.Sigmoid(), 8 / 32767.5, QC16)
    assert torch.equal(m.table16, lut_int16(torch.sigmoid, 8 / 32767.5, float(m.scale[0]), "qint16").entries)
    k, t = m.table16.to(torch.int64)
    widths = (k[1:] - k[:-1]).tolist()
    assert all(w & (w - 1) == 0 for w in widths) and k[0] == -32768 and k[-1] == 32768
    assert min(widths) < 128 < max(widths)  # dense where sigmoid curves, sparse where it is flat
    q = torch.tensor([-32768, -32641, -1, 0, 1, 100, 4097, 32767])
    want = []
    for c in q.tolist():
        j = max(i for i in range(len(widths)) if int(k[i]) <= c)
        w, r = widths[j], c - int(k[j])
        want.append(int(t[j]) + ((int(t[j + 1] - t[j]) * r + w // 2) // w))
    assert m(q.to(torch.int16)).tolist() == want
    assert int(t.min()) >= -32768 and int(t.max()) <= 32767  # version 2 knots lie in the output range


def test_version_1_tables_compute_what_they_did() -> None:
    """A module converted before the table format had a version (its class default) and a version-1
    table: the uniform 513 knots and their rule, unchanged."""
    s_in, s_out = 8 / 32767.5, 1 / 32767.5
    v1 = lut_int16(torch.tanh, s_in, s_out, "qint16", version=1)
    e = v1.entries.to(torch.int64)
    assert v1.entries.shape == (KNOTS,) == (KNOTS16,) and v1.version == 1
    assert torch.equal(e, round_half_up(torch.tanh(UNIFORM.double() * s_in) / s_out).clamp(-(2**24), 2**24))
    m = _table(nn.Tanh(), s_in, QC16)
    m.register_buffer("table16", v1.entries)
    del m.table16_version  # a pickle from before the attribute: the class default
    assert m.table16_version == 1
    q = CODES.to(torch.int64)
    d = q + 32768
    j, r = d >> SHIFT, d & 127
    want = (e[j] + (((e[j + 1] - e[j]) * r + 64) >> 7)).clamp(-32768, 32767)
    m._set_scales([torch.tensor([s_in])], torch.tensor([s_out]), DType.qint16)
    assert torch.equal(m(CODES).to(torch.int64), want)
    assert v1.max_error_lsb > 3.9  # tanh at input range 8, qint16 out: what the uniform knots cost
    v2 = lut_int16(torch.tanh, s_in, s_out, "qint16")
    assert v2.max_error_lsb < 1.3
    with pytest.raises(ValueError, match="version-1 table16 holds 513"):
        lut_int16_apply(v2.entries, q, "qint16", 1)
    with pytest.raises(ValueError, match="version-2 table16 is"):
        lut_int16_apply(v1.entries, q, "qint16", 2)


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + 2.0)  # defined on a qint8 range at scale 0.01, not on the qint16 one


def test_undefined_on_the_qint16_range_is_refused_at_qint16_input_only() -> None:
    with pytest.raises(ValueError, match="NaN on the qint16 input range"):
        lut_int16(torch.log, 0.01, 0.01)
    m = qat.UnaryLUT(_Log(), QC8.activation())
    m.eval()
    m(torch.tensor([0.5, 1.0]))
    disable_observer(m)
    q = quantized.UnaryLUT.from_qat(m, [torch.tensor([0.01])], "bayes")
    assert q.table16.numel() == 0
    with pytest.raises(NotImplementedError, match="_Log: the function is undefined"):
        q(torch.tensor([1, 5], dtype=torch.int16))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.Hardsigmoid()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.act(self.conv(self.quant(x))))


def test_qint16_hardsigmoid_in_a_model() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 6)
    with march_scope("bayes"):
        m = prepare_qat_fx(
            _Net().eval(),
            {"": get_default_qat_qconfig(), "module_name": {"conv": get_default_qat_qconfig(dtype="qint16")}},
        )
        m(x)
        set_fake_quantize(m, "validation")
        converted = convert_fx(m)
    lut = converted.get_submodule("act")
    assert isinstance(lut, quantized.UnaryLUT)
    with torch.no_grad():
        out = converted(x)
        assert torch.equal(m(x), out)  # validation is the deployed model, qint16 table included
        with float_fake_quant():
            sim = m(x)
    s_out = float(lut.scale[0])
    bound = lut_int16(nn.Hardsigmoid(), float(lut.input_scale_0[0]), s_out, lut.dtype).max_error_lsb
    assert float((out - sim).abs().max()) / s_out <= bound + 1.0 + 1e-6


@pytest.mark.parametrize("method", ["ceil", "floor"])
@pytest.mark.parametrize("amax", [3.0, 8.0, 100.0])
@pytest.mark.parametrize("dt", ["qint8", "qint16"])
def test_step_functions_get_exact_tables(method: str, amax: float, dt: str) -> None:
    """ceil / floor of qint16 codes: every jump its own interval, so every code's result is the
    rounding of the function at the output scale (what the 256-entry table is for qint8 codes)."""
    fn = getattr(torch, method)
    s_in = amax / 32767.5
    s_out = (amax + 1) / (127.5 if dt == "qint8" else 32767.5)
    knots = method_table16(method, fn, s_in, s_out, dt, 2)
    assert knots is not None and table16_problem(knots, 2, DType.parse(dt)) is None
    lo, hi = DType.parse(dt).qrange
    x = CODES.double() * float(torch.tensor(s_in, dtype=torch.float32))
    ideal = torch.floor(fn(x) / float(torch.tensor(s_out, dtype=torch.float32)) + 0.5).clamp(lo, hi)
    assert torch.equal(lut_int16_apply(knots, CODES, dt, 2).double(), ideal)
    jumps = int((fn(x)[1:] != fn(x)[:-1]).sum())
    assert knots.shape[1] <= 2 + 2 * 16 * (jumps + 1)  # about 16 knots per jump, flat stretches one interval
    assert method_table16(method, fn, s_in, s_out, dt, 1) is None  # version 1 interpolates across the jumps
