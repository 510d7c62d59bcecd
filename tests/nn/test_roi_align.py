"""RoIAlign without torchvision: qir.nn.RoIAlign (float), QAT and integer modules, the whole flow.

The float module is checked against a per-sample float reference written here; the converted
module against the QAT module on the same codes (≤ 1 output LSB, docs/semantics.md
"RoIAlign"); the compiled program and artifact against the converted model, bit for bit, for
both box forms torchvision takes.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import qir
from backends.common import numerics
from qir.march import march_scope
from qir.nn import RoIAlign, qat, quantized
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from qir.quantization.convert import ConvertError

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
QC = get_default_qat_qconfig()


def _bilinear(img: torch.Tensor, y: float, x: float) -> torch.Tensor:
    h, w = img.shape[-2:]
    if y < -1.0 or y > h or x < -1.0 or x > w:
        return torch.zeros(img.shape[0], dtype=img.dtype)
    y, x = max(y, 0.0), max(x, 0.0)
    y0, x0 = int(y), int(x)
    if y0 >= h - 1:
        y0 = y1 = h - 1
        y = float(y0)
    else:
        y1 = y0 + 1
    if x0 >= w - 1:
        x0 = x1 = w - 1
        x = float(x0)
    else:
        x1 = x0 + 1
    ly, lx = y - y0, x - x0
    return (
        (1 - ly) * (1 - lx) * img[:, y0, x0]
        + (1 - ly) * lx * img[:, y0, x1]
        + ly * (1 - lx) * img[:, y1, x0]
        + ly * lx * img[:, y1, x1]
    )


def _reference(x: torch.Tensor, rois: torch.Tensor, out: tuple[int, int], ss: float, sr: int, al: bool) -> torch.Tensor:
    """roi_align sample by sample (float64), as torchvision defines it."""
    ph, pw = out
    res = torch.zeros(rois.shape[0], x.shape[1], ph, pw, dtype=torch.float64)
    off = 0.5 if al else 0.0
    for k, r in enumerate(rois.tolist()):
        x1, y1, x2, y2 = (v * ss - off for v in r[1:])
        rw, rh = (x2 - x1, y2 - y1) if al else (max(x2 - x1, 1.0), max(y2 - y1, 1.0))
        gh = sr if sr > 0 else math.ceil(rh / ph)
        gw = sr if sr > 0 else math.ceil(rw / pw)
        for i, j in itertools.product(range(ph), range(pw)):
            acc = torch.zeros(x.shape[1], dtype=torch.float64)
            for iy, ix in itertools.product(range(max(gh, 0)), range(max(gw, 0))):
                yy = y1 + i * rh / ph + (iy + 0.5) * rh / ph / gh
                xx = x1 + j * rw / pw + (ix + 0.5) * rw / pw / gw
                acc += _bilinear(x[int(r[0])].double(), yy, xx)
            res[k, :, i, j] = acc / max(gh * gw, 1)
    return res


def _boxes(gen: torch.Generator, k: int, h: int, w: int, n: int = 2) -> torch.Tensor:
    xy = torch.rand(k, 2, generator=gen) * torch.tensor([w, h]) * 1.6 - 2
    wh = torch.rand(k, 2, generator=gen) * torch.tensor([w, h])
    return torch.cat([torch.randint(0, n, (k, 1), generator=gen).float(), xy, xy + wh], 1)


@pytest.mark.parametrize(("sr", "al"), list(itertools.product([-1, 0, 2], [False, True])))
def test_float_module_matches_the_reference(sr: int, al: bool) -> None:
    gen = torch.Generator().manual_seed(sr + 5)
    x = torch.randn(2, 3, 9, 11, generator=gen, dtype=torch.float64)
    rois = _boxes(gen, 5, 18, 22).double()
    got = RoIAlign((3, 4), 0.5, sr, al)(x, rois)
    torch.testing.assert_close(got, _reference(x, rois, (3, 4), 0.5, sr, al), atol=1e-12, rtol=1e-12)
    per_image = [rois[rois[:, 0] == i, 1:] for i in range(2)]
    order = torch.cat([torch.nonzero(rois[:, 0] == i).reshape(-1) for i in range(2)])
    torch.testing.assert_close(RoIAlign((3, 4), 0.5, sr, al)(x, per_image), got[order])


def test_integer_matches_qat_and_the_reference() -> None:
    worst = 0
    for seed in range(24):
        gen = torch.Generator().manual_seed(seed)
        s_in = float(torch.empty(1).uniform_(0.005, 0.2, generator=gen))
        s_out = s_in * float(torch.empty(1).uniform_(0.5, 1.5, generator=gen))
        h, w = (int(v) for v in torch.randint(1, 24, (2,), generator=gen))
        q = torch.randint(-128, 128, (2, 3, h, w), generator=gen, dtype=torch.int8)
        sr, al, ss = seed % 4 - 1, bool(seed % 2), [1.0, 0.5, 0.25][seed % 3]
        boxes = _boxes(gen, 6, int(h / ss), int(w / ss))
        m = qat.RoIAlign.from_float(RoIAlign((3, 4), ss, sr, al), QC).eval()
        m.activation_post_process.disable_observer().scale.fill_(s_out)
        qm = quantized.RoIAlign.from_qat(m, [torch.tensor(s_in)], "bayes")
        x = numerics.dequantize(q, s_in)
        with torch.no_grad():
            want = numerics.quantize(m(x, boxes), s_out, "qint8").to(torch.int64)
        got = qm(q, boxes)
        assert torch.equal(qm(input=q, boxes=boxes), got)  # the float / QAT modules' argument names
        assert got.dtype == torch.int8 and got.shape == (6, 3, 3, 4)
        assert int((got.to(torch.int64) - want).abs().max()) <= 1
        # boxes on the 2**-12 grid sample where the float definition samples
        ref = numerics.quantize(_reference(x, boxes, (3, 4), ss, sr, al).float(), s_out, "qint8")
        worst = max(worst, int((got.to(torch.int64) - ref.to(torch.int64)).abs().max()))
    assert worst <= 2


class Net(nn.Module):
    def __init__(self, roi: nn.Module, box_list: bool) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.roi = roi
        self.box_list = box_list
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        y = self.c1(self.quant(x))
        if self.box_list:
            return self.dequant(self.roi(y, [boxes[0], boxes[1]]))
        return self.dequant(self.roi(y, boxes))


def _inputs(seed: int, box_list: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 12, 16, generator=gen)
    if box_list:
        return x, torch.stack([_boxes(gen, 3, 24, 32, 1)[:, 1:] for _ in range(2)])
    return x, _boxes(gen, 5, 24, 32)


@pytest.mark.parametrize("box_list", [False, True], ids=["tensor", "list"])
@pytest.mark.parametrize(("sr", "al"), [(-1, False), (2, True)])
def test_whole_flow_compiled_and_artifact_bitexact(tmp_path: Path, box_list: bool, sr: int, al: bool) -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(RoIAlign((3, 3), 0.5, sr, al), box_list), {"": QC})
        assert isinstance(prepared.get_submodule("roi"), qat.RoIAlign)
        opt = torch.optim.SGD(prepared.parameters(), lr=1e-3)
        for seed in range(2):
            opt.zero_grad()
            prepared(*_inputs(seed, box_list)).square().mean().backward()
            opt.step()
        assert prepared.get_submodule("c1").weight.grad is not None
        set_fake_quantize(prepared, "validation")
        converted = convert_fx(prepared.eval())
    assert isinstance(converted.get_submodule("roi"), quantized.RoIAlign)
    path = tmp_path / "roi.hbm"
    compiled = compile_model(converted, list(_inputs(0, box_list)), hbm=path, opt=1)
    assert "roi_align" in {i.op for i in compiled.program.instructions}
    loaded = qir.load_compiled(path)
    with torch.no_grad():
        for seed in (10, 11):
            x, b = _inputs(seed, box_list)
            want = converted(x, b)
            assert torch.equal(compiled(x, b), want) and torch.equal(loaded(x, b), want)


def test_errors_name_the_module_and_the_fix() -> None:
    m = RoIAlign(2, 1.0, -1)
    with pytest.raises(ValueError, match=r"RoIAlign: boxes as a tensor must be \(K, 5\)"):
        m(torch.zeros(1, 1, 4, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"boxes\[0\] must be \(K_i, 4\)"):
        m(torch.zeros(1, 1, 4, 4), [torch.zeros(3, 5)])
    with pytest.raises(TypeError, match=r"RoIAlign\.from_float takes qir\.nn\.RoIAlign or torchvision"):
        qat.RoIAlign.from_float(nn.ReLU(), QC)


class FloatFeatures(nn.Module):
    """RoIAlign fed an unquantized feature map: only its boxes (argument 1) may be float."""

    def __init__(self) -> None:
        super().__init__()
        self.roi = RoIAlign((3, 3), 0.5, 2, True)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.roi(x, boxes))


def test_a_float_feature_map_is_refused_at_convert() -> None:
    x, boxes = _inputs(0, False)
    with march_scope("bayes"):
        prepared = prepare_qat_fx(FloatFeatures(), {"": QC})
        prepared(x, boxes)
        with pytest.raises(ConvertError, match=r"module 'roi' \(RoIAlign\) receives a float tensor \(argument 0\)"):
            convert_fx(prepared)
