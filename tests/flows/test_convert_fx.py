"""convert_fx: integer model equal to the QAT model, jit.trace, graph edits, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from flow_models import ModelForFusion, ResNetish, randomize_bn
from torch import nn
from torch.ao.quantization import DeQuantStub

from qir.march import March, march_scope
from qir.nn import quantized
from qir.quantization import (
    QuantStub,
    convert_fx,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from qir.quantization.convert import ConvertError

QAT = get_default_qat_qconfig()


def _trained(model: nn.Module, qconfig_dict: dict, shape: tuple[int, ...], steps: int = 4) -> nn.Module:
    prepared = prepare_qat_fx(model, qconfig_dict)
    prepared.train()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        prepared(torch.randn(*shape, generator=g))
    return prepared.eval()


@pytest.mark.parametrize("march_name", ["bayes", "bernoulli2"])
def test_converted_matches_qat(march_name: str) -> None:
    with march_scope(march_name):
        qd = {"": QAT, "module_name": {"fc": get_default_qat_out_qconfig()}}
        prepared = _trained(randomize_bn(ResNetish()), qd, (8, 1, 8, 8))
        converted = convert_fx(prepared)
        x = torch.randn(16, 1, 8, 8)
        q, f = converted(x), prepared(x)
        assert q.dtype == torch.float32
        # requantization is within 1 LSB per op; through a few layers the outputs stay close
        assert (q - f).abs().max() < 0.05 * f.abs().max()
        assert (q.argmax(1) == f.argmax(1)).float().mean() >= 0.9
        assert isinstance(converted.get_submodule("quant"), quantized.QuantStub)
        assert isinstance(converted.get_submodule("layer1.0._generated_add_0"), quantized.ConvAddReLU2d)
        assert isinstance(converted.get_submodule("_generated_cat_0"), quantized.QFunctional)


def test_codes_between_modules() -> None:
    prepared = _trained(ResNetish(), {"": QAT}, (4, 1, 8, 8))
    converted = convert_fx(prepared)
    seen: list[torch.dtype] = []
    converted.get_submodule("layer1.0.conv1").register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    converted(torch.randn(2, 1, 8, 8))
    assert seen == [torch.int8]


def test_does_not_mutate_qat_model() -> None:
    prepared = _trained(ResNetish(), {"": QAT}, (4, 1, 8, 8))
    before = copy.deepcopy(prepared.state_dict())
    tree = repr(prepared)
    convert_fx(prepared)
    assert repr(prepared) == tree
    assert all(torch.equal(v, before[k]) for k, v in prepared.state_dict().items())


def test_jit_trace_matches() -> None:
    converted = convert_fx(_trained(ResNetish(), {"": QAT}, (4, 1, 8, 8)))
    x = torch.randn(3, 1, 8, 8)
    with pytest.warns(torch.jit.TracerWarning):  # scalar reads of fixed buffers: constants, as intended
        traced = torch.jit.trace(converted, x)
    assert torch.equal(traced(x), converted(x))


class _RGBNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(self.quant(x))))


def test_graph_edit_after_quant_stub() -> None:
    net = _RGBNet()
    net.qconfig = QAT  # type: ignore[assignment]
    qat_net = prepare_qat_fx(net)
    qat_net(torch.rand(1, 3, 28, 28))
    converted = convert_fx(qat_net)
    assert [n.op for n in converted.graph.nodes] == ["placeholder", "call_module", "call_module", "output"]

    def shift(x: torch.Tensor) -> torch.Tensor:  # stands in for centered_yuv2rgb: codes in, codes out
        return x

    for n in converted.graph.nodes:
        if n.target == "quant":
            with converted.graph.inserting_after(n):
                new = converted.graph.call_function(shift, (n,), {})
                n.replace_all_uses_with(new)
                new.args = (n,)
    converted.quant.scale.fill_(1.0)
    converted.recompile()
    out = converted(torch.randint(-128, 128, (1, 3, 28, 28)).float())
    assert out.dtype == torch.int8  # no DeQuantStub in this net: codes come out


def test_functional_relu6_and_interpolate_on_codes() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(1, 2, 1)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.conv(self.quant(x)) * 1.0
            x = F.relu6(x.reshape(x.shape[0], 2, 4, 4))
            x = F.interpolate(x, scale_factor=2, mode="nearest")
            return self.dequant(x)

    prepared = _trained(Net(), {"": QAT}, (4, 1, 4, 4))
    converted = convert_fx(prepared)
    x = torch.randn(2, 1, 4, 4) * 4
    torch.testing.assert_close(converted(x), prepared(x), atol=0.1, rtol=0.05)


def test_float_input_into_quantized_module_is_an_error() -> None:
    class NoStub(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    prepared = prepare_qat_fx(NoStub(), {"": QAT})
    with pytest.raises(ConvertError, match=r"module 'conv'.*QuantStub"):
        convert_fx(prepared)


def test_wrong_march_is_an_error() -> None:
    prepared = prepare_qat_fx(ModelForFusion(), {"": QAT})
    with march_scope(March.BERNOULLI2), pytest.raises(ConvertError, match="prepared for march bayes"):
        convert_fx(prepared)


def test_module_shared_by_inputs_of_different_scales_gets_one_module_per_call_site() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qa = QuantStub()
            self.qb = QuantStub()
            self.conv = nn.Conv2d(1, 1, 1)
            self.dequant = DeQuantStub()

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.dequant(torch.cat([self.conv(self.qa(a)), self.conv(self.qb(b))], 1))

    prepared = prepare_qat_fx(Shared(), {"": QAT})
    a, b = torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4) * 10
    prepared(a, b)
    assert prepared.conv_call1.weight is prepared.conv.weight
    converted = convert_fx(prepared.eval())
    assert not torch.equal(converted.conv.input_scale_0, converted.conv_call1.input_scale_0)
    assert torch.allclose(
        converted(a, b), prepared(a, b), atol=4 * float(prepared.conv_call1.activation_post_process.scale)
    )


def test_prepare_with_example_inputs() -> None:
    x = torch.randn(2, 1, 8, 8)
    prepared = prepare_qat_fx(ResNetish(), {"": QAT}, example_inputs=(x,))
    prepared(x)
    converted = convert_fx(prepared.eval())
    assert converted(x).shape == (2, 5)
