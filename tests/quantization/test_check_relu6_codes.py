"""check_model judges a converted model's relu6 (``relu6_codes`` on codes) as the relu6 it computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.quantization import DeQuantStub, QuantStub

from qir.march import March, march_scope
from qir.quantization import check_model, convert_fx, get_default_qat_qconfig, prepare_qat_fx, set_fake_quantize


class PoolRelu6(nn.Module):
    """relu6 after a pool: nothing to fuse it into, so the converted graph calls relu6_codes."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(F.relu6(F.max_pool2d(self.conv(self.quant(x)), 2)))


@pytest.mark.parametrize(("march", "legal"), [(March.BERNOULLI2, False), (March.BAYES, True)])
def test_converted_relu6_has_the_float_verdict(march: March, legal: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    with march_scope(march):
        qat = prepare_qat_fx(PoolRelu6(), {"": get_default_qat_qconfig()})
        qat(x)
        set_fake_quantize(qat, "validation")
        converted = convert_fx(qat)
        assert any("relu6_codes" in str(n.target) for n in converted.graph.nodes)
        for model in (PoolRelu6(), converted):
            report = check_model(model, x)
            assert report.ok is legal
            assert [v.op for v in report.violations] == ([] if legal else ["relu6"])
            assert not report.unknown  # relu6_codes used to be "unknown" to the check
