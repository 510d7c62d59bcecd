"""Plugin module signatures users call: FloatFunctional.matmul(x, y, x_trans, y_trans), ceil / floor /
concatenate, and LayerNorm(normalized_shape, dim=1), each through prepare -> convert -> check -> compile."""

import pytest
import torch
from torch import nn

import qir
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


def _flow(model: nn.Module, make_inputs, steps: int = 4):  # type: ignore[no-untyped-def]
    qat = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
    for _ in range(steps):
        qat(*make_inputs())
    set_fake_quantize(qat, "validation")  # frozen scales: the QAT model is compared with the integer one
    inputs = make_inputs()
    converted = convert_fx(qat)
    out = converted(*inputs)
    assert check_model(converted, inputs, advice=0).ok
    assert torch.equal(compile_model(converted, list(inputs))(*inputs), out)
    return qat, converted, inputs, out


class _Attention(nn.Module):
    """Scores as the plugin's users write them: ``matmul(q, k, x_trans=False, y_trans=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = QuantStub(), QuantStub()
        self.scores = FloatFunctional()
        self.dq = DeQuantStub()

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.dq(self.scores.matmul(self.q(q), self.k(k), x_trans=False, y_trans=True))


def test_matmul_with_transposed_operands_matches_torch_and_compiles() -> None:
    ff = FloatFunctional()
    a, b = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    assert torch.equal(ff.matmul(a, b, False, True), a @ b.transpose(-2, -1))
    assert torch.equal(ff.matmul(a.transpose(-2, -1), b, x_trans=True, y_trans=True), a @ b.transpose(-2, -1))
    qat, _, (q, k), out = _flow(_Attention(), lambda: (torch.randn(1, 2, 6, 8), torch.randn(1, 2, 5, 8)))
    assert out.shape == (1, 2, 6, 5)
    lsb = float(qat.scores.activation_post_process.scale)
    assert (out - qat(q, k)).abs().max() <= 2 * lsb


class _Rounding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dq = QuantStub(), DeQuantStub()
        self.fl, self.ce, self.cat = FloatFunctional(), FloatFunctional(), FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        return self.dq(self.cat.concatenate([self.fl.floor(x), self.ce.ceil(x)], dim=1))


def test_floor_ceil_and_concatenate_prepare_convert_and_compile() -> None:
    ff = FloatFunctional()
    x = torch.tensor([-1.5, -0.2, 0.7, 2.0])
    assert torch.equal(ff.floor(x), torch.floor(x)) and torch.equal(ff.ceil(x), torch.ceil(x))
    assert torch.equal(ff.concatenate([x, x], dim=0), torch.cat([x, x]))
    qat, _, (x,), out = _flow(_Rounding(), lambda: (torch.randn(2, 3, 4) * 4,))
    # floor / ceil of the same fake-quantized input: the integer tables give the QAT values on the grid
    lsb = float(qat.cat.activation_post_process.scale)
    assert (out - qat(x)).abs().max() <= 1.5 * lsb


class _Channels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dq = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.ln = qir.nn.LayerNorm([8, 1, 1], dim=1)  # the plugin's LayerNorm over channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dq(self.ln(self.conv(self.quant(x))))


def test_layer_norm_over_channels_normalizes_dim_1() -> None:
    ln = qir.nn.LayerNorm([8, 1, 1], dim=1)
    with torch.no_grad():
        ln.norm.weight.uniform_(0.5, 1.5)
        ln.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 8, 3, 5)
    mean, var = x.mean(1, keepdim=True), x.var(1, unbiased=False, keepdim=True)
    want = (x - mean) / torch.sqrt(var + 1e-5) * ln.norm.weight.view(1, -1, 1, 1) + ln.norm.bias.view(1, -1, 1, 1)
    assert torch.allclose(ln(x), want, atol=1e-5)
    assert type(qir.nn.LayerNorm(8)) is nn.LayerNorm  # without dim: torch's LayerNorm over trailing dims
    # the plugin's checkpoint keys (weight of normalized_shape) load into the child
    fresh = qir.nn.LayerNorm([8, 1, 1], dim=1)
    fresh.load_state_dict({"weight": torch.full((8, 1, 1), 2.0), "bias": torch.zeros(8, 1, 1)})
    assert torch.equal(fresh.norm.weight, torch.full((8,), 2.0))


def test_layer_norm_over_channels_prepares_converts_and_compiles() -> None:
    qat, _, (x,), out = _flow(_Channels(), lambda: (torch.randn(2, 3, 5, 6),))
    assert type(qat.ln.norm).__name__ == "LayerNorm" and type(qat.ln.norm).__module__.startswith("qir.nn.qat")
    lsb = float(qat.ln.norm.activation_post_process.scale)
    assert (out - qat(x)).abs().max() <= 2 * lsb


def test_layer_norm_with_dim_refuses_a_weight_shape_it_cannot_mean() -> None:
    with pytest.raises(ValueError, match=r"one entry other than 1"):
        qir.nn.LayerNorm([8, 4], dim=1)
    with pytest.warns(UserWarning, match="sqrt_kwargs have no effect"):
        qir.nn.LayerNorm([8, 1, 1], dim=1, sqrt_kwargs={"auto_divide_strategy": "curvature"})
