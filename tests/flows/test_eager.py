"""Eager flow: fuse_known_modules with torch's fuse_modules, prepare_qat, convert."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import DeQuantStub

from qir.nn import qat, quantized
from qir.nn.intrinsic import ConvReLU2d
from qir.quantization import (
    QuantStub,
    convert,
    fuse_known_modules,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat,
)
from qir.quantization.convert import ConvertError

SEED_002_TREE = """Sequential(
  (0): ConvReLU2d(
    (0): Conv2d(1, 1, kernel_size=(1, 1), stride=(1, 1))
    (1): ReLU()
  )
  (1): Identity()
  (2): Identity()
)"""


def _seq() -> nn.Sequential:
    m = nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1), nn.ReLU())
    m[1].running_mean.fill_(0.3)
    m[1].running_var.fill_(2.0)
    return m


def test_fuse_modules_printout_and_numerics() -> None:
    m = _seq().eval()
    x = torch.randn(2, 1, 4, 4)
    ref = m(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's fuse_modules does not warn with our fuser
        fused = torch.ao.quantization.fuse_modules(m, ["0", "1", "2"], inplace=False, fuser_func=fuse_known_modules)
    assert repr(fused) == SEED_002_TREE
    assert isinstance(fused[0], ConvReLU2d)
    assert fused[0].conv is fused[0]._modules["0"] and fused[0].relu is fused[0]._modules["1"]
    torch.testing.assert_close(fused(x), ref)
    assert list(fused.state_dict()) == ["0.0.weight", "0.0.bias"]
    again = pickle.loads(pickle.dumps(fused))
    assert repr(again) == SEED_002_TREE


def test_fuse_known_modules_variants() -> None:
    conv, bn = nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2)
    out = fuse_known_modules([conv, bn])
    assert type(out[0]) is nn.Conv2d and isinstance(out[1], nn.Identity) and out[0] is not conv
    out = fuse_known_modules([nn.Linear(2, 2), nn.ReLU6()])
    assert type(out[0]).__name__ == "LinearReLU6"
    with pytest.raises(ValueError, match="first module"):
        fuse_known_modules([nn.ReLU(), nn.Conv2d(1, 1, 1)])
    custom = {(nn.Conv2d, nn.Sigmoid): lambda is_qat, c, s: nn.Sequential(c, s)}
    out = fuse_known_modules([nn.Conv2d(1, 1, 1), nn.Sigmoid()], additional_fuser_method_mapping=custom)
    assert isinstance(out[0], nn.Sequential)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub(scale=1 / 128)
        self.conv0 = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Conv2d(4, 3, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.head(self.pool(self.conv0(self.quant(x)))))


def _fused_net() -> _Net:
    net = _Net()
    torch.ao.quantization.fuse_modules(net.conv0, ["0", "1", "2"], inplace=True, fuser_func=fuse_known_modules)
    return net


def test_prepare_qat_propagates_qconfig_and_converts() -> None:
    net = _fused_net()
    net.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    net.head.qconfig = get_default_qat_out_qconfig()  # type: ignore[assignment]
    prepared = prepare_qat(net)
    assert type(net.conv0[0]).__name__ == "ConvReLU2d" and not isinstance(net.conv0[0], qat.QATModule)
    assert isinstance(prepared.conv0[0], qat.ConvReLU2d)
    assert isinstance(prepared.quant, qat.QuantStub) and prepared.quant.has_fixed_scale
    assert prepared.head.activation_post_process is None
    prepared.train()
    for _ in range(3):
        prepared(torch.rand(4, 1, 10, 10) * 2 - 1)
    prepared.eval()
    before = copy.deepcopy(prepared.state_dict())
    converted = convert(prepared)
    assert all(torch.equal(v, before[k]) for k, v in prepared.state_dict().items())
    assert isinstance(converted.conv0[0], quantized.ConvReLU2d) and isinstance(converted, _Net)
    x = torch.rand(4, 1, 10, 10) * 2 - 1
    q, f = converted(x), prepared(x)
    assert (q - f).abs().max() <= 0.02 * f.abs().max()  # 1-LSB requantization differences only


def test_prepare_qat_inplace_and_mixing() -> None:
    net = _fused_net()
    net.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    out = prepare_qat(net, inplace=True)
    assert out is net and isinstance(net.conv0[0], qat.ConvReLU2d)
    net = _fused_net()
    net.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    net.head.qconfig = get_default_calib_qconfig()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="cannot be mixed"):
        prepare_qat(net)


def test_convert_names_untraceable_module() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.quant(x)
            return self.conv(x) if x.sum() > 0 else x

    net = Branchy()
    net.qconfig = get_default_qat_qconfig()  # type: ignore[assignment]
    prepared = prepare_qat(net)
    with pytest.raises(ConvertError, match=r"(?s)Branchy.*fx_helper\.wrap"):
        convert(prepared)
