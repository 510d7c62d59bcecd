"""A detection config run the way Horizon's model toolkit runs it: stage by stage, through files.

float -> calibration (percentile observers) -> ``calib.pth`` -> a new process prepares the
float model for QAT and loads it strictly -> QAT training -> ``qat.pth`` -> the int stage
prepares again, loads strictly, converts, traces, checks and compiles the trace (seed 003's
calls). The model is a small RetinaNet: an FPN and one shared conv head applied to every
level, one QuantStub for every level's input and one DeQuantStub for every output.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    load_compiled,
    prepare_qat_fx,
    set_fake_quantize,
)


class RetinaLite(nn.Module):
    def __init__(self, c: int = 8, anchors: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c3 = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1), nn.BatchNorm2d(c), nn.ReLU())
        self.c4 = nn.Sequential(nn.Conv2d(c, c, 3, 2, 1), nn.BatchNorm2d(c), nn.ReLU())
        self.c5 = nn.Sequential(nn.Conv2d(c, c, 3, 2, 1), nn.BatchNorm2d(c), nn.ReLU())
        self.lat4 = nn.Conv2d(c, c, 1)
        self.lat3 = nn.Conv2d(c, c, 1)
        # the head: shared by every level (weights and all), as RetinaNet's
        self.tower = nn.Conv2d(c, c, 3, padding=1)
        self.tower_relu = nn.ReLU()
        self.cls = nn.Conv2d(c, anchors * classes, 1)
        self.box = nn.Conv2d(c, anchors * 4, 1)
        self.dequant = DeQuantStub()

    def head(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tower_relu(self.tower(p))
        return self.dequant(self.cls(t)), self.dequant(self.box(t))

    def forward(self, img: torch.Tensor) -> list[torch.Tensor]:
        x = self.quant(img)
        c3 = self.c3(x)
        c4 = self.c4(c3)
        p5 = self.c5(c4)
        p4 = self.lat4(c4) + F.interpolate(p5, scale_factor=2, mode="nearest")
        p3 = self.lat3(c3) + F.interpolate(p4, scale_factor=2, mode="nearest")
        outs: list[torch.Tensor] = []
        for p in (p3, p4, p5):
            outs.extend(self.head(p))
        return outs


def _images(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 16, 16, generator=g) * 2 - 1


def _loss(outs: list[torch.Tensor]) -> torch.Tensor:
    return sum((o - 0.5).square().mean() for o in outs)  # type: ignore[return-value]


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
def test_toolkit_stages_through_checkpoint_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with march_scope(March.BAYES):
        # float stage
        float_model = RetinaLite()
        opt = torch.optim.SGD(float_model.parameters(), lr=0.05)
        for i in range(2):
            loss = _loss(float_model(_images(8, i)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.save(float_model.state_dict(), tmp_path / "float.pth")

        # calibration stage
        model = RetinaLite()
        model.load_state_dict(torch.load(tmp_path / "float.pth"))
        calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
        calib.eval()
        set_fake_quantize(calib, "calibration")
        with torch.no_grad():
            for i in range(2):
                calib(_images(8, 10 + i))
        torch.save(calib.state_dict(), tmp_path / "calib.pth")

        # QAT stage: a fresh float model, prepared, then the calibration checkpoint
        qat = prepare_qat_fx(RetinaLite(), {"": get_default_qat_qconfig()})
        qat.load_state_dict(torch.load(tmp_path / "calib.pth"), strict=True)
        qat.train()
        opt = torch.optim.SGD(qat.parameters(), lr=0.01)
        for i in range(2):
            loss = _loss(qat(_images(8, 20 + i)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.save(qat.state_dict(), tmp_path / "qat.pth")

        # int stage
        qat = prepare_qat_fx(RetinaLite(), {"": get_default_qat_qconfig()})
        qat.load_state_dict(torch.load(tmp_path / "qat.pth"), strict=True)
        qat.eval()
        set_fake_quantize(qat, "validation")
        quantized = convert_fx(qat)
        data = _images(2, 99)
        with torch.no_grad():
            want = qat(data)
            got = quantized(data)
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            rel = float((a - b).norm() / b.norm())
            assert rel < 0.02, (k, rel)  # QAT vs integer, relative L2 per output (measured: 0.1-0.3%)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(quantized, data, check_trace=False)
        report = check_model(traced, data)
        assert report.ok, report
        compile_model(traced, [data], opt=2, hbm=str(tmp_path / "model.hbm"))
        deployed = load_compiled(str(tmp_path / "model.hbm"))
        for a, b in zip(deployed(data), got, strict=True):
            assert torch.equal(a, b)
