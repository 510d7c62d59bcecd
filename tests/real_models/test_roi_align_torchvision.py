"""torchvision's RoIAlign: qir.nn.RoIAlign equals torchvision.ops.roi_align, and prepare_qat_fx maps
``torchvision.ops.RoIAlign`` to qir's QAT module, through convert and a bit-exact compile.

Runs only when selected (torchvision installed):
``/work/tvenv/bin/python -m pytest -m torchvision tests/real_models/test_roi_align_torchvision.py``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

import qir
from qir.march import march_scope
from qir.nn import RoIAlign, qat, quantized
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


def _rois(seed: int, k: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    xy = torch.rand(k, 2, generator=gen) * 40 - 4
    wh = torch.rand(k, 2, generator=gen) * 30
    return torch.cat([torch.randint(0, 2, (k, 1), generator=gen).float(), xy, xy + wh], 1).double()


@pytest.mark.parametrize(("sr", "al", "ss"), list(itertools.product([-1, 0, 2], [False, True], [1.0, 0.5])))
def test_float_module_equals_torchvision(sr: int, al: bool, ss: float) -> None:
    x = torch.randn(2, 3, 17, 21, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rois = _rois(sr + 3)
    want = tv.ops.roi_align(x, rois, (3, 5), ss, sr, al)
    torch.testing.assert_close(RoIAlign((3, 5), ss, sr, al)(x, rois), want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(tv.ops.RoIAlign((3, 5), ss, sr, al)(x, rois), want)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.roi = tv.ops.RoIAlign((3, 3), 0.5, -1, False)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.roi(self.c1(self.quant(x)), [b0, b1]))


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    r = _rois(seed, 6).float()
    return torch.randn(2, 3, 16, 16, generator=gen), r[:3, 1:], r[3:, 1:]


def test_torchvision_module_is_mapped_and_compiles_bitexact(tmp_path: Path) -> None:
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()})
        assert isinstance(prepared.get_submodule("roi"), qat.RoIAlign)
        prepared(*_inputs(0))
        set_fake_quantize(prepared, "validation")
        converted = convert_fx(prepared.eval())
    assert isinstance(converted.get_submodule("roi"), quantized.RoIAlign)
    report = check_model(converted, _inputs(0), march="bayes")
    assert report.ok and "torchvision.ops.RoIAlign" in str(report)
    path = tmp_path / "roi.hbm"
    compiled = compile_model(converted, list(_inputs(0)), hbm=path, opt=1)
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for seed in (5, 6):
            ins = _inputs(seed)
            want = converted(*ins)
            assert torch.equal(compiled(*ins), want) and torch.equal(loaded(*ins), want)
            assert int((want - prepared(*ins)).abs().max() / converted.get_submodule("roi").scale) <= 1
