"""Softmax of qint16 codes has no integer form (the Bayes table takes qint8 softmax input only;
convert raises), so on the integer grid it stays float fake quantization, reported as such. Its QAT
forward is within a proven bound of the exact softmax of the same input, rounded to the output grid
(docs/semantics.md, "What stays float fake quantization in training")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.common.math_rules import SOFTMAX_EXP_SCALE
from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat_fx,
)
from qir.quantization.integer_grid import bind_integer_grid


class _Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.sm = nn.Softmax(dim=-1)
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.sm(self.quant(x)))


def _prepare(out16: bool) -> nn.Module:
    q16 = get_default_qat_qconfig(dtype="qint16")
    qconfig = {"": q16 if out16 else get_default_qat_qconfig(), "module_name": {"quant": q16}}
    with march_scope("bayes"):
        return prepare_qat_fx(_Softmax(), qconfig, example_inputs=(torch.randn(2, 8),)).train()


def bound_lsb(p: torch.Tensor, n: int, s_out: float) -> torch.Tensor:
    """Output LSBs between the QAT forward and ``round(softmax(x) / s_out)``, per element of
    probability ``p`` in a row of ``n``: the exp codes are within ``s_e / 2`` of ``exp(x - max)``
    (the row maximum's is exactly 1, so the sum is >= 1), which moves ``e_i / sum(e)`` by at most
    ``s_e / 2 * (1 + (n - 1) p_i)``; the two roundings to the output grid add one LSB, and float32
    arithmetic a few units of 2**-24."""
    return torch.floor((SOFTMAX_EXP_SCALE / 2 * (1 + (n - 1) * p) + 2**-22) / s_out) + 1


@pytest.mark.parametrize("out16", [False, True])
def test_qint16_softmax_is_reported_float_and_within_its_bound(out16: bool) -> None:
    qat = _prepare(out16)
    assert integer_grid_report(qat)["sm"] == "float fake quant"
    assert bind_integer_grid(qat, "bayes")["sm"] == "Softmax of qint16 codes has no integer form (qint8 only)"
    sm = qat.get_submodule("sm")
    g = torch.Generator().manual_seed(0)
    lo, hi = (-32768, 32767) if out16 else (-128, 127)
    worst = 0.0
    for n in (2, 7, 64, 300):
        for spread in (0.5, 4.0, 30.0):  # logits' std: flat rows to one dominant entry
            s_in = float(torch.tensor(spread * 3 / 32767, dtype=torch.float32))
            codes = (torch.randn(16, n, generator=g) * spread / s_in).round().clamp(-32768, 32767)
            x = (codes * s_in).to(torch.float32)
            if n == 300:  # one entry far above the rest: the sum is about 1, the worst case of the bound
                x[:, 0] = x.amax(dim=1) + 20 * spread
                x = ((x / s_in).round().clamp(-32768, 32767) * s_in).to(torch.float32)
            out = sm(x)
            s_out = float(sm.activation_post_process.scale)
            got = (out.to(torch.float64) / s_out).round()
            p = torch.softmax(x.to(torch.float64), dim=-1)
            want = torch.floor(p / s_out + 0.5).clamp(lo, hi)
            diff = (got - want).abs()
            assert bool((diff <= bound_lsb(p, n, s_out)).all()), (n, spread, float(diff.max()))
            worst = max(worst, float(diff.max()))
    if out16:
        assert worst >= 1  # the float path is not exact at qint16 resolution: the bound is what holds
    else:  # a qint8 output: at most 1 LSB for rows up to ~500 entries
        assert float(bound_lsb(torch.ones(()), 300, float(sm.activation_post_process.scale))) == 1


def test_convert_refuses_qint16_softmax_input() -> None:
    qat = _prepare(False)
    qat(torch.randn(2, 8))
    with march_scope("bayes"), pytest.raises(Exception, match="qint8"):
        convert_fx(qat)(torch.randn(2, 8))
