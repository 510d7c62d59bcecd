"""Post-processing wrapped with ``fx_helper.wrap`` after the model's DeQuantStubs: ``compile_model`` refuses
the Python and names ``split_wrapped_tail``, whose head compiles and whose tail runs the wrapped code on
the program's outputs, equal to the converted model bit for bit; integer work after a wrapped call is
refused with the segmented recipe."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import qir
from qir.march import march_scope
from qir.quantization import (
    CompileError,
    DeQuantStub,
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


@wrap
def decode(scores: torch.Tensor, deltas: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-dependent post-processing on float values; reads the image size from the model input."""
    h, w = img.shape[-2:]
    best, index = scores.flatten(2).sigmoid().max(-1)
    picked = deltas.flatten(2).gather(2, index[:, :1, None].expand(-1, deltas.shape[1], 1)).squeeze(2)
    boxes = picked * torch.tensor([w, h, w, h], dtype=picked.dtype)
    if bool((best > 2.0).any()):  # never true: a branch fx could not trace
        boxes = boxes * 0
    return boxes, best


class Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.cls = nn.Conv2d(8, 2, 1)
        self.reg = nn.Conv2d(8, 4, 1)
        self.dequant_cls = DeQuantStub()
        self.dequant_reg = DeQuantStub()

    def forward(self, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feat = self.body(self.quant(img))
        return decode(self.dequant_cls(self.cls(feat)), self.dequant_reg(self.reg(feat)), img)


def _images(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 12, 12)


def _converted(model: nn.Module) -> torch.fx.GraphModule:
    """Calibration, its checkpoint loaded strictly into a fresh QAT model, two QAT steps, convert."""
    calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()}, (_images(2),))
    calib.eval()
    with torch.no_grad():
        for _ in range(3):
            calib(_images())
    buf = io.BytesIO()
    torch.save(calib.state_dict(), buf)
    buf.seek(0)
    qat = prepare_qat_fx(model, {"": get_default_qat_qconfig()}, (_images(2),))
    qat.load_state_dict(torch.load(buf), strict=True)
    optimizer = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for _ in range(2):
        boxes, best = qat(_images())
        (boxes.mean() + best.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    converted = convert_fx(qat)
    x = _images(8)
    assert all(torch.equal(a, b) for a, b in zip(qat(x), converted(x), strict=True))
    return converted


def test_the_part_before_the_wrapped_post_processing_compiles(march: str, tmp_path: Path) -> None:
    converted = _converted(Detector())
    x = _images(1)
    with pytest.raises(CompileError) as err:
        compile_model(converted, [x])
    assert "decode" in str(err.value) and "qir.quantization.split_wrapped_tail(model)" in str(err.value)

    split = split_wrapped_tail(converted)
    assert [n.target for n in split.tail.graph.nodes if n.op == "call_function"] == [decode]
    assert split.inputs_read == (0,)  # decode reads the image size from the model input
    program = compile_model(split.head, [x], hbm=tmp_path / "head.hbm")
    loaded = qir.load_compiled(tmp_path / "head.hbm")
    batch = _images(6)
    want = converted(batch)
    for head in (program, loaded, split.head):
        got = split.run(head, batch)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class Refined(nn.Module):
    """A wrapped call in the middle: its result is quantized again for another conv."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 1)
        self.dequant = DeQuantStub()
        self.requant = QuantStub()
        self.refine = nn.Conv2d(4, 4, 1)
        self.out = DeQuantStub()

    @wrap()
    def clip(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=float(x.detach().mean()))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.out(self.refine(self.requant(self.clip(self.dequant(self.conv(self.quant(img)))))))


def test_integer_work_after_a_wrapped_call_is_refused_with_the_segmented_recipe(march: str) -> None:
    qat = prepare_qat_fx(Refined(), {"": get_default_qat_qconfig()}, (_images(2),))
    qat(_images())
    qat.eval()
    set_fake_quantize(qat, FakeQuantState.VALIDATION)
    converted = convert_fx(qat)
    refusal = r"integer module 'requant' \(.*\) computes on the result of wrapped call clip"
    with pytest.raises(ValueError, match=refusal):
        split_wrapped_tail(converted)
    with pytest.raises(CompileError, match=r"cannot be split before them: integer module 'requant'.*Segmented"):
        compile_model(converted, [_images(1)])


def test_split_refusals() -> None:
    with pytest.raises(TypeError, match="takes a convert_fx model"):
        split_wrapped_tail(nn.Conv2d(1, 1, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"calls no fx_helper\.wrap-ed or torch\.fx\.wrap-ed function"):
        split_wrapped_tail(torch.fx.symbolic_trace(nn.Conv2d(1, 1, 1)))


def test_a_torch_fx_wrapped_post_process_splits_too(march: str) -> None:
    """torch.fx.wrap (torchvision's spelling) through calibration, a QAT prepare of the calibrated model,
    convert and compile: the emitted models keep the call whole (``is_wrapped``), so it splits off."""
    from tests.flows.test_reprepare_torch_fx_wrap import Net, pad_to_window

    x = torch.randn(2, 3, 6, 6)
    calib = prepare_qat_fx(Net().eval(), {"": get_default_calib_qconfig()})
    calib(x)
    qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
    qat(x)
    set_fake_quantize(qat.eval(), "validation")
    converted = convert_fx(qat)
    with pytest.raises(CompileError, match=r"torch\.fx\.wrap-ed function.*qir\.quantization\.split_wrapped_tail"):
        compile_model(converted, [x[:1]])
    split = split_wrapped_tail(converted)
    assert [n.target for n in split.tail.graph.nodes if n.op == "call_function"] == [pad_to_window]
    program = compile_model(split.head, [x[:1]])
    assert torch.equal(split.run(program, x), converted(x))


@wrap
def shift(deltas: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    return deltas.flatten(2).transpose(1, 2) + anchors


class WithAnchors(nn.Module):
    """The wrapped call reads a buffer of the model: the tail reads it itself, not from the program."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.reg = nn.Conv2d(3, 4, 1)
        self.dequant = DeQuantStub()
        self.register_buffer("anchors", torch.arange(12 * 12 * 4, dtype=torch.float32).reshape(144, 4))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return shift(self.dequant(self.reg(self.quant(img))), self.anchors)


def test_the_tail_reads_the_model_s_own_tensors(march: str) -> None:
    qat = prepare_qat_fx(WithAnchors(), {"": get_default_qat_qconfig()}, (_images(2),))
    qat(_images())
    set_fake_quantize(qat.eval(), "validation")
    converted = convert_fx(qat)
    split = split_wrapped_tail(converted)
    assert [n.op for n in split.tail.graph.nodes] == ["placeholder", "get_attr", "call_function", "output"]
    program = compile_model(split.head, [_images(1)])
    x = _images(3)
    assert torch.equal(split.run(program, x), converted(x))
