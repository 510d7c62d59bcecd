"""Numbers computed at run time times (or plus) a quantized tensor, as heads and attention
blocks write them: ``f * (1.0 / w)`` with ``w`` read from the feature's shape, the attention
scale ``q * (q.shape[-1] ** -0.5)``, an offset ``x + h / 4``. Prepare gives each a generated
FloatFunctional (``mul_scalar`` / ``add_scalar`` with the number as its second argument), the
converted model and the compiled program derive the integer multiplier from the number on each
call, as the plugin's quantized FloatFunctional does."""

from __future__ import annotations

import pytest
import torch
from names_flow import fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.quantization import DeQuantStub, QuantStub, compile_model, convert_fx, prepare_qat_fx
from qir.quantization.qconfig import get_default_qat_qconfig


class NormalizedHead(nn.Module):
    """A box head that divides by the feature width and shifts by a quarter of its height,
    and an attention-style projection scaled by 1 / sqrt(channels)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.reg = nn.Conv2d(c, 4, 1)
        self.q = nn.Conv2d(c, c, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = torch.relu(self.conv(self.quant(x)))
        h, w = f.shape[2], f.shape[3]
        box = self.reg(f) * (1.0 / w) + h / 4
        q = self.q(f)
        scaled = (q.shape[1] ** -0.5) * q  # the number on the left
        return self.dequant(box), self.dequant(scaled)


def _inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 3, 8, 12),)


@pytest.fixture(autouse=True)
def bayes() -> object:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_run_time_numbers_become_scalar_functionals() -> None:
    qat = prepare_qat_fx(NormalizedHead(), {"": get_default_qat_qconfig()})
    methods = [n.target for n in qat.graph.nodes if n.op == "call_method"]
    assert methods.count("mul_scalar") == 2 and methods.count("add_scalar") == 1
    x = _inputs()[0]
    with torch.no_grad():
        float_out = NormalizedHead()(x)
    assert len(float_out) == 2  # the float model runs as written


def test_calibrate_train_convert_check_compile_and_run_at_another_size() -> None:
    result = fx_flow(NormalizedHead(), _inputs)
    qat, converted = result.qat, result.converted
    lsb = max(float(m.scale) for n, m in qat.named_modules() if n.endswith("activation_post_process"))
    assert result.max_error() <= 2.01 * lsb  # QAT (validation) vs the integer model
    # the program reads 1 / w, h / 4 and c ** -0.5 from the shapes it runs on
    program = compile_model(converted, list(_inputs()))
    ops = [i.op for i in program.program.instructions]
    assert ops.count("mul_scalar_dynamic") == 2 and ops.count("add_scalar_dynamic") == 1
    other = torch.randn(3, 3, 8, 12)  # another batch
    for got, want in zip(program(other), converted(other), strict=True):
        assert torch.equal(got, want)
    # another feature size: other numbers, the same integer rule in both
    wide = torch.randn(1, 3, 6, 20)
    for got, want in zip(compile_model(converted, [wide])(wide), converted(wide), strict=True):
        assert torch.equal(got, want)


def test_a_scale_independent_of_sizes_still_folds_at_compile_time() -> None:
    class Fixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.conv(self.quant(x)) * 0.25)

    qat = prepare_qat_fx(Fixed(), {"": get_default_qat_qconfig()})
    x = torch.randn(2, 3, 4, 4)
    qat(x)
    qat.eval()
    converted = convert_fx(qat)
    program = compile_model(converted, [x])
    assert "mul_scalar_dynamic" not in [i.op for i in program.program.instructions]
    assert torch.equal(program(x), converted(x))


def test_division_by_a_number_becomes_a_product_with_its_reciprocal() -> None:
    class Divided(nn.Module):
        """Pretrained models divide by literals (``x / 2.0``) and by sizes (``f / w``)."""

        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            f = self.conv(self.quant(x))
            return self.dequant(f / 2.0), self.dequant(f / f.shape[-1])

    x = _inputs()[0]
    with torch.no_grad():
        want = Divided()(x)
    assert len(want) == 2  # the float model is unchanged
    qat = prepare_qat_fx(Divided(), {"": get_default_qat_qconfig()})
    assert [n.target for n in qat.graph.nodes if n.op == "call_method"].count("mul_scalar") == 2
    result = fx_flow(Divided(), _inputs)
    lsb = max(float(m.scale) for n, m in result.qat.named_modules() if n.endswith("activation_post_process"))
    assert result.max_error() <= 2.01 * lsb
