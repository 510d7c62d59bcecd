"""A RetinaNet ported from the plugin's example: backbone and head in the traced graph, and a
wrapped post-process that generates anchors and runs a small conv head of its own (an IoU
branch on the regression features) before decoding.

The seeds say of an fx_wrap'ed method that "the modules called within the method can still be
set with qconfig, and can be replaced by prepare_qat_fx and convert_fx": the IoU convs train as
QAT convs and deploy as integer convs, and QAT validation equals the converted model bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import qir.nn.qat as qat_nn
import qir.nn.quantized as int_nn
from qir.march import march_scope
from qir.quantization import (
    CompileError,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import CONVERT_PATH_KEY
from qir.utils.fx_helper import wrap as fx_wrap


@pytest.fixture(params=["bayes", "bernoulli2"])
def march(request: pytest.FixtureRequest) -> Iterator[str]:
    torch.manual_seed(0)
    with march_scope(request.param):
        yield request.param


class RetinaNet(nn.Module):
    strides = (4, 8)
    num_anchors = 3
    num_classes = 4

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.p4 = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(8, self.num_anchors * self.num_classes, 3, padding=1)
        self.reg = nn.Conv2d(8, self.num_anchors * 4, 3, padding=1)
        # called only inside the wrapped post-process
        self.iou_tower = nn.Conv2d(self.num_anchors * 4, 8, 1)
        self.iou_act = nn.ReLU()
        self.iou = nn.Conv2d(8, self.num_anchors, 1)

    def forward(self, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p3 = self.backbone(self.quant(img))
        p4 = self.p4(p3)
        return self._post_process([self.cls(p3), self.cls(p4)], [self.reg(p3), self.reg(p4)])

    @fx_wrap()
    def _post_process(
        self, cls_scores: list[torch.Tensor], bbox_preds: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        boxes, scores, labels = [], [], []
        for stride, cls, reg in zip(self.strides, cls_scores, bbox_preds, strict=True):
            n, _, h, w = cls.shape
            ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            centers = torch.stack([xs, ys], -1).float().add(0.5).mul(stride).reshape(-1, 1, 2)
            anchors = torch.cat([centers - 2 * stride, centers + 2 * stride], -1).expand(-1, 3, 4).reshape(-1, 4)
            iou = self.iou(self.iou_act(self.iou_tower(reg))).permute(0, 2, 3, 1).reshape(n, -1, 1)
            cls = cls.permute(0, 2, 3, 1).reshape(n, -1, self.num_classes).sigmoid() * iou.sigmoid()
            reg = reg.permute(0, 2, 3, 1).reshape(n, -1, 4)
            wh = anchors[:, 2:] - anchors[:, :2]
            ctr = (anchors[:, :2] + anchors[:, 2:]) / 2 + reg[..., :2] * wh
            size = wh * reg[..., 2:].clamp(max=4.0).exp()
            boxes.append(torch.cat([ctr - size / 2, ctr + size / 2], -1))
            score, label = cls.max(-1)
            scores.append(score)
            labels.append(label)
        top, idx = torch.cat(scores, 1).topk(20, dim=1)
        box_all = torch.cat(boxes, 1).gather(1, idx[..., None].expand(-1, -1, 4))
        return box_all, top, torch.cat(labels, 1).gather(1, idx)


def trained_retinanet() -> torch.fx.GraphModule:
    """A RetinaNet after three QAT steps, in validation state."""
    x = torch.randn(2, 3, 32, 32)
    prepared = prepare_qat_fx(RetinaNet(), {"": get_default_qat_qconfig()}, (x,))
    optimizer = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    for _ in range(3):
        box, score, _ = prepared(torch.randn(4, 3, 32, 32))
        (box.mean() - score.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    prepared.eval()
    set_fake_quantize(prepared, "validation")
    return prepared


def test_retinanet_wrapped_modules_qat_validation_equals_converted(march: str) -> None:
    float_iou = RetinaNet().iou.weight.clone()
    qat = trained_retinanet()
    for path in ("iou_tower", "iou"):
        assert isinstance(qat.get_submodule(path), qat_nn.Conv2d)
    assert not torch.equal(qat.iou.weight, float_iou)  # the optimizer trained it
    converted = convert_fx(qat)
    assert converted.meta[CONVERT_PATH_KEY] == "quantize pass"
    for path in ("iou_tower", "iou"):
        assert isinstance(converted.get_submodule(path), int_nn.Conv2d)
    x = torch.randn(8, 3, 32, 32)
    assert all(torch.equal(a, b) for a, b in zip(converted(x), qat(x), strict=True))


def test_retinanet_wrapped_modules_check_and_compile(march: str) -> None:
    converted = convert_fx(trained_retinanet())
    x = torch.randn(1, 3, 32, 32)
    assert check_model(converted, x).ok
    with pytest.raises(
        CompileError,
        match=r"RetinaNet._post_process.*never Python code. The integer modules it calls \('iou_tower', 'iou'\)",
    ):
        compile_model(converted, [x])
