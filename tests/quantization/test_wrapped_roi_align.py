"""A two-stage detector's second stage in a wrapped method: RoIAlign on the backbone features and on
boxes the Python computes, then a box head conv. The features are the module's one quantized input
(through its generated input stub); the boxes are an input RoIAlign takes as float (``float_inputs``),
passed as they are. Calibration -> strict load -> QAT -> validation == convert -> compile."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import qir.nn as qnn
import qir.nn.qat as qat_nn
import qir.nn.quantized as int_nn
from qir.march import march_scope
from qir.quantization import (
    FakeQuantState,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
    split_wrapped_tail,
)
from qir.utils.fx_helper import wrap


@pytest.fixture(params=["bayes", "bernoulli2"])
def march(request: pytest.FixtureRequest) -> Iterator[str]:
    torch.manual_seed(0)
    with march_scope(request.param):
        yield request.param


class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.rpn = nn.Conv2d(8, 4, 1)
        # called only inside the wrapped second stage
        self.roi_align = qnn.RoIAlign(output_size=3, spatial_scale=0.5, sampling_ratio=2, aligned=True)
        self.box_head = nn.Conv2d(8, 4, 3)

    def forward(self, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feat = self.backbone(self.quant(img))
        return self.second_stage(feat, self.rpn(feat), img.shape[-1])

    @wrap()
    def second_stage(self, feat: torch.Tensor, rpn: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # proposals from the RPN map: the top cells per image, as float boxes (x1, y1, x2, y2)
        n, _, _, w = rpn.shape
        score = rpn[:, 0].flatten(1)
        top = score.topk(3, dim=1).indices
        ys, xs = (top // w).float(), (top % w).float()
        stride = size / w
        boxes = [
            torch.stack([xs[i] * stride, ys[i] * stride, (xs[i] + 2) * stride, (ys[i] + 2) * stride], -1)
            for i in range(n)
        ]
        rois = self.roi_align(feat, boxes)  # features quantized by its stub, boxes float
        return self.box_head(rois).flatten(1), torch.cat(boxes)


def _images(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16)


def test_roi_align_inside_a_wrapped_method_through_compile(march: str) -> None:
    calib = prepare_qat_fx(TwoStage(), {"": get_default_calib_qconfig()}, (_images(2),))
    calib.eval()
    with torch.no_grad():
        for _ in range(3):
            calib(_images())
    buf = io.BytesIO()
    torch.save(calib.state_dict(), buf)
    buf.seek(0)
    qat = prepare_qat_fx(TwoStage(), {"": get_default_qat_qconfig()}, (_images(2),))
    qat.load_state_dict(torch.load(buf), strict=True)
    assert isinstance(qat.get_submodule("roi_align"), qat_nn.RoIAlign)
    assert "_generated_wrapped_quant_roi_align.activation_post_process.scale" in qat.state_dict()
    optimizer = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for _ in range(2):
        out, _ = qat(_images())
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    converted = convert_fx(qat)
    assert isinstance(converted.get_submodule("roi_align"), int_nn.RoIAlign)
    x = _images(6)
    want = converted(x)
    assert all(torch.equal(a, b) for a, b in zip(qat(x), want, strict=True))
    split = split_wrapped_tail(converted)
    program = compile_model(split.head, [_images(1)])
    assert all(torch.equal(a, b) for a, b in zip(split.run(program, x), want, strict=True))


class BoxesFirst(TwoStage):
    @wrap()
    def second_stage(self, feat: torch.Tensor, rpn: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        boxes = torch.tensor([[0.0, 0.0, 0.0, 4.0, 4.0]])
        return self.box_head(self.roi_align(feat, boxes, feat)).flatten(1), boxes  # type: ignore[call-arg]


def test_a_second_quantized_input_is_refused_with_the_fix(march: str) -> None:
    qat = prepare_qat_fx(BoxesFirst(), {"": get_default_qat_qconfig()})  # no example run: the float call fails too
    with pytest.raises(TypeError) as err:
        qat(_images())
    message = str(err.value)
    assert "module 'roi_align' (RoIAlign) is called inside a wrapped method" in message
    assert "'_generated_wrapped_quant_roi_align'" in message
    assert "it takes one float tensor, then 'boxes' as it takes them" in message
    assert "qconfig_dict={'module_name': [('roi_align', None)]}" in message
