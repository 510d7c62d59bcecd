"""Eager mode as Horizon users write it: ``torch.quantization.fuse_modules(..., fuser_func=
fuse_known_modules)`` on conv + bn (+ relu / relu6), linear (+ bn) (+ relu) and conv + bn +
``FloatFunctional.add`` (+ relu); ``prepare_qat``; ``convert`` of models fx cannot trace."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.ao.nn.quantized import FloatFunctional as TorchFloatFunctional
from torch.quantization import DeQuantStub

from qir.march import march_scope
from qir.nn import intrinsic, qat, quantized
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    QuantStub,
    check_model,
    compile_model,
    convert,
    fuse_known_modules,
    get_default_qat_qconfig,
    prepare_qat,
)
from qir.quantization.convert import ConvertError


@pytest.fixture(autouse=True)
def _bayes() -> Iterator[None]:
    torch.manual_seed(0)
    with march_scope("bayes"):
        yield


def _randomize_bn(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return model


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock with the residual add as a FloatFunctional (eager style)."""

    def __init__(self, c: int, ff: type[nn.Module] = FloatFunctional) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.add = ff()
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(self.add.add(out, x))

    def fuse_model(self, with_add: bool = True) -> None:
        second = ["conv2", "bn2", "add", "relu2"] if with_add else ["conv2", "bn2"]
        torch.quantization.fuse_modules(
            self, [["conv1", "bn1", "relu1"], second], inplace=True, fuser_func=fuse_known_modules
        )


class Net(nn.Module):
    """Stem (conv + bn + relu6), one residual block, and an MLP head (linear + bn1d + relu)."""

    def __init__(self, ff: type[nn.Module] = FloatFunctional) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6())
        self.block = BasicBlock(8, ff)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 16)
        self.bn_fc = nn.BatchNorm1d(16)
        self.relu_fc = nn.ReLU()
        self.out = nn.Linear(16, 4)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.block(self.stem(self.quant(x)))).flatten(1)
        return self.dequant(self.out(self.relu_fc(self.bn_fc(self.fc(x)))))

    def fuse_model(self, with_add: bool = True) -> None:
        torch.quantization.fuse_modules(
            self,
            [["stem.0", "stem.1", "stem.2"], ["fc", "bn_fc", "relu_fc"]],
            inplace=True,
            fuser_func=fuse_known_modules,
        )
        self.block.fuse_model(with_add)


@pytest.mark.parametrize("ff", [FloatFunctional, TorchFloatFunctional], ids=["qir_ff", "torch_ff"])
def test_fuse_modules_sequences_as_the_plugin(ff: type[nn.Module]) -> None:
    net = _randomize_bn(Net(ff)).eval()
    x = torch.randn(4, 3, 8, 8)
    want = net(x)
    net.fuse_model()
    # float results are unchanged (batch norms folded with their running statistics)
    assert torch.allclose(net(x), want, atol=1e-5)
    assert isinstance(net.stem[0], intrinsic.ConvReLU62d)
    assert isinstance(net.fc, intrinsic.LinearReLU)
    # conv + bn + add + relu: the fused module takes the FloatFunctional's place, Identity elsewhere
    block = net.block
    assert isinstance(block.add, intrinsic.ConvAddReLU2d)
    assert [type(block.get_submodule(n)) for n in ("conv2", "bn2", "relu2")] == [nn.Identity] * 3
    assert isinstance(net.bn_fc, nn.Identity) and isinstance(net.relu_fc, nn.Identity)


def test_fuse_known_modules_list_forms() -> None:
    conv, bn, add, relu = nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2), FloatFunctional(), nn.ReLU6()
    add.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    out = fuse_known_modules([conv, bn, add])
    assert [type(m) for m in out[:2]] == [nn.Identity, nn.Identity] and type(out[2]).__name__ == "ConvAdd2d"
    assert out[2].qconfig is add.qconfig  # the last module's qconfig, as the plugin
    out = fuse_known_modules([conv, bn, add, relu])
    assert type(out[2]).__name__ == "ConvAddReLU62d" and isinstance(out[3], nn.Identity)
    out = fuse_known_modules([nn.Linear(2, 2), nn.BatchNorm1d(2)])
    assert type(out[0]) is nn.Linear and isinstance(out[1], nn.Identity)
    with pytest.raises(ValueError, match=r"conv\(\+bn\)\+add\+relu\(6\)"):
        fuse_known_modules([conv, relu, add])
    fused = fuse_known_modules([nn.Conv2d(2, 2, 1), add])[1]
    with pytest.raises(TypeError, match="has no fused add"):
        fuse_known_modules([nn.Conv2d(2, 2, 1), nn.ReLU()])[0].add(torch.zeros(1), torch.zeros(1))
    x, y = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    assert torch.equal(fused.add(x, y), fused.conv(x) + y)


