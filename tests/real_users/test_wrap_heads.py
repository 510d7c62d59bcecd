"""fx_wrap'ed post-processing, as Horizon users write it: a RetinaNet-style head shared over FPN
levels with a wrapped decode method, and a segmentation head with a wrapped argmax.

The plugin's converted model hands a wrapped function QTensors, and whatever it does with them
outside the QTensor's own op table runs on the dequantized floats. qir passes the dequantized
floats directly (docs/migration.md, "Behaviour decisions"): the wrapped code sees what it saw in
QAT, ``codes * scale`` instead of fake-quantized floats.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qir.march import march_scope
from qir.quantization import (
    CompileError,
    QuantStub,
    check_model,
    compile_model,
    convert,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import ConvertError
from qir.quantization.fake_quantize import float_fake_quant
from qir.utils.fx_helper import wrap as fx_wrap


@pytest.fixture(autouse=True)
def _bayes() -> Iterator[None]:
    torch.manual_seed(0)
    with march_scope("bayes"):
        yield


#: what the last post-process call received (the tests compare the converted and QAT models')
SEEN: list[torch.Tensor] = []


class RetinaHead(nn.Module):
    """One conv tower + cls / reg convs, applied to every FPN level (weights shared)."""

    def __init__(self, channels: int = 8, num_anchors: int = 3, num_classes: int = 4) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.num_anchors = num_anchors
        self.cls_tower = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(channels, num_anchors * num_classes, 3, padding=1)
        self.reg = nn.Conv2d(channels, num_anchors * 4, 3, padding=1)

    def forward(self, feats: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cls_scores, bbox_preds = [], []
        for f in feats:
            cls_scores.append(self.cls(self.cls_tower(f)))
            bbox_preds.append(self.reg(f))
        return cls_scores, bbox_preds


class RetinaNet(nn.Module):
    """Backbone, FPN levels P3 and P4 (P4 a strided conv of P3, as RetinaNet's P6 / P7: its own
    scale), the head shared by both levels (torchvision's RetinaNet head: conv + ReLU tower, no
    norm), and a wrapped post-process: anchors, box decoding, sigmoid + threshold, top-k."""

    strides = (4, 8)

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
        )
        self.p4 = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU())
        self.head = RetinaHead()

    def forward(self, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p3 = self.backbone(self.quant(img))
        cls_scores, bbox_preds = self.head([p3, self.p4(p3)])
        return self._post_process(cls_scores, bbox_preds)

    @fx_wrap()
    def _post_process(
        self, cls_scores: list[torch.Tensor], bbox_preds: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        SEEN[:] = [t.detach().clone() for t in (*cls_scores, *bbox_preds)]
        boxes, scores, labels = [], [], []
        for stride, cls, reg in zip(self.strides, cls_scores, bbox_preds, strict=True):
            n, _, h, w = cls.shape
            ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            centers = torch.stack([xs, ys], -1).float().add(0.5).mul(stride).reshape(-1, 1, 2)
            anchors = torch.cat([centers - 2 * stride, centers + 2 * stride], -1).expand(-1, 3, 4).reshape(-1, 4)
            cls = cls.permute(0, 2, 3, 1).reshape(n, -1, self.head.num_classes).sigmoid()
            reg = reg.permute(0, 2, 3, 1).reshape(n, -1, 4)
            wh = anchors[:, 2:] - anchors[:, :2]
            ctr = (anchors[:, :2] + anchors[:, 2:]) / 2 + reg[..., :2] * wh
            size = wh * reg[..., 2:].clamp(max=4.0).exp()
            boxes.append(torch.cat([ctr - size / 2, ctr + size / 2], -1))
            score, label = cls.max(-1)
            scores.append(torch.where(score > 0.05, score, torch.zeros_like(score)))
            labels.append(label)
        score_all = torch.cat(scores, 1)
        top, idx = score_all.topk(20, dim=1)
        box_all = torch.cat(boxes, 1).gather(1, idx[..., None].expand(-1, -1, 4))
        return box_all, top, torch.cat(labels, 1).gather(1, idx)


def _qat(model: nn.Module, shape: tuple[int, ...], steps: int = 4) -> nn.Module:
    prepared = prepare_qat_fx(model, {"": get_default_qat_qconfig()})
    prepared.train()
    for _ in range(steps):
        prepared(torch.randn(*shape))
    prepared.eval()
    set_fake_quantize(prepared, "validation")
    return prepared


def _lsb_diff(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> int:
    return int(((a - b).abs() / scale.reshape(-1)[0]).round().max())


def _head_scales(converted: nn.Module) -> list[torch.Tensor]:
    return [m.scale for name, m in converted.named_modules() if name.startswith("_generated_wrap_dequant_")]


def test_retinanet_wrapped_post_process_converts_and_runs() -> None:
    qat = _qat(RetinaNet(), (4, 3, 32, 32))
    before = copy.deepcopy(qat.state_dict())
    converted = convert_fx(qat)
    assert all(torch.equal(v, before[k]) for k, v in qat.state_dict().items())  # the QAT model is untouched

    x = torch.randn(8, 3, 32, 32)
    boxes_q, scores_q, labels_q = converted(x)
    seen_q = list(SEEN)
    # the wrapped method receives float32 tensors: codes * scale, one generated stub per head
    # output (each level has its own scale: the head is shared, its observers are per call site)
    assert all(t.dtype == torch.float32 for t in seen_q)
    scales = _head_scales(converted)
    assert len({float(s.reshape(-1)[0]) for s in scales}) == 4

    # the QAT model in validation state runs its integer twin: the same inputs, the same results
    boxes_v, scores_v, labels_v = qat(x)
    assert all(torch.equal(a, b) for a, b in zip(seen_q, SEEN, strict=True))
    assert torch.equal(boxes_q, boxes_v) and torch.equal(scores_q, scores_v) and torch.equal(labels_q, labels_v)

    # against the float fake-quant simulation: the requantization bound, 1 LSB per requantizing
    # op (backbone conv, tower conv and the cls / reg conv: 3 in a row)
    with float_fake_quant():
        boxes_f, scores_f, labels_f = qat(x)
    seen_f = list(SEEN)
    for got, want, scale in zip(seen_q, seen_f, scales, strict=True):
        assert _lsb_diff(got, want, scale) <= 3  # measured: at most 1
        assert (got == want).float().mean() >= 0.9  # measured: 95 to 99.9 % over 4 seeds
    # and the decoded results follow: same top-k scores up to the threshold's and the LSBs' effect
    assert (scores_q - scores_f).abs().max() <= 0.05
    assert (labels_q == labels_f).float().mean() >= 0.85  # measured: 0.96 to 1.0 over 4 seeds
    assert boxes_q.shape == boxes_f.shape == (8, 20, 4)
    # for the same anchor, 1 LSB d of a regression output moves a corner by at most d * anchor size
    # (32 at most) for the centre plus half the size change, anchor * e^4 * d; near-tied scores can
    # pick another anchor, so most (not all) kept boxes are within that
    lsb = max(float(s.reshape(-1)[0]) for s in scales[2:])
    close = (boxes_q - boxes_f).abs().amax(-1) <= 32 * lsb * (1 + math.exp(4) / 2) + 1e-4
    assert close.float().mean() >= 0.75  # measured: 0.89 to 0.95 over 4 seeds


def test_retinanet_check_and_compile() -> None:
    converted = convert_fx(_qat(RetinaNet(), (4, 3, 32, 32)))
    x = torch.randn(1, 3, 32, 32)
    report = check_model(converted, x)
    assert report.ok
    assert len(report.cpu_nodes) == 1  # the wrapped post-process, outside the quantized region
    with pytest.raises(CompileError, match=r"RetinaNet._post_process.*never Python code.*split_wrapped_tail"):
        compile_model(converted, [x])


class DeployRetina(RetinaNet):
    """The deployable BPU part: the same weights, returning what the post-process receives."""

    def forward(self, img: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        p3 = self.backbone(self.quant(img))
        cls_scores, bbox_preds = self.head([p3, self.p4(p3)])
        return (*cls_scores, *bbox_preds)


def test_retinanet_bpu_part_compiles_bit_exact_with_wrapped_inputs() -> None:
    """The route the compile error names: compile the head outputs, run the post-process on them."""
    torch.manual_seed(1)
    qat = _qat(RetinaNet(), (4, 3, 32, 32))
    converted = convert_fx(qat)
    deploy = prepare_qat_fx(DeployRetina(), {"": get_default_qat_qconfig()})
    deploy.load_state_dict(qat.state_dict())
    deploy.eval()
    set_fake_quantize(deploy, "validation")
    deploy_int = convert_fx(deploy)
    x = torch.randn(2, 3, 32, 32)
    converted(x)
    compiled = compile_model(deploy_int, [x], opt=1)
    codes = compiled(x)
    assert all(c.dtype == torch.int8 for c in codes)  # no DeQuantStub in DeployRetina: the program returns codes
    for c, scale, want in zip(codes, _head_scales(converted), SEEN, strict=True):
        assert torch.equal(c.float() * scale.reshape(-1)[0], want)


@fx_wrap
def seg_post_process(logits: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Float upsampling to the image and per-pixel class: the usual segmentation tail."""
    return F.interpolate(logits, size=size, mode="bilinear", align_corners=False).argmax(1)


class SegNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU6(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        self.classifier = nn.Conv2d(16, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return seg_post_process(self.classifier(self.body(self.quant(x))), (32, 32))


def test_segmentation_wrapped_argmax() -> None:
    qat = _qat(SegNet(), (4, 3, 32, 32))
    converted = convert_fx(qat)
    x = torch.randn(4, 3, 32, 32)
    got, want = converted(x), qat(x)
    assert got.dtype == torch.int64 and got.shape == (4, 32, 32)
    assert (got == want).float().mean() >= 0.97
    assert check_model(converted, x[:1]).ok


@fx_wrap
def split_pair(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return values * indices


@fx_wrap
def takes_pair(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return pair[0] * pair[1]


class PairNet(nn.Module):
    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.whole = whole
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.max(self.conv(self.quant(x)), 1)
        return takes_pair(r) if self.whole else split_pair(r[0], r[1])


def test_wrapped_function_receiving_values_and_indices() -> None:
    converted = convert_fx(_qat(PairNet(whole=False), (2, 3, 8, 8)))
    x = torch.randn(2, 3, 8, 8)
    assert converted(x).dtype == torch.float32  # the values are dequantized, the indices passed as they are
    with pytest.raises(ConvertError, match=r"takes_pair at node 'takes_pair' receives the whole \(values, indices\)"):
        convert_fx(_qat(PairNet(whole=True), (2, 3, 8, 8)))


class EagerWrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return seg_post_process(self.conv(self.quant(x)), (8, 8))


def test_eager_convert_refuses_wrapped_function_on_codes() -> None:
    model = EagerWrapped()
    model.qconfig = get_default_qat_qconfig()
    qat = prepare_qat(model)
    qat(torch.randn(2, 3, 8, 8))
    with pytest.raises(ConvertError, match=r"seg_post_process receives quantized tensors.*DeQuantStub"):
        convert(qat)


class TrainingBranch(nn.Module):
    """Seed 001's RetinaNet pattern: the wrapped post-process branches on ``self.training``."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[str, torch.Tensor]:
        return self._post_process(self.conv(self.quant(x)))

    @fx_wrap()
    def _post_process(self, y: torch.Tensor) -> tuple[str, torch.Tensor]:
        if self.training:
            return "loss", y.square().mean()
        return "decode", y.sigmoid()


def test_wrapped_method_sees_the_model_training_mode() -> None:
    x = torch.randn(2, 3, 4, 4)
    prepared = prepare_qat_fx(TrainingBranch(), {"": get_default_qat_qconfig()})
    prepared.train()
    assert prepared(x)[0] == "loss"
    prepared.eval()
    assert prepared(x)[0] == "decode"
    twin = copy.deepcopy(prepared).train()  # a copy shares the bound module: each call sets the mode first
    assert twin(x)[0] == "loss" and prepared(x)[0] == "decode"
    converted = convert_fx(prepared)
    assert converted(x)[0] == "decode"
    converted.train()
    assert converted(x)[0] == "loss"
