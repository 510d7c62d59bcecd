"""A UNet segmentation model as Horizon users write it, through every tool the seeds call: input
normalization ``(x - 0.5) / 0.25`` before the QuantStub, decoder steps that resize with
``F.interpolate(x, size=skip.shape[-2:], mode="bilinear")`` or a ``ConvTranspose2d`` and ``torch.cat``
the skip, qconfigs from a ``set_qconfig()`` helper (``self.qconfig`` and a high-precision last conv),
calibration -> QAT -> ``export_to_onnx`` -> convert -> ``torch.jit.trace`` -> ``check_model`` of the
trace -> ``compile_model(opt=3, hbm=...)`` -> ``perf_model`` -> ``visualize_model``.

The normalization runs on the float input: prepare leaves arithmetic before the QuantStub as
written (it made a generated ``mul_scalar`` of the division, which convert then refused)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qir
from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    perf_model,
    prepare_qat_fx,
    set_fake_quantize,
    visualize_model,
)
from qir.quantization.qconfig import default_calib_8bit_weight_32bit_out_fake_quant_qconfig


def double_conv(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(i, o, 3, padding=1, bias=False),
        nn.BatchNorm2d(o),
        nn.ReLU(inplace=True),
        nn.Conv2d(o, o, 3, padding=1, bias=False),
        nn.BatchNorm2d(o),
        nn.ReLU(inplace=True),
    )


class Up(nn.Module):
    def __init__(self, i: int, o: int, bilinear: bool = True) -> None:
        super().__init__()
        self.bilinear = bilinear
        if not bilinear:
            self.up = nn.ConvTranspose2d(i, i, 2, stride=2)
        self.conv = double_conv(i + o, o)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        if self.bilinear:
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
        else:
            x = self.up(x)
        return self.conv(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.inc = double_conv(3, 8)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), double_conv(8, 16))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), double_conv(16, 32))
        self.up1 = Up(32, 16)
        self.up2 = Up(16, 8, bilinear=False)
        self.outc = nn.Conv2d(8, classes, 1)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(self.quant((x - 0.5) / 0.25))
        x2 = self.down1(x1)
        x = self.up2(self.up1(self.down2(x2), x2), x1)
        return self.dequant(self.outc(x))

    def set_qconfig(self, qconfig: object, out_qconfig: object) -> None:
        self.qconfig = qconfig
        self.outc.qconfig = out_qconfig


def _image() -> torch.Tensor:
    return torch.rand(1, 3, 20, 28)  # 20 -> 10 -> 5: the bilinear resize goes 5x7 -> 10x14


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_the_seed_tools_run_on_the_unet(tmp_path: Path) -> None:
    model = UNet().eval()
    model.set_qconfig(get_default_calib_qconfig(), default_calib_8bit_weight_32bit_out_fake_quant_qconfig)
    calib = prepare_qat_fx(model)
    assert not [n for n, _ in calib.named_modules() if n.startswith(("_generated_sub", "_generated_mul"))]
    calib.eval()
    with torch.no_grad():
        for _ in range(3):
            calib(_image())
    model.set_qconfig(get_default_qat_qconfig(), get_default_qat_out_qconfig())
    qat = prepare_qat_fx(model)
    qat.load_state_dict(calib.state_dict(), strict=True)
    qat.train()
    qat(_image()).square().mean().backward()
    qat.eval()
    set_fake_quantize(qat, "validation")
    x = _image()

    from qir.utils.onnx_helper import export_to_onnx

    export_to_onnx(qat, x, str(tmp_path / "qat.onnx"), enable_onnx_checker=True, operator_export_type=None)
    assert (tmp_path / "qat.onnx").stat().st_size > 0

    converted = convert_fx(qat)
    traced = torch.jit.trace(converted, x)
    assert check_model(traced, x, advice=0).ok
    compiled = compile_model(traced, [x], opt=3, hbm=str(tmp_path / "unet.hbm"))
    with torch.no_grad():
        want = converted(x)
        assert torch.equal(compiled(x), want)
        assert torch.equal(qir.load_compiled(tmp_path / "unet.hbm")(x), want)
        # qint32 logits at the accumulator's scale: validation QAT computes them exactly
        assert float((want - qat(x)).abs().max()) <= 1e-5
    profile = perf_model(traced, [x], opt=2, input_source=["pyramid"], layer_details=True, out_dir=str(tmp_path))
    assert profile is not None and (tmp_path / "perf.json").exists()
    svg = visualize_model(traced, [x], save_path=str(tmp_path / "unet.svg"), show=False)
    assert Path(svg).read_text().lstrip().startswith("<")
