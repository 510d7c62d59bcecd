"""torchvision's MultiScaleRoIAlign: qir.nn.MultiScaleRoIAlign equals torchvision.ops.MultiScaleRoIAlign, and
prepare_qat_fx maps ``torchvision.ops.MultiScaleRoIAlign`` to qir's QAT module (≈ torchvision), through
convert and a bit-exact compile.

Runs only when selected (torchvision installed):
``/work/tvenv/bin/python -m pytest -m torchvision tests/real_models/test_multi_scale_roi_align_torchvision.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import qir
from qir.march import march_scope
from qir.nn import MultiScaleRoIAlign, qat, quantized
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

pytestmark = [pytest.mark.torchvision, pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")]
tv = pytest.importorskip("torchvision")
NAMES = ["0", "1", "2"]


def _boxes(gen: torch.Generator, k: int, h: int, w: int) -> torch.Tensor:
    xy = torch.rand(k, 2, generator=gen) * torch.tensor([w, h]) - 2
    wh = torch.rand(k, 2, generator=gen).square() * torch.tensor([w, h]) + 1
    return torch.cat([xy, xy + wh], 1)


@pytest.mark.parametrize("sr", [-1, 0, 2])
@pytest.mark.parametrize("canonical", [(224, 4), (56, 3)])
def test_float_module_equals_torchvision(sr: int, canonical: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sr + 7)
    x = {
        "0": torch.randn(2, 3, 64, 80, generator=gen, dtype=torch.float64),
        "1": torch.randn(2, 3, 32, 40, generator=gen, dtype=torch.float64),
        "pool": torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64),
        "2": torch.randn(2, 3, 16, 20, generator=gen, dtype=torch.float64),
    }
    boxes = [_boxes(gen, 12, 256, 320).double(), _boxes(gen, 9, 250, 300).double()]
    shapes = [(256, 320), (250, 300)]
    s0, k0 = canonical
    want = tv.ops.MultiScaleRoIAlign(NAMES, (3, 2), sr, canonical_scale=s0, canonical_level=k0)(x, boxes, shapes)
    got = MultiScaleRoIAlign(NAMES, (3, 2), sr, canonical_scale=s0, canonical_level=k0)(x, boxes, shapes)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c0 = nn.Conv2d(3, 4, 3, padding=1)
        self.c1 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.pool = tv.ops.MultiScaleRoIAlign(NAMES, 3, 2, canonical_scale=56)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
        f0 = self.c0(self.quant(x))
        f1 = self.c1(f0)
        feats = {"0": f0, "1": f1, "2": self.c2(f1)}
        return self.dequant(self.pool(feats, [b0, b1], [(64, 80), (64, 80)]))


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 16, 20, generator=gen), _boxes(gen, 6, 64, 80) * 2, _boxes(gen, 5, 64, 80) * 2


def test_torchvision_module_is_mapped_and_compiles_bitexact(tmp_path: Path) -> None:
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()})
        assert isinstance(prepared.get_submodule("pool"), qat.MultiScaleRoIAlign)
        for seed in range(4):
            prepared(*_inputs(seed))
        set_fake_quantize(prepared, "validation")
        converted = convert_fx(prepared.eval())
    pool = converted.get_submodule("pool")
    assert isinstance(pool, quantized.MultiScaleRoIAlign)
    report = check_model(converted, _inputs(0), march="bayes")
    assert report.ok and "torchvision.ops.MultiScaleRoIAlign" in str(report)
    path = tmp_path / "msr.hbm"
    compiled = compile_model(converted, list(_inputs(0)), hbm=path, opt=1)
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for seed in (5, 6):
            ins = _inputs(seed)
            want = converted(*ins)
            assert torch.equal(compiled(*ins), want) and torch.equal(loaded(*ins), want)
            assert int(((want - prepared(*ins)).abs().max() / pool.scale).round()) <= 1


def test_qat_module_approximates_torchvision() -> None:
    """QAT pooling on the same features: torchvision's output within one output LSB (fake quant rounding
    plus the 2**-12 sampling positions)."""
    gen = torch.Generator().manual_seed(3)
    x = {
        "0": torch.randn(2, 4, 32, 40, generator=gen),
        "1": torch.randn(2, 4, 16, 20, generator=gen),
        "2": torch.randn(2, 4, 8, 10, generator=gen),
    }
    boxes = [_boxes(gen, 20, 128, 160), _boxes(gen, 15, 128, 160)]
    shapes = [(128, 160), (128, 160)]
    ref = tv.ops.MultiScaleRoIAlign(NAMES, 4, -1, canonical_scale=112)
    m = qat.MultiScaleRoIAlign.from_float(ref, get_default_qat_qconfig())
    with torch.no_grad():
        m(x, boxes, shapes)  # observe the output range
        m.eval()
        got, want = m(x, boxes, shapes), ref(x, boxes, shapes)
    lsb = float(m.activation_post_process.scale)
    assert float((got - want).abs().max()) <= lsb
