"""One eager ``DeQuantStub`` for every head's output, as Horizon users write detection heads (40 files
of the toolkit and its users): two FPN levels, a classification and a box head per level, the box
outputs through ``permute(0, 2, 3, 1).reshape(b, -1, 4)``, the class outputs concatenated by a
``FloatFunctional`` and all of them dequantized by the one stub, although every head has its own
scale. The plugin accepts it because its quantized tensors carry their scale; qir's converted eager
codes do too (``qir.nn.quantized.scale_tags``): the stub dequantizes each call with its input's scale.

Eager prepare_qat, QAT steps, convert (from one fx trace, and from the recorded forwards of a model
fx cannot trace), check, compile, run: the converted model equals the QAT model in validation mode
and the fx flow bit for bit, and the artifact equals the converted model. A stub given codes that do
not carry a scale is refused, naming it."""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator

import pytest
import torch
from names_flow import finish
from torch import nn

from qir.march import March, march_scope
from qir.nn.quantized import FloatFunctional, PerCallDeQuantStub
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert,
    convert_fx,
    fuse_known_modules,
    get_default_qat_qconfig,
    prepare_qat,
    prepare_qat_fx,
    set_fake_quantize,
)

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


class TwoLevelHead(nn.Module):
    """conv + relu stem, a stride-2 level, per level a cls (3 anchors x 2 classes) and a box head;
    outputs: the concatenated class scores, the stride-2 features and each level's boxes."""

    def __init__(self, traceable: bool = True) -> None:
        super().__init__()
        self.traceable = traceable
        self.quant = QuantStub()
        self.stem, self.stem_relu = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()
        self.down, self.down_relu = nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU()
        self.cls3, self.cls4 = nn.Conv2d(8, 6, 1), nn.Conv2d(8, 6, 1)
        self.reg3, self.reg4 = nn.Conv2d(8, 12, 1), nn.Conv2d(8, 12, 1)
        self.cat = FloatFunctional()
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p3 = self.stem_relu(self.stem(self.quant(x)))
        if not self.traceable and x.shape[-1] < 4:  # a Python decision on a size: fx cannot trace it
            raise ValueError("input too small")
        p4 = self.down_relu(self.down(p3))
        b = x.shape[0]
        levels = ((self.reg3, p3), (self.reg4, p4))
        boxes = [self.dequant(r(p).permute(0, 2, 3, 1).reshape(b, -1, 4)) for r, p in levels]
        scores = self.cat.cat([self.cls3(p3).flatten(2), self.cls4(p4).flatten(2)], dim=2)
        return self.dequant(scores), self.dequant(p4), *boxes

    def fuse_model(self) -> None:
        groups = [["stem", "stem_relu"], ["down", "down_relu"]]
        torch.quantization.fuse_modules(self, groups, inplace=True, fuser_func=fuse_known_modules)


def _images() -> torch.Tensor:
    return torch.rand(2, 3, 8, 8) * 2 - 1


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.rand(2, 3, 8, 8, generator=g) * 2 - 1 for _ in range(3)]


def _observe(qat: nn.Module) -> nn.Module:
    """QAT-mode forwards on fixed batches (the observers learn the ranges), then validation mode."""
    with torch.no_grad():
        for x in _batches():
            qat(x)
    qat.eval()
    set_fake_quantize(qat, "validation")
    return qat


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def _eager_qat(model: nn.Module) -> nn.Module:
    model.fuse_model()  # type: ignore[operator]
    model.qconfig = get_default_qat_qconfig()
    qat = prepare_qat(model.train())
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for _ in range(3):
        loss = sum(o.square().mean() for o in qat(_images()))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    return qat


