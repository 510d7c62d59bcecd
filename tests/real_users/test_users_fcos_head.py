"""An FCOS / RetinaNet-style head as users port it: one QuantStub per FPN level, classification and
box towers shared by all five levels, a learnable ``Scale`` per level on the box regression,
centerness, and the classification bias initialised to the focal-loss prior.

The towers use BatchNorm2d (neither march's table has GroupNorm). The original Scale, ``x * self.scale``,
is refused at prepare naming the parameter; with it behind a QuantStub the head calibrates, trains,
converts and compiles on Bayes."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from names_flow import fx_flow
from torch import nn
from torch.nn.quantized import FloatFunctional

from qir.march import March, march_scope
from qir.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat_fx
from qir.quantization.prepare_checks import UnconvertibleModelError

LEVELS = 5


class Scale(nn.Module):
    """FCOS's learnable scalar per level; its parameter is quantized like the input it multiplies."""

    def __init__(self, init: float = 1.0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([init]))
        self.scale_quant = QuantStub()
        self.mul = FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mul.mul(x, self.scale_quant(self.scale))


def _tower(c: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(2):
        layers += [nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
    return nn.Sequential(*layers)


class FCOSHead(nn.Module):
    def __init__(self, c: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.quants = nn.ModuleList(QuantStub() for _ in range(LEVELS))
        self.cls_tower, self.box_tower = _tower(c), _tower(c)
        self.cls_logits = nn.Conv2d(c, classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(c, 4, 3, padding=1)
        self.centerness = nn.Conv2d(c, 1, 3, padding=1)
        self.scales = nn.ModuleList(Scale() for _ in range(LEVELS))
        self.relu = nn.ReLU()
        self.dequant = DeQuantStub()
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - 0.01) / 0.01))

    def forward(self, feats: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
        logits, boxes, centers = [], [], []
        for i, f in enumerate(feats):
            f = self.quants[i](f)
            ct, bt = self.cls_tower(f), self.box_tower(f)
            logits.append(self.dequant(self.cls_logits(ct)))
            centers.append(self.dequant(self.centerness(bt)))
            boxes.append(self.dequant(self.relu(self.scales[i](self.bbox_pred(bt)))))
        return logits, boxes, centers


def _levels() -> tuple[list[torch.Tensor]]:
    return ([torch.randn(1, 8, 16 // 2**i, 16 // 2**i) for i in range(LEVELS)],)


@pytest.fixture(autouse=True)
def _bayes() -> Iterator[None]:
    torch.manual_seed(0)
    with march_scope(March.BAYES):
        yield


def _randomized(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    for s in model.scales:  # type: ignore[union-attr]
        s.scale.data.uniform_(0.5, 2.0)
    return model


def test_a_bare_scale_parameter_is_refused_at_prepare_naming_it() -> None:
    class BareScale(nn.Module):  # the FCOS original: x * self.scale
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor([1.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    head = FCOSHead()
    head.scales = nn.ModuleList(BareScale() for _ in range(LEVELS))
    with pytest.raises(
        UnconvertibleModelError, match=r"float tensor 'scales\.0\.scale'.*self\.scale_quant = QuantStub"
    ):
        prepare_qat_fx(head.eval(), {"": get_default_qat_qconfig()}, example_inputs=_levels())


def test_the_shared_towers_calibrate_train_convert_and_compile_on_five_levels() -> None:
    model = _randomized(FCOSHead()).eval()
    result = fx_flow(model, _levels, steps=2, example_inputs=True)
    logits, boxes, centers = result.integer_out
    assert [tuple(t.shape[2:]) for t in logits] == [(16 // 2**i, 16 // 2**i) for i in range(LEVELS)]
    assert len(boxes) == len(centers) == LEVELS
    assert result.max_error() == 0.0  # validation mode computes what the integer model computes
    with torch.no_grad():
        ref = model(*result.inputs)
    for got, want in zip(result.qat_out[1], ref[1], strict=True):  # each level's boxes near the float model's
        assert float((got - want).abs().max()) <= 0.1 * float(want.abs().max()) + 0.05
