"""AnchorGenerator without torchvision: float32 anchors from shapes only, the same at every stage.

The float module is checked against a reference written here (torchvision's definition spelled
out with Python numbers); the QAT, converted, compiled and loaded models all return exactly those
anchors, whatever the feature maps' values or dtypes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import qir
from qir.march import march_scope
from qir.nn import AnchorGenerator, qat, quantized
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
)

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
QC = get_default_qat_qconfig()


def _reference(
    sizes: tuple[tuple[int, ...], ...],
    ratios: tuple[tuple[float, ...], ...],
    hw: tuple[int, int],
    grids: list[tuple[int, int]],
) -> torch.Tensor:
    rows = []
    for (gh, gw), ss, rs in zip(grids, sizes, ratios, strict=True):
        cells = []
        for r in rs:
            hr = math.sqrt(r)
            for s in ss:
                w, h = s / hr, hr * s
                cells.append([round(-w / 2), round(-h / 2), round(w / 2), round(h / 2)])
        sy, sx = hw[0] // gh, hw[1] // gw
        for i in range(gh):
            for j in range(gw):
                rows += [[j * sx + c[0], i * sy + c[1], j * sx + c[2], i * sy + c[3]] for c in cells]
    return torch.tensor(rows, dtype=torch.float32)


SIZES = ((16, 32), (64,), (128, 200))
RATIOS = ((0.5, 1.0, 2.0), (1.0,), (0.7, 1.5))


def test_float_module_matches_the_reference() -> None:
    grids = [(12, 16), (6, 8), (3, 4)]
    feats = [torch.randn(2, 4, h, w) for h, w in grids]
    m = AnchorGenerator(SIZES, RATIOS)
    out = m(torch.zeros(2, 3, 50, 66), feats)
    assert len(out) == 2 and out[0].dtype == torch.float32
    want = _reference(SIZES, RATIOS, (50, 66), grids)
    assert torch.equal(out[0], want) and torch.equal(out[0], out[1])
    assert m.num_anchors_per_location() == [6, 1, 4]
    codes = [torch.randint(-128, 128, f.shape, dtype=torch.int8) for f in feats]
    assert torch.equal(m(torch.zeros(2, 3, 50, 66), codes)[0], out[0])  # shapes only


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        (([8, 16, 32],), {}, r"AnchorGenerator\(\[8, 16, 32\], \.\.\.\) is ambiguous.*feat_strides.*\(\(8,\), \(16,\)"),
        (([8, 16, 32], [1.0]), {}, r"is ambiguous.*sizes=\(8, 16, 32\)"),
        (([8, 16, 32], [1.0], [0.5, 1.0, 2.0]), {}, r"at most 2 positional arguments, got 3"),
        (([8, 16, 32],), {"scales": [1.0], "ratios": [1.0]}, r"the plugin's argument\(s\) ratios, scales"),
        ((), {"feat_strides": [8, 16]}, r"plugin's argument\(s\) feat_strides.*torchvision's AnchorGenerator\(sizes="),
        ((((8,),),), {"sizes": ((8,),)}, r"sizes both by position and by keyword"),
    ],
)
def test_calls_written_for_the_plugin_are_refused(args: tuple[Any, ...], kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(TypeError, match=words) as e:
        AnchorGenerator(*args, **kwargs)
    assert "ambiguous" in str(e.value) or "both by position" in str(e.value) or "horizon_plugin_pytorch" in str(e.value)


def test_single_level_forms() -> None:
    m = AnchorGenerator(sizes=(32, 64), aspect_ratios=(0.5, 2.0))  # flat sizes by keyword: one size per level
    assert m.sizes == ((32,), (64,)) and m.aspect_ratios == ((0.5, 2.0), (0.5, 2.0))
    with pytest.raises(ValueError, match=r"2 feature maps for 1 anchor levels|1 feature maps for 2 anchor levels"):
        m(torch.zeros(1, 3, 8, 8), [torch.zeros(1, 1, 4, 4)])
    with pytest.raises(TypeError, match=r"AnchorGenerator: image_list must be torchvision's ImageList"):
        m([1, 2], [torch.zeros(1, 1, 4, 4)])
    with pytest.raises(TypeError, match=r"AnchorGenerator\.from_float takes qir\.nn\.AnchorGenerator"):
        qat.AnchorGenerator.from_float(nn.ReLU(), QC)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c1 = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.anchor = AnchorGenerator(((16, 32), (64,)), ((0.5, 1.0), (1.0, 2.0)))
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f1 = self.c1(self.quant(x))
        f2 = self.c2(f1)
        anchors = self.anchor(x, [f1, f2])
        return self.dequant(f2), anchors[0], anchors[1]


def test_whole_flow_anchors_are_a_float32_constant(tmp_path: Path) -> None:
    x = torch.randn(2, 3, 16, 24)
    want = AnchorGenerator(((16, 32), (64,)), ((0.5, 1.0), (1.0, 2.0)))(
        x, [torch.zeros(1, 1, 8, 12), torch.zeros(1, 1, 4, 6)]
    )[0]
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(), {"": QC})
        assert isinstance(prepared.get_submodule("anchor"), qat.AnchorGenerator)
        prepared(x)
        converted = convert_fx(prepared.eval())
    assert isinstance(converted.get_submodule("anchor"), quantized.AnchorGenerator)
    path = tmp_path / "anchors.hbm"
    compiled = compile_model(converted, [x], hbm=path, opt=1)
    assert "anchors" in {i.op for i in compiled.program.instructions}
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for seed in (1, 2):
            xs = torch.randn(2, 3, 16, 24, generator=torch.Generator().manual_seed(seed))
            outs = [prepared(xs), converted(xs), compiled(xs), loaded(xs)]
            for o in outs:
                assert o[1].dtype == torch.float32 and torch.equal(o[1], want) and torch.equal(o[2], want)
            assert torch.equal(outs[2][0], outs[1][0]) and torch.equal(outs[3][0], outs[1][0])
    with pytest.raises(Exception, match=r"compiled for image / feature shapes"):
        compiled(torch.randn(2, 3, 32, 24))