def _qat(net: nn.Module, steps: int = 3, size: int = 8) -> nn.Module:
    net.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    prepared = prepare_qat(net)
    prepared.train()
    for _ in range(steps):
        prepared(torch.randn(4, 3, size, size))
    return prepared.eval()


@pytest.mark.parametrize("with_add", [True, False], ids=["fused_add", "unfused_add"])
def test_eager_resnet_converts_checks_compiles(with_add: bool) -> None:
    net = _randomize_bn(Net()).eval()
    net.fuse_model(with_add)
    prepared = _qat(net)
    if with_add:
        assert isinstance(prepared.block.add, qat.ConvAddReLU2d)
    else:
        assert isinstance(prepared.block.add, qat.FloatFunctional)  # the residual add stays a FloatFunctional
    converted = convert(prepared)
    if with_add:
        assert isinstance(converted.block.add, quantized.ConvAddReLU2d)
    x = torch.randn(4, 3, 8, 8)
    got, want = converted(x), prepared(x)
    lsb = float(converted.out.scale.reshape(-1).max()) if converted.out.scale.numel() else 0.0
    assert (got - want).abs().max() <= 0.05 * want.abs().max() + lsb
    assert check_model(converted, x[:1]).ok
    assert torch.equal(compile_model(converted, [x[:1]], opt=1)(x), got)


class Untraceable(nn.Module):
    """Downsamples until the map is at most 8 wide: a loop on a size, which fx cannot trace."""

    def __init__(self, loop: bool = True) -> None:
        super().__init__()
        self.loop = loop
        self.quant = QuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.down = nn.MaxPool2d(2)
        self.block = BasicBlock(8)
        self.head = nn.Conv2d(8, 4, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(self.quant(x))
        if self.loop:
            while x.size(-1) > 8:
                x = self.down(x)
        else:
            x = self.down(self.down(x))
        return self.dequant(self.head(self.block(x)).flatten(1))


def _fused_untraceable(loop: bool) -> nn.Module:
    torch.manual_seed(3)
    net = _randomize_bn(Untraceable(loop)).eval()
    torch.quantization.fuse_modules(net, ["stem.0", "stem.1", "stem.2"], inplace=True, fuser_func=fuse_known_modules)
    net.block.fuse_model()
    return net


def test_untraceable_model_converts_from_its_recorded_forwards() -> None:
    torch.manual_seed(0)
    prepared = _qat(_fused_untraceable(loop=True), size=32)
    with pytest.raises(Exception, match="symbolically traced variables cannot be used as inputs to control flow"):
        torch.fx.symbolic_trace(prepared)
    converted = convert(prepared)
    assert isinstance(converted.block.add, quantized.ConvAddReLU2d)

    # the same weights in a traceable twin, converted through the fx trace: the same integer model
    twin = _fused_untraceable(loop=False)
    twin.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    twin_qat = prepare_qat(twin)
    twin_qat.load_state_dict(prepared.state_dict())
    twin_qat.eval()
    twin_int = convert(twin_qat)
    x = torch.randn(4, 3, 32, 32)
    assert torch.equal(converted(x), twin_int(x))
    assert (converted(x) - prepared(x)).abs().max() <= 0.05 * prepared(x).abs().max()
    assert converted(torch.randn(2, 3, 64, 64)).shape == (2, 4 * 8 * 8)  # the loop still runs
    # the converted model records nothing, and the QAT model pickles with its recording hooks
    assert not converted._forward_pre_hooks and not converted.block.add._forward_hooks
    assert isinstance(pickle.loads(pickle.dumps(prepared)), Untraceable)


class SigmoidOnCodes(Untraceable):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(self.quant(x))
        while x.size(-1) > 8:
            x = self.down(x)
        return self.dequant(torch.sigmoid(self.head(x)))


def test_untraceable_model_with_an_op_on_codes_is_refused() -> None:
    net = SigmoidOnCodes().eval()
    prepared = _qat(net, size=16)  # stem not fused: its batch norm would run on codes too
    with pytest.raises(ConvertError, match=r"batch_norm runs on the output of module 'stem.0'.*\(1 more such op"):
        convert(prepared)
    net = SigmoidOnCodes().eval()
    torch.quantization.fuse_modules(net, ["stem.0", "stem.1", "stem.2"], inplace=True, fuser_func=fuse_known_modules)
    with pytest.raises(ConvertError, match=r"sigmoid runs on the output of module 'head'.*DeQuantStub before it"):
        convert(_qat(net, size=16))


def test_untraceable_model_never_run_is_refused() -> None:
    net = Untraceable()
    net.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    with pytest.raises(ConvertError, match="Run the prepare_qat model once"):
        convert(prepare_qat(net))
