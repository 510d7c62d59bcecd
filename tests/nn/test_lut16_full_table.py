"""A converted UnaryLUT looks qint16 codes up in its segmented table evaluated at every code: the same
codes as interpolating through the knots, rebuilt when the table is written in place or replaced."""

from __future__ import annotations

import copy

import torch
from torch import nn

from backends.common.lut_segmented import lut_int16, lut_int16_apply
from qir.march import march_scope
from qir.quantization import DeQuantStub, QuantStub, convert_fx, get_default_qat_qconfig, prepare_qat_fx

_CODES = torch.arange(-32768, 32768, dtype=torch.int64).to(torch.int16)


class _Tanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.tanh = nn.Tanh()
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.tanh(self.quant(x)))


def _lut() -> nn.Module:
    q16 = get_default_qat_qconfig(dtype="qint16")
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Tanh(), {"": q16}, example_inputs=(torch.randn(2, 8),))
        qat(torch.randn(4, 8) * 3)
        return convert_fx(qat).get_submodule("tanh")


def test_every_code_is_the_interpolation_and_edits_rebuild() -> None:
    lut = _lut()
    assert lut.table16_version == 2
    assert torch.equal(lut(_CODES), lut_int16_apply(lut.table16, _CODES, lut.dtype, 2))
    with torch.no_grad():
        lut.table16[1] //= 2  # written in place: the next call evaluates the new knots
    assert torch.equal(lut(_CODES), lut_int16_apply(lut.table16, _CODES, lut.dtype, 2))
    other = lut_int16(torch.sigmoid, lut.per_tensor_input(0), float(lut.scale[0]), lut.dtype).entries
    lut.table16 = other  # replaced
    assert torch.equal(lut(_CODES), lut_int16_apply(other, _CODES, lut.dtype, 2))
    twin = copy.deepcopy(lut)
    with torch.no_grad():
        twin.table16[1] += 1
    assert torch.equal(twin(_CODES), lut_int16_apply(twin.table16, _CODES, twin.dtype, 2))
    assert torch.equal(lut(_CODES), lut_int16_apply(other, _CODES, lut.dtype, 2))  # the original kept its own
    codes = torch.randint(-32768, 32768, (3, 5, 7), dtype=torch.int16)
    assert torch.equal(lut(codes), lut_int16_apply(other, codes, lut.dtype, 2))
