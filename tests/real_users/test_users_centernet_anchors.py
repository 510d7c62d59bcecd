"""CenterNet and YOLOv5 heads as users write them: CenterNet's ``_sigmoid`` helper,
``torch.clamp(x.sigmoid_(), min=1e-4, max=1 - 1e-4)`` on the heatmap after a bilinear
``F.interpolate(scale_factor=2)``, and a YOLOv5 anchor head that reshapes with
``p.view(b, na, no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()`` (sizes from ``f.shape``) and applies
``.sigmoid()``. Calibration -> QAT -> convert -> check -> compile -> run.

An in-place ``x.sigmoid_()`` is traced as ``x.sigmoid()`` with later uses of ``x`` reading the
result, so it becomes the same table lookup (it stayed an opaque call: QAT ran a float sigmoid
without an output fake quant and convert refused it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from names_flow import fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.quantization import DeQuantStub, QuantStub, fuse_fx, get_default_qat_qconfig, prepare_qat_fx


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x.sigmoid_(), min=1e-4, max=1 - 1e-4)


class CenterNetYolo(nn.Module):
    def __init__(self, c: int = 8, classes: int = 3, na: int = 3) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.backbone = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1), nn.ReLU(), nn.Conv2d(c, c, 3, 2, 1), nn.ReLU())
        self.hm = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(c, classes, 1))
        self.wh = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(c, 2, 1))
        self.anchor_head = nn.Conv2d(c, na * (5 + classes), 1)
        self.na, self.no = na, 5 + classes
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f = self.backbone(self.quant(x))
        up = F.interpolate(f, scale_factor=2, mode="bilinear", align_corners=False)
        hm = _sigmoid(self.hm(up))
        b, _, ny, nx = f.shape
        p = self.anchor_head(f).view(b, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
        return self.dequant(hm), self.dequant(self.wh(up)), self.dequant(p.sigmoid().reshape(b, -1, self.no))


def _image() -> tuple[torch.Tensor]:
    return (torch.rand(2, 3, 16, 16) * 2 - 1,)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_an_in_place_sigmoid_becomes_a_quantized_table_lookup() -> None:
    qat = prepare_qat_fx(CenterNetYolo().eval(), {"": get_default_qat_qconfig()})
    kinds = {n: type(m).__name__ for n, m in qat.named_modules() if "_generated_" in n}
    assert sorted(kinds.values()).count("UnaryLUT") == 2  # the heatmap's sigmoid_ and the anchors' sigmoid
    assert not [n for n in qat.graph.nodes if n.op == "call_method" and n.target == "sigmoid_"]


def test_later_uses_of_the_mutated_tensor_read_the_result() -> None:
    class Mutates(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            z = y.sigmoid_()
            return y + z  # y was changed in place: both are sigmoid(2x)

    class MutatesAView(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = x * 2
            p[:, :2].sigmoid_()  # YOLOv3's in-place decode of a slice: it changes p, so it stays in place
            return p

    x = torch.randn(3, 4)
    for model in (Mutates(), MutatesAView()):
        assert torch.allclose(fuse_fx(model)(x), model(x))


def test_the_heads_calibrate_train_convert_and_compile() -> None:
    result = fx_flow(CenterNetYolo().eval(), _image, steps=2)
    hm, wh, anchors = result.integer_out
    assert hm.shape == (2, 3, 8, 8) and wh.shape == (2, 2, 8, 8) and anchors.shape == (2, 48, 8)
    assert float(hm.min()) >= 1e-4 and float(hm.max()) <= 1 - 1e-4
    lsb = max(
        float(m.activation_post_process.scale)
        for n, m in result.qat.named_modules()
        if n.startswith(("hm.", "wh.", "_generated_")) and getattr(m, "activation_post_process", None) is not None
    )
    assert result.max_error() <= 2.01 * lsb  # measured 0: validation QAT computes the integer grid
