"""An RDK-quick-start-style classifier in eager mode, with the plugin's names: eager fuse,
``QuantStub(scale=1/128)``, ``prepare_calibration(model, inplace=True)``, calibration, ``convert``,
and ``March.BAYES_E``. Then the QAT continuation from the calibrated state dict."""

import copy

import pytest
import torch
from names_flow import finish
from torch import nn
from torch.quantization import DeQuantStub

import qir as horizon
from qir.march import March, set_march
from qir.quantization import (
    QuantStub,
    convert,
    fuse_known_modules,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_calibration,
    prepare_qat,
    set_fake_quantize,
)
from qir.quantization.qconfig import (
    default_calib_8bit_fake_quant_qconfig,
    default_calib_8bit_weight_32bit_out_fake_quant_qconfig,
)


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    def fuse_model(self) -> None:
        torch.quantization.fuse_modules(self, ["0", "1", "2"], inplace=True, fuser_func=fuse_known_modules)


class TinyNet(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.quant = QuantStub(scale=1 / 128)  # camera input: a fixed scale
        self.features = nn.Sequential(ConvBNReLU(3, 8), ConvBNReLU(8, 16, 2), ConvBNReLU(16, 16, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Conv2d(16, num_classes, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.quant(x))
        return self.dequant(self.classifier(self.pool(x))).flatten(1)

    def fuse_model(self) -> None:
        for m in self.features:
            m.fuse_model()

    def set_qconfig(self, calibration: bool) -> None:
        self.qconfig = default_calib_8bit_fake_quant_qconfig if calibration else get_default_qat_qconfig()
        self.classifier.qconfig = (
            default_calib_8bit_weight_32bit_out_fake_quant_qconfig if calibration else get_default_qat_out_qconfig()
        )


def _images() -> torch.Tensor:
    return torch.rand(4, 3, 16, 16) * 2 - 1  # in [-1, 1): on the 1/128 grid's range


@pytest.fixture(autouse=True)
def _bayes_e() -> object:
    set_march(March.BAYES_E)  # the RDK X5's march: Bayes's rules in qir
    yield
    set_march(None)


def _randomize_bn(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)


def test_eager_calibration_then_convert_check_compile() -> None:
    torch.manual_seed(0)
    float_model = TinyNet()
    _randomize_bn(float_model)
    float_model.eval()
    float_model.fuse_model()
    float_model.set_qconfig(calibration=True)
    calib = prepare_calibration(float_model, inplace=True)
    assert calib is float_model  # inplace, as the plugin's users call it
    with torch.no_grad():
        for _ in range(4):
            calib(_images())
    set_fake_quantize(calib, "validation")
    x = _images()
    result = finish(calib, convert(calib, inplace=False), (x,))
    assert result.converted.get_submodule("classifier").dtype.name == "qint32"  # high-precision logits
    assert float(result.converted.quant.scale) == 1 / 128
    # logits at qint32: the only differences are the int32 accumulator's rounding, far below 1e-3
    assert result.max_error() < 1e-3 * float(result.qat_out.abs().max())
    assert horizon.get_march() is March.BAYES


def test_calibrated_state_dict_starts_eager_qat() -> None:
    torch.manual_seed(1)
    base = TinyNet()
    _randomize_bn(base)
    base.eval()
    calib_model = copy.deepcopy(base)
    calib_model.fuse_model()
    calib_model.set_qconfig(calibration=True)
    calib = prepare_calibration(calib_model)
    with torch.no_grad():
        for _ in range(4):
            calib(_images())
    # a fresh float model prepared for QAT takes the calibrated state dict (scales included)
    qat_model = copy.deepcopy(base)
    qat_model.fuse_model()
    qat_model.set_qconfig(calibration=False)
    qat = prepare_qat(qat_model)
    qat.load_state_dict(calib.state_dict(), strict=True)
    for name in ("features.0.0.activation_post_process.scale", "features.2.0.activation_post_process.scale"):
        assert torch.equal(qat.state_dict()[name], calib.state_dict()[name])
    set_fake_quantize(qat, "validation")
    result = finish(qat, convert(qat), (_images(),))
    assert result.max_error() < 1e-3 * float(result.qat_out.abs().max())


def test_prepare_calibration_refuses_qat_qconfigs_and_no_qconfig() -> None:
    model = TinyNet()
    with pytest.raises(ValueError, match="no module of the model has a qconfig"):
        prepare_calibration(model)
    model.qconfig = get_default_qat_qconfig()
    with pytest.raises(ValueError, match="prepare_calibration got QAT qconfigs"):
        prepare_calibration(model)
