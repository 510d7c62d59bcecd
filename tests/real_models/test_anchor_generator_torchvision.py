"""torchvision's AnchorGenerator: qir.nn.AnchorGenerator returns torchvision's anchors exactly, and
prepare_qat_fx maps torchvision's class by name, through convert, check_model and a compile whose
anchors are a float32 constant.

Runs only when selected (torchvision installed):
``/work/tvenv/bin/python -m pytest -m torchvision tests/real_models/test_anchor_generator_torchvision.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import qir
from qir.march import march_scope
from qir.nn import AnchorGenerator, qat, quantized
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
)

pytestmark = [pytest.mark.torchvision, pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")]
tv = pytest.importorskip("torchvision")
from torchvision.models.detection.image_list import ImageList  # noqa: E402
from torchvision.models.detection.rpn import AnchorGenerator as TVAnchorGenerator  # noqa: E402

CONFIGS = [
    (((32,), (64,), (128,)), ((0.5, 1.0, 2.0),) * 3),
    (((128, 256, 512),), ((0.5, 1.0, 2.0),)),
    ((16, 40, 96), (0.7, 1.3)),
]


@pytest.mark.parametrize(("sizes", "ratios"), CONFIGS)
def test_float_module_equals_torchvision(sizes: tuple, ratios: tuple) -> None:
    ref = TVAnchorGenerator(sizes, ratios)
    images = ImageList(torch.randn(2, 3, 100, 132), [(100, 130), (90, 132)])
    feats = [torch.randn(2, 4, 25, 33), torch.randn(2, 4, 13, 17), torch.randn(2, 4, 7, 9)][: len(ref.sizes)]
    want = ref(images, feats)
    # by keyword: a flat positional size list is refused as ambiguous with the plugin's feat_strides
    for got in (
        AnchorGenerator(sizes=sizes, aspect_ratios=ratios)(images, feats),
        AnchorGenerator(sizes=sizes, aspect_ratios=ratios)(images.tensors, feats),
    ):
        assert len(got) == len(want) and all(
            torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want, strict=True)
        )
    assert (
        AnchorGenerator(sizes=sizes, aspect_ratios=ratios).num_anchors_per_location() == ref.num_anchors_per_location()
    )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c1 = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.anchor = TVAnchorGenerator(((16, 32), (64,)), ((0.5, 1.0), (1.0, 2.0)))
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f1 = self.c1(self.quant(x))
        f2 = self.c2(f1)
        return self.dequant(f2), self.anchor(x, [f1, f2])[0]


def test_torchvision_module_is_mapped_and_compiles(tmp_path: Path) -> None:
    x = torch.randn(2, 3, 16, 24)
    ref = TVAnchorGenerator(((16, 32), (64,)), ((0.5, 1.0), (1.0, 2.0)))
    want = ref(ImageList(x, [(16, 24)] * 2), [torch.zeros(2, 4, 8, 12), torch.zeros(2, 4, 4, 6)])[0]
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(), {"": get_default_qat_qconfig()})
        assert isinstance(prepared.get_submodule("anchor"), qat.AnchorGenerator)
        prepared(x)
        converted = convert_fx(prepared.eval())
    assert isinstance(converted.get_submodule("anchor"), quantized.AnchorGenerator)
    report = check_model(converted, (x,), march="bayes")
    # checked against torchvision's row (float32 output), not unknown: quant, c1, c2, anchor, dequant
    assert report.ok and report.checked == 5 and "0 unknown" in str(report)
    path = tmp_path / "anchors.hbm"
    compiled = compile_model(converted, [x], hbm=path, opt=1)
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for out in (converted(x), compiled(x), loaded(x)):
            assert torch.equal(out[1], want)
