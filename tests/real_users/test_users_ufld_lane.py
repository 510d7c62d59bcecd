"""Ultra-Fast-Lane-Detection (row anchors) as its users port it to the BPU: a ResNet-style backbone,
``self.pool(fea).view(-1, 1800)`` into a ``Linear -> ReLU -> Linear`` classifier reshaped with
``.view(-1, *self.cls_dim)`` to (gridding cells + 1, row anchors, lanes), and the demo's decoding
moved into the model for deployment: rows flipped, ``softmax`` over the cells, the expected cell
``sum(prob * idx)``, and lanes with no point (``argmax == griding_num``) zeroed. A float backbone
checkpoint is loaded with ``load_state_dict(..., strict=False)`` before prepare (the auxiliary
segmentation branch is training-only). Calibration -> QAT -> convert -> check -> compile -> run: the
decoding compiles as the program's float part and the artifact returns the converted model's lane
positions bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from names_flow import finish
from torch import nn

from qir.march import March, march_scope
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)

GRIDING_NUM, ROW_ANCHORS, LANES = 8, 6, 2


def conv_bn(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1, self.layer2, self.layer3 = conv_bn(3, 8, 2), conv_bn(8, 16, 2), conv_bn(16, 16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x2 = self.layer1(x)
        x3 = self.layer2(x2)
        return x2, x3, self.layer3(x3)


class ParsingNet(nn.Module):
    def __init__(self, cls_dim: tuple[int, int, int] = (GRIDING_NUM + 1, ROW_ANCHORS, LANES), use_aux: bool = False):
        super().__init__()
        self.cls_dim, self.use_aux = cls_dim, use_aux
        self.total_dim = cls_dim[0] * cls_dim[1] * cls_dim[2]
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.model = Backbone()
        self.pool = nn.Conv2d(16, 4, 1)
        self.cls = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, self.total_dim))
        if use_aux:  # training only: a segmentation branch on x3
            self.aux = nn.Sequential(conv_bn(16, 8, 1), nn.Conv2d(8, LANES + 1, 1))
        self.register_buffer("idx", torch.arange(1, cls_dim[0], dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, fea = self.model(self.quant(x))
        fea = self.pool(fea).view(-1, 128)
        group_cls = self.dequant(self.cls(fea)).view(-1, *self.cls_dim)
        return group_cls, self.decode(group_cls)

    def decode(self, out: torch.Tensor) -> torch.Tensor:
        """The demo's numpy decoding in torch: (B, cells + 1, rows, lanes) -> (B, rows, lanes) positions."""
        out = torch.flip(out, [2])
        prob = out[:, :-1].softmax(dim=1)
        loc = (prob * self.idx).sum(dim=1)
        has_point = out.argmax(dim=1) != self.cls_dim[0] - 1
        return loc * has_point.float()


def _images() -> tuple[torch.Tensor]:
    return (torch.rand(2, 3, 32, 64),)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def _pretrained() -> ParsingNet:
    """A float model with the backbone and classifier of a 'checkpoint' trained with the aux branch."""
    trained = ParsingNet(use_aux=True)
    model = ParsingNet().eval()
    missing, unexpected = model.load_state_dict(trained.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith("aux.") for k in unexpected)
    return model


def test_the_float_model_decodes_lanes() -> None:
    model = _pretrained()
    with torch.no_grad():
        group_cls, loc = model(*_images())
    assert group_cls.shape == (2, GRIDING_NUM + 1, ROW_ANCHORS, LANES) and loc.shape == (2, ROW_ANCHORS, LANES)
    assert float(loc.min()) >= 0 and float(loc.max()) <= GRIDING_NUM


def test_the_lane_detector_calibrates_trains_converts_and_compiles_with_its_decoding() -> None:
    calib = prepare_qat_fx(_pretrained(), {"": get_default_calib_qconfig()})
    calib.eval()
    with torch.no_grad():
        for _ in range(4):
            calib(*_images())
    qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
    qat.train()
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(3):
        group_cls, _ = qat(*_images())
        loss = torch.nn.functional.cross_entropy(group_cls, torch.randint(0, GRIDING_NUM + 1, (2, ROW_ANCHORS, LANES)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    converted = convert_fx(qat)
    result = finish(qat, converted, _images())  # check, compile, and the artifact == converted on both outputs
    lsb = float(qat.get_submodule("cls.2").activation_post_process.scale)
    assert result.max_error() <= 2.01 * lsb, (result.max_error(), lsb)
    # the decoding ran on the same logits: lane positions agree with the QAT model's
    assert torch.equal(result.integer_out[1], ParsingNet().decode(result.integer_out[0]))
