"""A hybrid model compiled into one artifact, as seed 003's users deploy one: a conv + bn + relu neck
and a float depthwise conv kept on the CPU (``hybrid_dict``), a BPU backbone and head around them,
calibration -> QAT -> convert -> check -> compile -> save -> load -> run. The CPU part runs in the
artifact as float kernels (``float_fn``: ``F.conv2d`` / ``F.batch_norm`` / ``F.relu`` with the weights
as program constants), so the artifact equals the converted hybrid model bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import qir
from qir.march import March, march_scope
from qir.quantization import (
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    hybrid_placement,
    prepare_qat_fx,
    set_fake_quantize,
)

HYBRID = {"module_name": ["neck", "dw"]}


class CpuNeckNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.neck = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dw(self.neck(self.backbone(x))))


def _images(g: torch.Generator | None = None) -> torch.Tensor:
    return torch.rand(2, 3, 16, 16, generator=g) * 2 - 1


@pytest.fixture(autouse=True)
def bernoulli2() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BERNOULLI2) as m:
        yield m


def test_the_cpu_convs_run_in_the_artifact_as_float_kernels(tmp_path: Path) -> None:
    model = CpuNeckNet()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()}, hybrid=True, hybrid_dict=HYBRID).eval()
    with torch.no_grad():
        for _ in range(3):
            calib(_images())
    qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()}, hybrid=True, hybrid_dict=HYBRID).train()
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for _ in range(3):
        loss = qat(_images()).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    assert hybrid_placement(qat).cpu_modules() == ["neck", "dw"]
    converted = convert_fx(qat)
    x = _images()
    assert check_model(converted, x).ok
    path = tmp_path / "hybrid.hbm"
    compile_model(converted, [x], hbm=path)
    program = qir.load_compiled(path)
    fns = [i.attrs["fn"] for i in program.program.instructions if i.op == "float_fn"]
    assert fns == ["F.conv2d", "F.batch_norm", "F.relu", "F.conv2d"]
    assert {i.op for i in program.program.instructions} >= {"quantize", "conv2d", "dequantize", "float_fn"}
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = _images(g)
        with torch.no_grad():
            want = converted(x)
        assert torch.equal(program(x), want)
    with torch.no_grad():
        lsb = float(qat.head.activation_post_process.scale)
        assert float((converted(x) - qat(x)).abs().max()) <= 2 * lsb
