"""A YOLOX-style head that decodes boxes in float after its DeQuantStub, as detection repos write
it: ``flatten(2).permute``, ``sigmoid`` on the scores, ``xy * stride + grid``, ``exp(wh) * stride``,
``torch.cat`` of the corners, ``max`` and ``topk`` of the scores and a ``gather`` of the boxes, with
a ``post_process`` switch the toolkit configs set to None for deployment. Calibration -> QAT ->
convert -> check -> compile -> run.

The float tail compiles as the program's CPU float part (``float_fn`` instructions calling the same
torch functions; compile_model refused it before): the artifact, saved and loaded, returns the
converted model's boxes and scores bit for bit. A step off the float part's allowlist
(``torch.nonzero``) is still refused, naming the node, the DeQuantStub and the fix; the deployment
model without the tail compiles too, and the decode run in torch on its outputs gives the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from qir.march import March, march_scope
from qir.quantization import (
    CompileError,
    DeQuantStub,
    QuantStub,
    check_model,
    compile_model,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    load_compiled,
    prepare_qat_fx,
    set_fake_quantize,
)


class Decode(nn.Module):
    def __init__(self, stride: int = 4, k: int = 5) -> None:
        super().__init__()
        self.stride, self.k = stride, k
        grid = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="xy"), -1)
        self.register_buffer("grid", grid.reshape(16, 2), persistent=False)  # not in the checkpoint

    def forward(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = p.shape[0]
        p = p.flatten(2).permute(0, 2, 1)
        scores = p[..., 4:].sigmoid()
        xy = p[..., :2] * self.stride + self.grid
        wh = p[..., 2:4].exp() * self.stride
        boxes = torch.cat([xy - wh / 2, xy + wh / 2], -1)
        top, idx = scores.max(-1)[0].topk(self.k, dim=1)
        return boxes.gather(1, idx.unsqueeze(-1).expand(b, self.k, 4)), top


class Detector(nn.Module):
    def __init__(self, post_process: nn.Module | None = None) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, 2, 1), nn.ReLU())
        self.head = nn.Conv2d(8, 6, 1)
        self.post_process = post_process

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        p = self.dequant(self.head(self.backbone(self.quant(x))))
        return p if self.post_process is None else self.post_process(p)


def _image() -> tuple[torch.Tensor]:
    return (torch.rand(2, 3, 16, 16),)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def _trained(model: nn.Module) -> torch.fx.GraphModule:
    calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
    calib.eval()
    with torch.no_grad():
        for _ in range(3):
            calib(*_image())
    qat = prepare_qat_fx(calib, {"": get_default_qat_qconfig()})
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=1e-3)
    qat.train()
    for _ in range(2):
        out = qat(*_image())
        loss = sum(o.float().square().mean() for o in (out if isinstance(out, tuple) else (out,)))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    return qat


def test_the_float_decode_compiles_as_the_programs_cpu_part(tmp_path: Path) -> None:
    decode = Decode()
    qat = _trained(Detector(decode).eval())
    converted = convert_fx(qat)
    x = _image()
    assert check_model(converted, x, advice=0).ok
    compile_model(converted, list(x), hbm=tmp_path / "detector.hbm")
    program = load_compiled(tmp_path / "detector.hbm")
    ops = [(i.op, i.attrs.get("fn")) for i in program.program.instructions]
    assert ("float_fn", "torch.sigmoid") in ops and ("float_fn", "torch.topk") in ops
    assert ("constant", None) in ops  # the decoder's grid buffer, stored as float32
    with torch.no_grad():
        for images in (x, _image(), (torch.rand(1, 3, 16, 16),)):  # the batch stays free
            boxes, top = program(*images)
            want_boxes, want_top = converted(*images)
            assert torch.equal(boxes, want_boxes) and torch.equal(top, want_top)
        qat_boxes, qat_top = qat(*x)
        boxes, top = program(*x)
    # QAT in validation mode computes the integer grid: the decode sees the same values
    assert float((qat_boxes - boxes).abs().max()) <= 1e-5 and float((qat_top - top).abs().max()) <= 1e-6


class NonzeroDecode(nn.Module):
    """A decode that keeps the scores above a threshold: ``nonzero`` has a data-dependent size."""

    def forward(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = p.sigmoid()
        return scores, torch.nonzero(scores > 0.5)


def test_a_step_off_the_float_allowlist_is_refused_naming_the_node_and_the_deployed_model_compiles() -> None:
    qat = _trained(Detector(NonzeroDecode()).eval())
    converted = convert_fx(qat)
    x = _image()
    with pytest.raises(CompileError, match=r"'nonzero'.*DeQuantStub 'dequant'.*float part.*post_process is None"):
        compile_model(converted, list(x))
    # the toolkit's deploy config: post_process=None, the trained QAT state loaded strictly
    deployed = prepare_qat_fx(Detector().eval(), {"": get_default_qat_qconfig()})
    deployed.load_state_dict(qat.state_dict(), strict=True)
    deployed.eval()
    set_fake_quantize(deployed, "validation")
    deployed_int = convert_fx(deployed)
    program = compile_model(deployed_int, list(x))
    with torch.no_grad():
        assert torch.equal(program(*x), deployed_int(*x))
        got, want = NonzeroDecode()(program(*x)), converted(*x)  # the decode in torch on the outputs
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
