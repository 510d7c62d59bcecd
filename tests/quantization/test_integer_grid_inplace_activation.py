"""An activation built with ``inplace=True`` (torchvision's Hardswish, SiLU, ...) trains on the grid it deploys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qir.march import march_scope
from qir.quantization import DeQuantStub, QuantStub, convert_fx, get_default_qat_qconfig, prepare_qat_fx


@pytest.mark.filterwarnings("ignore:.*runs under eval\\(\\) in QAT fake-quant state")
@pytest.mark.parametrize("act", [nn.Hardswish, nn.Hardsigmoid, nn.SiLU, nn.ELU])
@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_an_inplace_table_activation_computes_what_convert_computes(act: type[nn.Module], march: str) -> None:
    torch.manual_seed(0)
    float_act = act(inplace=True)  # type: ignore[call-arg]
    model = nn.Sequential(QuantStub(), nn.Conv2d(3, 8, 3, padding=1), float_act, nn.Conv2d(8, 4, 1), DeQuantStub())
    x = torch.randn(2, 3, 8, 8)
    with march_scope(march):
        qat = prepare_qat_fx(model.eval(), {"": get_default_qat_qconfig()})
        qat.train()
        qat(x)
        qat.eval()
        with torch.no_grad():
            got = qat(x)  # QAT state, on the integer grid: observes, then computes with the new scales
            want = convert_fx(qat)(x)
    # the grid forward evaluated f in place on its input and then tabulated f(f(x)): 0.35 apart
    assert torch.equal(got, want), float((got - want).abs().max())
    assert float_act.inplace  # the user's module is not changed
