"""prepare_qat_fx refuses a quantized value at an argument a QAT module takes in float (an attention
mask behind a QuantStub): convert_fx refused it only after training ('expected 3 input scale(s), got 4')."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

from qir.march import March, set_march
from qir.quantization import convert_fx, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.prepare_checks import UnconvertibleModelError


class MaskedAttention(nn.Module):
    def __init__(self, quantize_mask: bool) -> None:
        super().__init__()
        self.quantize_mask = quantize_mask
        self.q, self.qm, self.dq = QuantStub(), QuantStub(), DeQuantStub()
        self.sa = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = self.q(t)
        m = self.qm(mask) if self.quantize_mask else mask
        return self.dq(self.sa(t, t, t, attn_mask=m)[0])


@pytest.fixture(autouse=True)
def _bayes() -> Any:
    set_march(March.BAYES)
    yield


_t, _mask = torch.rand(2, 5, 16), torch.triu(torch.full((5, 5), -100.0), 1)


def test_a_quantized_attention_mask_is_refused_at_prepare() -> None:
    with pytest.raises(
        UnconvertibleModelError,
        match=r"module 'sa' \(MultiheadAttention\) takes argument 'attn_mask' "
        r"in float, but it receives quantized node 'qm'.*Pass that argument in float",
    ) as e:
        prepare_qat_fx(MaskedAttention(True), {"": get_default_qat_qconfig()})
    assert e.value.where == "sa"


def test_a_float_attention_mask_prepares_and_converts() -> None:
    torch.manual_seed(0)
    qat = prepare_qat_fx(MaskedAttention(False), {"": get_default_qat_qconfig()})
    qat(_t, _mask)
    q = convert_fx(qat.eval())
    assert q(_t, _mask).shape == (2, 5, 16)
