"""FloatFunctional methods called with a Python number: add / sub / mul run as add_scalar /
mul_scalar in the QAT and converted models (exactly alike); other methods refuse the number by
name; the float model and the emitted float graph keep the user's operand order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qir
from qir.frontend import emit, trace
from qir.nn.modules.functional import FloatFunctional, number_operand_error, scalar_form
from qir.quantization import (
    DeQuantStub,
    FakeQuantState,
    QuantStub,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.prepare import PREPARE_BY_PASS, PREPARE_PATH_KEY
from tests.quantization.path_op_nets import NumberOperands


def test_scalar_forms() -> None:
    t = torch.ones(2)
    assert scalar_form("add", (t, 2.0), {}) == ("add_scalar", t, 2.0)
    assert scalar_form("add", (2, t), {}) == ("add_scalar", t, 2.0)  # commutative: either side
    assert scalar_form("sub", (t,), {"y": 0.5}) == ("add_scalar", t, -0.5)
    assert scalar_form("mul", (3.0, t), {}) == ("mul_scalar", t, 3.0)
    assert scalar_form("sub", (2.0, t), {}) is None  # 2 - y is not a scalar method
    assert scalar_form("add", (t, t), {}) is None
    assert scalar_form("add", (t, True), {}) is None  # a bool is not a number here
    assert number_operand_error("add", (t, 2.0), {}) is None
    assert number_operand_error("add", (t, t), {}) is None
    why = number_operand_error("sub", (2.0, t), {})
    assert why is not None and "FloatFunctional.sub got the number 2.0 as its operand x" in why
    why = number_operand_error("maximum", (t,), {"y": 1})
    assert why is not None and "as its operand y" in why


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_number_operands_train_and_convert_exactly(march: str) -> None:
    qir.set_march(march)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    qat = prepare_qat_fx(NumberOperands(), {"": get_default_qat_qconfig()}, x)
    assert qat.meta[PREPARE_PATH_KEY] == PREPARE_BY_PASS
    called = {(n.target, n.args[0].target) for n in qat.graph.nodes if n.op == "call_method"}
    assert called == {("add_scalar", "add"), ("add_scalar", "sub"), ("mul_scalar", "mul"), ("add_scalar", "radd")}
    for _ in range(2):
        qat(torch.randn(2, 3, 16, 16) * 2)
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    qat.eval()
    assert torch.equal(convert_fx(qat)(x), qat(x))
    float_model = NumberOperands().eval()
    torch.manual_seed(0)
    y = float_model.conv(x)
    assert torch.allclose(float_model(x), ((y + 2.0) - 0.5) * 3.0 + 1.5)


class _NumberMinusTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.ff = nn.Conv2d(3, 4, 3), FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.ff.sub(2.0, self.conv(self.quant(x))))


def test_a_number_minus_a_tensor_is_refused_by_name_not_reversed() -> None:
    qir.set_march("bayes")
    model = _NumberMinusTensor()
    x = torch.randn(1, 3, 8, 8)
    # the float graph emitted from the IR keeps 2.0 - y (it once emitted y - 2.0)
    gm = emit(trace(model, (x,)))
    assert torch.equal(gm(x), model(x))
    qat = prepare_qat_fx(model, {"": get_default_qat_qconfig()}, x)
    with pytest.raises(TypeError, match=r"FloatFunctional.sub got the number 2.0 as its operand x.*add_scalar"):
        qat(x)
