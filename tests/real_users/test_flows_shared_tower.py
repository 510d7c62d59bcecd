"""A RetinaNet / FCOS head as detection code writes it: one classification tower and one box
tower, each a stack of conv + BatchNorm + ReLU, applied to every FPN level (one module object
called once per level), then calibration -> QAT -> convert -> check -> compile -> run.

The tower's batch norms fold into the shared convs once for all levels, the convs fuse with
their ReLUs, every level keeps its own output observer and the weights stay one tensor."""

from __future__ import annotations

import pytest
import torch
from names_flow import fx_flow
from torch import nn

from qir.march import March, march_scope
from qir.quantization import DeQuantStub, QuantStub, fuse_fx, prepare_qat_fx
from qir.quantization.qconfig import get_default_qat_qconfig


def conv_bn_relu(c: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))


class RetinaHead(nn.Module):
    def __init__(self, c: int = 8, anchors: int = 3, classes: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.cls_tower = nn.Sequential(*(conv_bn_relu(c) for _ in range(depth)))
        self.box_tower = nn.Sequential(*(conv_bn_relu(c) for _ in range(depth)))
        self.cls_logits = nn.Conv2d(c, anchors * classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(c, anchors * 4, 3, padding=1)
        self.dequant = DeQuantStub()

    def forward(
        self, p3: torch.Tensor, p4: torch.Tensor, p5: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        logits, boxes = [], []
        for f in (p3, p4, p5):  # fx unrolls a loop over the levels
            x = self.quant(f)
            logits.append(self.dequant(self.cls_logits(self.cls_tower(x))))
            boxes.append(self.dequant(self.bbox_pred(self.box_tower(x))))
        return logits, boxes


def _head() -> RetinaHead:
    head = RetinaHead()
    for m in head.modules():  # trained-looking batch norms, so folding changes the weights
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return head.eval()


def _levels() -> tuple[torch.Tensor, ...]:
    # three FPN levels with different ranges
    return tuple(torch.randn(2, 8, s, s) * r for s, r in ((16, 0.5), (8, 2.0), (4, 8.0)))


@pytest.fixture(autouse=True)
def bayes() -> object:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_the_shared_tower_fuses_once_and_computes_the_float_model() -> None:
    head = _head()
    fused = fuse_fx(head)
    for tower in ("cls_tower", "box_tower"):
        for i in range(2):
            assert type(fused.get_submodule(f"{tower}.{i}.0")).__name__ == "ConvReLU2d"
            assert isinstance(fused.get_submodule(f"{tower}.{i}.1"), nn.Identity)
    calls = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    assert calls.count("cls_tower.0.0") == 3 and "cls_tower.0.1" not in calls  # one module, three levels
    feats = _levels()
    with torch.no_grad():
        for got, want in zip(fused(*feats), head(*feats), strict=True):
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g, w, atol=1e-5)
    # a float checkpoint loads by its original keys, its batch norms folded on load
    again = fuse_fx(_head())
    result = again.load_state_dict(head.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        for got, want in zip(again(*feats), head(*feats), strict=True):
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g, w, atol=1e-5)


def test_every_level_has_its_own_observer_and_the_tower_one_weight() -> None:
    qat = prepare_qat_fx(_head(), {"": get_default_qat_qconfig()})
    conv = qat.get_submodule("cls_tower.0.0")
    for k in (1, 2):
        site = qat.get_submodule(f"cls_tower.0.0_call{k}")
        assert site.weight is conv.weight and site.weight_fake_quant is conv.weight_fake_quant
        assert site.activation_post_process is not conv.activation_post_process
    assert len(list(qat.parameters())) == 4 * 2 + 4  # four tower convs (weight + folded bias), two heads


def test_the_shared_tower_calibrates_trains_converts_and_compiles() -> None:
    result = fx_flow(_head(), _levels)
    qat = result.qat
    sites = ("cls_tower.1.0", "cls_tower.1.0_call2")
    scales = [float(qat.get_submodule(p).activation_post_process.scale) for p in sites]
    assert scales[1] > 2 * scales[0]  # the levels are quantized with their own ranges
    converted_tower = result.converted.get_submodule("cls_tower.0.0_call1")
    assert type(converted_tower).__name__ == "ConvReLU2d"
    lsb = max(
        float(m.activation_post_process.scale)
        for n, m in qat.named_modules()
        if n.startswith(("cls_logits", "bbox_pred")) and hasattr(m, "activation_post_process")
    )
    # QAT vs integer: a few output LSB through three convs (docs/semantics.md)
    assert result.max_error() <= 4.01 * lsb


def test_a_shared_conv_with_a_batch_norm_per_level_is_refused_at_prepare() -> None:
    class PerLevelNorm(nn.Module):
        """One conv for every level but a batch norm of each level's own: nothing to fold into."""

        def __init__(self, c: int = 8) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(c, c, 3, padding=1)
            self.norms = nn.ModuleList(nn.BatchNorm2d(c) for _ in range(3))
            self.dequant = DeQuantStub()

        def forward(self, p3: torch.Tensor, p4: torch.Tensor, p5: torch.Tensor) -> list[torch.Tensor]:
            return [self.dequant(self.norms[i](self.conv(self.quant(f)))) for i, f in enumerate((p3, p4, p5))]

    refused = r"module 'conv' is called at 3 places.*'norms.0', 'norms.1', 'norms.2'.*own conv"
    with pytest.raises(ValueError, match=refused):
        prepare_qat_fx(PerLevelNorm().eval(), {"": get_default_qat_qconfig()})


def test_one_conv_bn_before_a_relu_at_one_call_and_an_add_at_another() -> None:
    """The folded conv fuses into a ConvReLU2d at one call site and a ConvAdd2d at the other:
    both hold the one folded weight, and a float checkpoint loads into both."""

    class Mixed(nn.Module):
        def __init__(self, c: int = 4) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(c, c, 3, padding=1)
            self.bn = nn.BatchNorm2d(c)
            self.dequant = DeQuantStub()

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = self.quant(a), self.quant(b)
            return self.dequant(torch.relu(self.bn(self.conv(a)))), self.dequant(self.bn(self.conv(b)) + b)

    model = Mixed().eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2.0)
    xs = (torch.randn(1, 4, 5, 5), torch.randn(1, 4, 5, 5))
    fused = fuse_fx(model)
    assert {type(fused.conv).__name__, type(fused._generated_add_0).__name__} == {"ConvReLU2d", "ConvAdd2d"}
    again = fuse_fx(Mixed().eval())
    assert not again.load_state_dict(model.state_dict(), strict=True).missing_keys
    with torch.no_grad():
        for f in (fused, again):
            for g, w in zip(f(*xs), model(*xs), strict=True):
                assert torch.allclose(g, w, atol=1e-5)
    result = fx_flow(model, lambda: xs)
    assert result.qat.conv.weight is result.qat._generated_add_0.weight  # one weight trains
    assert result.max_error() == 0.0  # validation-mode QAT computes the integer model
