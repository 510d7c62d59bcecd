"""Calibration -> QAT through a checkpoint, as Horizon's model toolkit configs run it.

The toolkit's calibration stage prepares the float model with a calibration qconfig,
calibrates and saves ``state_dict()``; its QAT stage, a separate run, prepares a fresh
float model with QAT qconfigs and loads that checkpoint with ``strict=True``. The loaded
QAT model must start from the calibrated scales: its output equals the calibrated model's
in validation mode, and its observers hold what ``prepare_qat_fx(calibrated_model)``
(the in-memory carry-over) would give.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.fake_quantize import FakeQuantize


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyFPNClassifier(nn.Module):
    """A backbone with two stages, a top-down lateral add and a classifier (toolkit style)."""

    def __init__(self, num_classes: int = 5) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stage1 = ConvBNReLU(3, 8, 2)
        self.stage2 = ConvBNReLU(8, 16, 2)
        self.lateral = nn.Conv2d(8, 16, 1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Conv2d(16, num_classes, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c1 = self.stage1(self.quant(x))
        c2 = self.stage2(c1)
        p1 = self.lateral(c1) + self.up(c2)
        return self.dequant(self.head(self.pool(p1)).flatten(1))


def _randomized(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    return model


def _roundtrip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded: dict[str, torch.Tensor] = torch.load(buf)
    return loaded


def _batches(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 16, 16, generator=g) * 1.5 for _ in range(n)]


def _fake_quants(model: nn.Module) -> dict[str, FakeQuantize]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantize)}


def _calibrated_fx(float_model: nn.Module) -> nn.Module:
    calib = prepare_qat_fx(float_model, {"": get_default_calib_qconfig()})
    calib.eval()
    set_fake_quantize(calib, "calibration")
    with torch.no_grad():
        for x in _batches():
            calib(x)
    return calib


QAT_DICT = {"": get_default_qat_qconfig()}


@pytest.fixture(autouse=True)
def bayes() -> object:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_fx_calibration_checkpoint_loads_strictly_into_a_fresh_qat_model() -> None:
    float_model = _randomized(TinyFPNClassifier()).eval()
    calib = _calibrated_fx(float_model)
    ckpt = _roundtrip(calib.state_dict())
    assert any(k.endswith("observer.histogram") for k in ckpt)  # percentile observers: histogram buffers

    qat = prepare_qat_fx(_randomized(TinyFPNClassifier()), QAT_DICT)  # another process: fresh float model
    result = qat.load_state_dict(ckpt, strict=True)
    assert not result.missing_keys and not result.unexpected_keys

    # the QAT model starts from the calibrated scales: same output in validation mode, exactly
    set_fake_quantize(calib, "validation")
    qat.eval()
    set_fake_quantize(qat, "validation")
    x = torch.randn(2, 3, 16, 16) * 1.5
    assert torch.equal(qat(x), calib(x))

    # ... and the same observer state as the in-memory carry-over (prepare_qat_fx(calibrated))
    carried = prepare_qat_fx(calib, QAT_DICT)
    mine, theirs = _fake_quants(qat), _fake_quants(carried)
    assert mine.keys() == theirs.keys()
    for name, fq in mine.items():
        other = theirs[name]
        assert torch.equal(fq.scale, other.scale), name
        if fq.ch_axis is None:  # activations: the range restarts from the percentile scale
            torch.testing.assert_close(fq.observer.max_val, other.observer.max_val, rtol=0, atol=0)
            torch.testing.assert_close(fq.observer.min_val, other.observer.min_val, rtol=0, atol=0)
            torch.testing.assert_close(fq.observer.max_val, fq.scale * 127.5)


HEAD_OUT_DICT = {"": get_default_qat_qconfig(), "module_name": [("head", get_default_qat_out_qconfig())]}


def test_fx_calibration_checkpoint_loads_strictly_into_a_high_precision_output() -> None:
    """Seed 003's QAT qconfig gives the last conv a qint32 output: the calibrated output fake quant it
    no longer has is left behind, as prepare_qat_fx(calibrated_model) leaves it; other keys load."""
    calib = _calibrated_fx(_randomized(TinyFPNClassifier()).eval())
    ckpt = _roundtrip(calib.state_dict())
    assert "head.activation_post_process.observer.histogram" in ckpt
    qat = prepare_qat_fx(_randomized(TinyFPNClassifier()), HEAD_OUT_DICT)
    assert qat.get_submodule("head").activation_post_process is None
    result = qat.load_state_dict(ckpt, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    carried = prepare_qat_fx(calib, HEAD_OUT_DICT)
    assert qat.state_dict().keys() == carried.state_dict().keys()
    assert torch.equal(qat.get_submodule("head").weight, carried.get_submodule("head").weight)
    mine, theirs = _fake_quants(qat), _fake_quants(carried)
    assert mine.keys() == theirs.keys()
    for name, fq in mine.items():
        assert torch.equal(fq.scale, theirs[name].scale), name
    for m in (qat, carried):
        m.eval()
        set_fake_quantize(m, "validation")
    x = torch.randn(2, 3, 16, 16) * 1.5
    assert torch.equal(qat(x), carried(x))


def test_only_the_output_fake_quant_keys_of_a_high_precision_output_are_left_behind() -> None:
    ckpt = _roundtrip(_calibrated_fx(_randomized(TinyFPNClassifier()).eval()).state_dict())
    for bad in ("head.activation_post_process.observer.bogus", "head.activation_post_process.bogus", "head.bogus"):
        qat = prepare_qat_fx(TinyFPNClassifier(), HEAD_OUT_DICT)
        with pytest.raises(RuntimeError, match="Unexpected key.*" + bad.replace(".", r"\.")) as e:
            qat.load_state_dict({**ckpt, bad: torch.zeros(1)}, strict=True)
        assert "observer.histogram" not in str(e.value)
    # a scale-preserving module never has an output fake quant: keys for one are another model's
    qat = prepare_qat_fx(TinyFPNClassifier(), HEAD_OUT_DICT)
    with pytest.raises(RuntimeError, match=r"up\.activation_post_process\.scale"):
        qat.load_state_dict({**ckpt, "up.activation_post_process.scale": torch.ones(1)}, strict=True)


def test_fx_qat_moves_on_from_the_calibrated_range_not_the_raw_maximum() -> None:
    calib = _calibrated_fx(_randomized(TinyFPNClassifier()).eval())
    qat = prepare_qat_fx(_randomized(TinyFPNClassifier()), QAT_DICT)
    qat.load_state_dict(_roundtrip(calib.state_dict()), strict=True)
    before = {n: fq.scale.clone() for n, fq in _fake_quants(qat).items() if fq.ch_axis is None}
    qat.train()
    qat(_batches(1)[0])  # one QAT step: the moving average (constant 0.01) moves 1% towards the batch
    for name, fq in _fake_quants(qat).items():
        if fq.ch_axis is None:
            ratio = float(fq.scale / before[name])
            assert 0.97 < ratio < 1.03, (name, ratio)


def test_fx_qat_checkpoint_loads_strictly_into_a_fresh_qat_model_and_converts() -> None:
    calib = _calibrated_fx(_randomized(TinyFPNClassifier()).eval())
    qat_dict = {"": get_default_qat_qconfig(), "module_name": [("head", get_default_qat_out_qconfig())]}
    qat = prepare_qat_fx(calib, qat_dict)
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    for x in _batches(2):
        loss = qat(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    resumed = prepare_qat_fx(TinyFPNClassifier(), qat_dict)
    result = resumed.load_state_dict(_roundtrip(qat.state_dict()), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for m in (qat, resumed):
        m.eval()
        set_fake_quantize(m, "validation")
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(resumed(x), qat(x))
    quantized = convert_fx(resumed)
    assert check_model(quantized, x).ok
    compiled = compile_model(quantized, [x])
    assert torch.equal(compiled(x), quantized(x))


class EagerNet(nn.Module):
    """Eager-mode toolkit style: modules only, FloatFunctional-free, fused by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu0 = nn.ReLU()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Conv2d(8, 4, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(self.relu0(self.conv0(self.quant(x))))
        return self.dequant(self.fc(self.pool(x)).flatten(1))


def _eager(qconfig: object) -> nn.Module:
    model = EagerNet()
    model.qconfig = qconfig
    return prepare_qat(model, inplace=False)


def test_eager_calibration_checkpoint_loads_strictly_both_ways() -> None:
    calib = _eager(get_default_calib_qconfig())
    calib.eval()
    with torch.no_grad():
        for x in _batches():
            calib(x)
    ckpt = _roundtrip(calib.state_dict())
    qat = _eager(get_default_qat_qconfig())
    result = qat.load_state_dict(ckpt, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    set_fake_quantize(calib, "validation")
    qat.eval()
    set_fake_quantize(qat, "validation")
    x = torch.randn(2, 3, 16, 16) * 1.5
    assert torch.equal(qat(x), calib(x))

    again = _eager(get_default_qat_qconfig())  # QAT -> QAT
    again.load_state_dict(_roundtrip(qat.state_dict()), strict=True)
    again.eval()
    set_fake_quantize(again, "validation")
    assert torch.equal(again(x), qat(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = convert(again, inplace=False)
    torch.testing.assert_close(quantized(x), again(x), rtol=0, atol=0.1 * float(again(x).abs().max()))


def test_eager_calibration_checkpoint_loads_strictly_into_a_high_precision_output() -> None:
    """Seed 002's ``classifier.qconfig = get_default_qat_out_qconfig()``, eager."""
    calib = _eager(get_default_calib_qconfig())
    calib.eval()
    with torch.no_grad():
        for x in _batches():
            calib(x)
    ckpt = _roundtrip(calib.state_dict())
    model = EagerNet()
    model.qconfig = get_default_qat_qconfig()
    model.fc.qconfig = get_default_qat_out_qconfig()
    qat = prepare_qat(model, inplace=False)
    result = qat.load_state_dict(ckpt, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(qat.get_submodule("fc").weight, calib.get_submodule("fc").weight)
    assert torch.equal(
        qat.get_submodule("conv1").activation_post_process.scale,
        calib.get_submodule("conv1").activation_post_process.scale,
    )
    with pytest.raises(RuntimeError, match=r"fc\.activation_post_process\.bogus"):
        qat.load_state_dict({**ckpt, "fc.activation_post_process.bogus": torch.zeros(1)}, strict=True)


def test_a_checkpoint_of_another_model_still_fails_strict_loading() -> None:
    calib = _calibrated_fx(_randomized(TinyFPNClassifier()).eval())
    ckpt = _roundtrip(calib.state_dict())
    ckpt["head.activation_post_process.observer.bogus"] = torch.zeros(1)
    qat = prepare_qat_fx(TinyFPNClassifier(), QAT_DICT)
    with pytest.raises(RuntimeError, match="bogus"):
        qat.load_state_dict(ckpt, strict=True)
