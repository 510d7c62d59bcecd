"""MultiScaleRoIAlign without torchvision: qir.nn.MultiScaleRoIAlign (float), QAT and integer modules, the whole flow.

The float module is checked against a reference written here (torchvision's level mapper and
scale inference spelled out, each box pooled by the per-sample RoIAlign reference); the
converted module against the QAT module on the same codes (≤ 1 output LSB); the compiled
program and artifact against the converted model, bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import qir
from backends.common import numerics
from qir.march import march_scope
from qir.nn import MultiScaleRoIAlign, qat, quantized
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    compile_model,
    convert_fx,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)
from tests.nn.test_roi_align import _reference as roi_reference

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
QC = get_default_qat_qconfig()
NAMES = ["p2", "p3", "p4"]


def _levels(boxes: list[torch.Tensor], s0: int, k_min: int, k_max: int) -> list[int]:
    """Per box: clamp(floor(4 + log2(sqrt(area) / s0) + 1e-6), k_min, k_max)."""
    return [
        min(max(math.floor(4 + math.log2(math.sqrt((b[2] - b[0]) * (b[3] - b[1])) / s0) + 1e-6), k_min), k_max)
        for bs in boxes
        for b in bs.tolist()
    ]


def _reference(
    x: dict[str, torch.Tensor], boxes: list[torch.Tensor], shapes: list[tuple[int, int]], out: int, sr: int, s0: int
) -> torch.Tensor:
    """Box by box: level scale ``2**round(log2(H_l / max H))``, level from the box, RoIAlign of that level."""
    feats = [v for k, v in x.items() if k in NAMES]
    big = max(h for h, _ in shapes)
    scales = [2.0 ** round(math.log2(f.shape[-2] / big)) for f in feats]
    k_min, k_max = round(-math.log2(scales[0])), round(-math.log2(scales[-1]))
    rows = []
    levels = iter(_levels(boxes, s0, k_min, k_max))
    for i, bs in enumerate(boxes):
        for b in bs.tolist():
            k = next(levels) - k_min
            roi = torch.tensor([[float(i), *b]], dtype=torch.float64)
            rows.append(roi_reference(feats[k], roi, (out, out), scales[k], sr, False)[0])
    return torch.stack(rows)


def _features(
    gen: torch.Generator, n: int = 2, c: int = 3, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    return {
        "p2": torch.randn(n, c, 16, 20, generator=gen, dtype=dtype),
        "p3": torch.randn(n, c, 8, 10, generator=gen, dtype=dtype),
        "p4": torch.randn(n, c, 4, 5, generator=gen, dtype=dtype),
        "pool": torch.randn(n, c, 2, 3, generator=gen, dtype=dtype),
    }


def _boxes(gen: torch.Generator, k: int, h: int = 64, w: int = 80) -> torch.Tensor:
    # squared sizes: small boxes map to p2, large ones to p4 (canonical scale 224 / level 4 mapping)
    xy = torch.rand(k, 2, generator=gen) * torch.tensor([w, h]) - 2
    wh = torch.rand(k, 2, generator=gen).square() * torch.tensor([w, h]) * 4 + 0.5
    return torch.cat([xy, xy + wh], 1)


SHAPES = [(64, 80), (60, 76)]


@pytest.mark.parametrize("sr", [-1, 0, 2])
def test_float_module_matches_the_reference(sr: int) -> None:
    gen = torch.Generator().manual_seed(sr + 3)
    x = _features(gen, dtype=torch.float64)
    boxes = [_boxes(gen, 9).double(), _boxes(gen, 6).double()]
    assert set(_levels(boxes, 56, 2, 4)) == {2, 3, 4}  # every level is used
    got = MultiScaleRoIAlign(NAMES, 3, sr, canonical_scale=56)(x, boxes, SHAPES)
    torch.testing.assert_close(got, _reference(x, boxes, SHAPES, 3, sr, 56), atol=1e-12, rtol=1e-12)


def test_default_canonical_mapping_and_one_level() -> None:
    gen = torch.Generator().manual_seed(0)
    x = {k: v for k, v in _features(gen, dtype=torch.float64).items() if k != "pool"}
    boxes = [_boxes(gen, 8, 256, 320).double() * 4]
    shapes = [(256, 320)]
    assert len(set(_levels(boxes, 224, 4, 6))) > 1
    got = MultiScaleRoIAlign(NAMES, 2, 2)(x, boxes, shapes)
    torch.testing.assert_close(got, _reference(x, boxes, shapes, 2, 2, 224), atol=1e-12, rtol=1e-12)
    one = MultiScaleRoIAlign(["p3"], 2, 2)(x, boxes, shapes)  # a single level takes every box
    want = roi_reference(
        x["p3"], torch.cat([torch.zeros(8, 1, dtype=torch.float64), boxes[0]], 1), (2, 2), 1 / 32, 2, False
    )
    torch.testing.assert_close(one, want, atol=1e-12, rtol=1e-12)


def test_integer_matches_qat_per_level() -> None:
    worst = 0
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        s_ins = [float(torch.empty(1).uniform_(0.01, 0.2, generator=gen)) for _ in range(4)]
        s_out = max(s_ins) * float(torch.empty(1).uniform_(0.5, 1.5, generator=gen))
        qx = {k: torch.randint(-128, 128, v.shape, generator=gen, dtype=torch.int8) for k, v in _features(gen).items()}
        x = {k: numerics.dequantize(v, s) for (k, v), s in zip(qx.items(), s_ins, strict=True)}
        boxes = [_boxes(gen, 7), _boxes(gen, 4)]
        m = qat.MultiScaleRoIAlign.from_float(MultiScaleRoIAlign(NAMES, (2, 3), seed % 3 - 1, canonical_scale=56), QC)
        m.eval().activation_post_process.disable_observer().scale.fill_(s_out)
        qm = quantized.MultiScaleRoIAlign.from_qat(m, [torch.tensor(s) for s in s_ins], "bayes")
        with torch.no_grad():
            want = numerics.quantize(m(x, boxes, SHAPES), s_out, "qint8").to(torch.int64)
        got = qm(qx, boxes, SHAPES)
        assert got.dtype == torch.int8 and got.shape == (11, 3, 2, 3)
        worst = max(worst, int((got.to(torch.int64) - want).abs().max()))
    assert worst <= 1


class Net(nn.Module):
    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.c2 = nn.Conv2d(3, 4, 3, padding=1)
        self.c3 = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.c4 = nn.Conv2d(3, 4, 3, stride=4, padding=1)
        self.pool = pool
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
        q = self.quant(x)
        feats = {"p2": self.c2(q), "p3": self.c3(q), "p4": self.c4(q)}
        return self.dequant(self.pool(feats, [b0, b1], [(64, 80), (64, 80)]))


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 16, 20, generator=gen), _boxes(gen, 6), _boxes(gen, 5)


@pytest.mark.parametrize("sr", [-1, 2])
def test_whole_flow_compiled_and_artifact_bitexact(tmp_path: Path, sr: int) -> None:
    torch.manual_seed(0)
    with march_scope("bayes"):
        prepared = prepare_qat_fx(Net(MultiScaleRoIAlign(NAMES, 3, sr, canonical_scale=56)), {"": QC})
        assert isinstance(prepared.get_submodule("pool"), qat.MultiScaleRoIAlign)
        opt = torch.optim.SGD(prepared.parameters(), lr=1e-3)
        for seed in range(2):
            opt.zero_grad()
            prepared(*_inputs(seed)).square().mean().backward()
            opt.step()
        assert prepared.get_submodule("c4").weight.grad is not None
        set_fake_quantize(prepared, "validation")
        converted = convert_fx(prepared.eval())
    pool = converted.get_submodule("pool")
    assert isinstance(pool, quantized.MultiScaleRoIAlign)
    path = tmp_path / "msr.hbm"
    compiled = compile_model(converted, list(_inputs(0)), hbm=path, opt=1)
    ops = {i.op for i in compiled.program.instructions}
    assert {"roi_levels", "multi_scale_roi_align"} <= ops
    loaded = qir.load_compiled(path)
    worst = 0
    with torch.no_grad():
        for seed in (10, 11, 12):
            ins = _inputs(seed)
            want = converted(*ins)
            assert torch.equal(compiled(*ins), want) and torch.equal(loaded(*ins), want)
            worst = max(worst, int(((want - prepared(*ins)).abs().max() / pool.scale).round()))
    assert worst <= 1


def test_errors_name_the_module_and_the_fix() -> None:
    m = MultiScaleRoIAlign(NAMES, 2, -1)
    with pytest.raises(TypeError, match=r"MultiScaleRoIAlign: x must be a dict"):
        m(torch.zeros(1, 1, 4, 4), [torch.zeros(1, 4)], [(8, 8)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"none of featmap_names"):
        m({"a": torch.zeros(1, 1, 4, 4)}, [torch.zeros(1, 4)], [(8, 8)])
    with pytest.raises(ValueError, match=r"image_shapes must list"):
        m({"p2": torch.zeros(1, 1, 4, 4)}, [torch.zeros(1, 4)], [])
    with pytest.raises(TypeError, match=r"MultiScaleRoIAlign\.from_float takes qir\.nn\.MultiScaleRoIAlign"):
        qat.MultiScaleRoIAlign.from_float(nn.ReLU(), QC)
