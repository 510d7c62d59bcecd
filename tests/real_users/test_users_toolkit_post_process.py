"""A classifier head as Horizon's model toolkit structures it: an ``FPNQuant``-style module with a
``ModuleList`` of ``QuantStub(scale=None)`` over the levels, per-level convs, pooled features
concatenated and flattened with ``x.view(x.size(0), -1)``, the fp16 switch ``self.fc(x.float())``,
and a float ``post_process`` (softmax + max) that ``set_qconfig()`` leaves float with
``self.post_process.qconfig = None``. QAT with the post-process; deployment builds the model
without it (``post_process=None``), loads the QAT checkpoint strictly, converts and compiles.

``x.float()`` of a quantized tensor is an identity in QAT (fake-quantized values are float32); the
converted model drops it (it cast the integer codes to float before, and convert refused the cast)."""

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
    convert,
    convert_fx,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    prepare_qat,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import ConvertError


class FPNQuant(nn.Module):
    def __init__(self, levels: int = 3) -> None:
        super().__init__()
        self.quant_ops = nn.ModuleList(QuantStub(scale=None) for _ in range(levels))

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.quant_ops[i](f) for i, f in enumerate(feats)]


class Head(nn.Module):
    def __init__(self, c: int = 8, classes: int = 4, use_fp16: bool = True) -> None:
        super().__init__()
        self.use_fp16 = use_fp16
        self.convs = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU()) for _ in range(3))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c * 3, classes)
        self.dequant = DeQuantStub()

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([self.pool(conv(f)) for conv, f in zip(self.convs, feats, strict=True)], dim=1)
        x = x.view(x.size(0), -1)
        return self.dequant(self.fc(x.float() if self.use_fp16 else x))


class PostProcess(nn.Module):
    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, labels = logits.softmax(dim=-1).max(dim=-1)
        return scores, labels


class Classifier(nn.Module):
    def __init__(self, post_process: bool = True) -> None:
        super().__init__()
        self.quant = FPNQuant()
        self.head = Head()
        self.post_process = PostProcess() if post_process else None

    def forward(self, p3: torch.Tensor, p4: torch.Tensor, p5: torch.Tensor) -> object:
        logits = self.head(self.quant([p3, p4, p5]))
        if self.post_process is None:
            return logits
        return logits, self.post_process(logits)

    def set_qconfig(self) -> None:
        self.qconfig = get_default_qat_qconfig()
        self.head.fc.qconfig = get_default_qat_out_qconfig()
        if self.post_process is not None:
            self.post_process.qconfig = None


def _levels() -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(2, 8, s, s) for s in (8, 4, 2))


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def _trained_qat() -> nn.Module:
    model = Classifier().eval()
    model.set_qconfig()
    qat = prepare_qat_fx(model)
    qat.train()
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(3):
        logits, _ = qat(*_levels())
        loss = logits.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    return qat


def test_the_float_cast_is_dropped_and_the_post_process_stays_float() -> None:
    qat = _trained_qat()
    assert not [n for n, _ in qat.named_modules() if n.startswith("post_process.")]  # no QAT modules there
    converted = convert_fx(qat)
    assert not [n for n in converted.graph.nodes if n.op == "call_method" and n.target in ("to", "float")]
    x = _levels()
    with torch.no_grad():
        (logits, (scores, labels)), (qat_logits, (_, qat_labels)) = converted(*x), qat(*x)
    assert logits.dtype == torch.float32 and float((logits - qat_logits).abs().max()) <= 1e-5
    assert torch.equal(labels, qat_labels) and torch.allclose(scores, logits.softmax(-1).max(-1).values)


def test_the_deployed_model_loads_the_qat_checkpoint_and_compiles() -> None:
    qat = _trained_qat()
    deploy = Classifier(post_process=False).eval()
    deploy.set_qconfig()
    deploy_qat = prepare_qat_fx(deploy)
    deploy_qat.load_state_dict(qat.state_dict(), strict=True)
    deploy_qat.eval()
    set_fake_quantize(deploy_qat, "validation")
    result = finish(deploy_qat, convert_fx(deploy_qat), _levels())  # check, compile, bit-exact
    assert result.max_error() <= 1e-5
    with torch.no_grad():
        assert torch.equal(result.integer_out, convert_fx(qat)(*result.inputs)[0])


def test_eager_convert_refuses_the_float_cast_it_cannot_remove() -> None:
    class Fp16Switch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.fc(self.quant(x).float()))

    model = Fp16Switch()
    model.qconfig = get_default_qat_qconfig()
    qat = prepare_qat(model)
    qat(torch.randn(2, 8))
    qat.eval()
    with pytest.raises(ConvertError, match=r"casts a quantized tensor to float32.*drop the cast"):
        convert(qat)
