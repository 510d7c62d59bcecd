"""Dropout in front of integer-grid ops during QAT: dropout rescales by ``1/(1-p)``, so its output
leaves the input fake quant's grid and range. Grid ops read it as that fake quant would re-quantize
it (saturated codes) instead of indexing a table past its end; with dropout off (eval, p=0) the
forward is still the converted model, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.ao.nn.quantized import FloatFunctional

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    integer_grid_report,
    prepare_qat_fx,
)


class _Net(nn.Module):
    """Dropout before a table lookup, a softmax and a FloatFunctional add."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.q = QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.drop = nn.Dropout(p)
        self.sig = nn.Sigmoid()
        self.drop2 = nn.Dropout(p)
        self.soft = nn.Softmax(dim=1)
        self.add = FloatFunctional()
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.q(x))
        a = self.sig(self.drop(y))
        b = self.soft(self.drop2(y))
        return self.dq(self.add.add(a, b))


def _prepare(march: str, p: float) -> nn.Module:
    torch.manual_seed(0)
    with march_scope(march):
        return prepare_qat_fx(_Net(p), {"": get_default_qat_qconfig()}, example_inputs=(torch.randn(2, 3, 8, 8),))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("p", [0.5, 0.3])
def test_training_steps_with_dropout_before_grid_ops(march: str, p: float) -> None:
    qat = _prepare(march, p).train()
    report = integer_grid_report(qat)
    assert report.get("sig") == "grid" and report.get("add") == "grid", report
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05)
    for _ in range(3):
        out = qat(torch.randn(2, 3, 8, 8, generator=g) * 4)
        assert bool(torch.isfinite(out).all())
        scale = float(qat.add.activation_post_process.scale.reshape(-1)[0])
        codes = out.detach() / scale
        assert torch.equal(codes.round(), codes.round().clamp(-128, 127))
        opt.zero_grad()
        out.square().mean().backward()
        assert qat.conv.weight.grad is not None and bool(torch.isfinite(qat.conv.weight.grad).all())
        opt.step()
    # dropout off: the forward is the converted model again
    qat.eval()
    x = torch.randn(2, 3, 8, 8, generator=g) * 4
    out = qat(x)  # observers still see this batch: convert the state after it
    with march_scope(march):
        want = convert_fx(qat)(x)
    assert torch.equal(out, want)


def test_training_forward_without_dropout_is_the_converted_model() -> None:
    qat = _prepare("bayes", 0.0).train()
    x = torch.randn(2, 3, 8, 8) * 4
    out = qat(x)
    with march_scope("bayes"):
        want = convert_fx(qat)(x)
    assert torch.equal(out, want)