@pytest.mark.parametrize("traceable", [True, False], ids=["traced", "recorded"])
def test_one_dequant_stub_for_heads_of_different_scales(traceable: bool) -> None:
    qat = _eager_qat(TwoLevelHead(traceable))
    scales = {name: float(getattr(qat, name).activation_post_process.scale) for name in ("cat", "down", "reg3", "reg4")}
    assert len(set(scales.values())) == 4, scales  # the stub serves outputs of four different scales
    quantized = convert(qat)
    assert isinstance(quantized.dequant, PerCallDeQuantStub)
    x = _images()
    result = finish(qat, quantized, (x,))  # check_model, compile_model: the artifact equals the converted model
    for got, want in zip(result.integer_out, result.qat_out, strict=True):
        assert torch.equal(got, want)  # validation mode computes what the converted model computes
    boxes = result.integer_out[2]
    codes = quantized.reg3(quantized.stem(quantized.quant(x))).permute(0, 2, 3, 1).reshape(2, -1, 4)
    assert torch.equal(boxes, codes.float() * quantized.reg3.scale)  # the box head's own scale
    for copied in (copy.deepcopy(quantized), _reloaded(quantized)):
        for got, want in zip(copied(x), result.integer_out, strict=True):
            assert torch.equal(got, want)


def _reloaded(m: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)  # type: ignore[no-any-return]


def test_the_eager_stub_equals_the_fx_flow() -> None:
    """The same float model and batches through prepare_qat_fx, where each call site of the stub gets its
    own DeQuantStub: with the same scales, the eager converted model computes the same outputs bit for bit.
    (The two flows' QAT forwards observe ranges that differ in the last float bits, so the eager model
    takes the fx model's scales: what is compared is the conversion, not the float rounding.)"""
    float_model = TwoLevelHead()
    eager_model = copy.deepcopy(float_model)
    eager_model.fuse_model()
    eager_model.qconfig = get_default_qat_qconfig()
    eager_qat = _observe(prepare_qat(eager_model.train()))
    fx_qat = _observe(prepare_qat_fx(float_model.train(), {"": get_default_qat_qconfig()}))
    for name in ("quant", "stem", "down", "cls3", "cls4", "reg3", "reg4", "cat"):
        mine, theirs = (m.get_submodule(name).activation_post_process.scale for m in (eager_qat, fx_qat))
        assert torch.allclose(mine, theirs, rtol=1e-5)
        mine.copy_(theirs)
    eager, fx = convert(eager_qat), convert_fx(fx_qat)
    assert isinstance(eager.dequant, PerCallDeQuantStub)
    x = _images()
    for got, want in zip(eager(x), fx(x), strict=True):
        assert torch.equal(got, want)


def test_codes_without_a_scale_are_refused_naming_the_stub() -> None:
    quantized = convert(_eager_qat(TwoLevelHead()))
    x = _images()
    features = quantized.stem(quantized.quant(x))
    direct = quantized.dequant(quantized.reg3(features))  # a converted module's output carries its scale
    assert torch.equal(direct, quantized.reg3(features).float() * quantized.reg3.scale)
    refused = r"DeQuantStub 'dequant' is shared by outputs of different scales.*carries none"
    with pytest.raises(ValueError, match=refused):
        quantized.dequant(quantized.reg3(features).permute(0, 2, 3, 1))  # outside the forward: the permute drops it
    with pytest.raises(ValueError, match=r"DeQuantStub 'dequant'.*own DeQuantStub"):
        quantized.dequant(torch.zeros(2, 4, dtype=torch.int8))


def test_compile_lowers_each_call_with_its_operands_scale() -> None:
    quantized = convert(_eager_qat(TwoLevelHead()))
    x = _images()
    program = compile_model(quantized, [x])
    dequants = [i for i in program.program.instructions if i.op == "dequantize"]
    assert len(dequants) == 4
    traced = compile_model(torch.jit.trace(quantized, x), [x])  # check_model / compile take the seeds' jit.trace
    for got, from_jit, want in zip(program(x), traced(x), quantized(x), strict=True):
        assert torch.equal(got, want) and torch.equal(from_jit, want)
