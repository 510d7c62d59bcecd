"""qint16 input to table-lookup ops: the segmented table (513 interpolated knots), its error in LSBs."""

from __future__ import annotations

import pytest
import torch
from nn_helpers import QC8, QC16
from torch import nn

import qir.nn as qnn
from backends.common.lut_segmented import KNOTS, SHIFT, lut_int16
from qir.ir.ops.integer_elementwise import KNOTS16
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
#: every torch activation that converts to a table, and some of qir.nn's unary modules
FUNCTIONS = [cls() for cls in LUT_FLOAT_CLASSES] + [qnn.Exp(), qnn.Sin(), qnn.Atan(), qnn.Erf()]


def _table(fmod: nn.Module, s_in: float, qconfig: object) -> quantized.UnaryLUT:
    m = qat.UnaryLUT.from_float(fmod, qconfig)  # type: ignore[arg-type]
    m.eval()
    m(CODES.float() * s_in)
    disable_observer(m)
    return quantized.UnaryLUT.from_qat(m, [torch.tensor([s_in])], "bayes")


@pytest.mark.parametrize("fmod", FUNCTIONS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize(("amax", "qconfig"), [(6.0, QC8), (6.0, QC16), (2.0, QC16)], ids=["8", "16", "16-narrow"])
def test_error_in_lsb_against_float(fmod: nn.Module, amax: float, qconfig: object) -> None:
    s_in = amax / 32767.5
    q = _table(fmod, s_in, qconfig)
    y = q(CODES)
    assert y.dtype == q.dtype.to_torch() and q.table16.numel() == KNOTS == KNOTS16
    fn = qat.UnaryLUT.from_float(fmod, qconfig).function()  # type: ignore[arg-type]
    s_out = float(q.scale[0])
    measured = lut_int16(fn, s_in, s_out, q.dtype)
    assert torch.equal(measured.entries, q.table16)
    lo, hi = q.dtype.qrange
    x = CODES.double() * float(torch.tensor(s_in, dtype=torch.float32))
    ideal = (fn(x) / s_out).clamp(lo, hi)
    err = float((y.double() - ideal).abs().max())
    assert err == pytest.approx(measured.max_error_lsb)
    # 1 LSB of rounding (knots and interpolation) plus linear interpolation's h^2/8 * max|f''| over 128 codes
    f = fn(x)
    f2 = float(((f[2:] - 2 * f[1:-1] + f[:-2]).abs() / float(x[1] - x[0]) ** 2).max())
    h = float(x[1 << SHIFT] - x[0])
    bound = 1.0 + h * h / 8 * f2 / s_out
    assert err <= bound + 1e-9
    if q.dtype.name == "qint8":
        assert err <= 1.0 + 1e-9


def test_the_integer_rule() -> None:
    m = _table(nn.Sigmoid(), 8 / 32767.5, QC16)
    e = m.table16.to(torch.int64)
    assert torch.equal(m.table16, lut_int16(torch.sigmoid, 8 / 32767.5, float(m.scale[0]), "qint16").entries)
    q = torch.tensor([-32768, -32641, 0, 100, 32767])
    d = q + 32768
    j, r = d >> 7, d & 127
    want = (e[j] + (((e[j + 1] - e[j]) * r + 64) >> 7)).clamp(-32768, 32767)
    assert torch.equal(m(q.to(torch.int16)).to(torch.int64), want)
    assert int(e[-1]) > 32767  # the knot past the range is not saturated: the last interval interpolates to it


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
