"""check_model names a conv / linear fused with the FloatFunctional add after it by the layer's path."""

from __future__ import annotations

import torch
from torch import nn
from torch.ao.nn.quantized import FloatFunctional

from qir.march import march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


class LinearThenAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.fc = nn.Linear(8, 8)
        self.add = FloatFunctional()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        return self.dequant(self.add.add(self.fc(x), x))


def test_a_linear_fused_with_the_add_after_it_is_reported_as_the_linear() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    with march_scope("bernoulli2"):  # no Linear on Bernoulli2: the fused layer is a finding
        model = LinearThenAdd().eval()
        qat = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
        assert type(qat.add).__name__ == "LinearAdd"  # the fused layer sits in the add's slot
        qat(x)
        set_fake_quantize(qat, "validation")
        converted = convert_fx(qat)
        for subject in (model, qat, converted):
            report = check_model(subject, x, advice=1)
            rows = [(f.module, f.spelling) for f in report.violations]
            assert rows == [("fc", "torch.nn.Linear")], (type(subject).__name__, rows)
            (finding,) = report.violations
            assert any("'module_name': ['fc']" in a for a in finding.advice), finding.advice
