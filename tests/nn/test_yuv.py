"""rgb2centered_yuv / centered_yuv2rgb (and BGR variants) against independent float references."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from backends.common import numerics
from qir.functional import bgr2centered_yuv, centered_yuv2bgr, centered_yuv2rgb, rgb2centered_yuv
from qir.nn import qat, quantized
from qir.quantization import QuantStub
from qir.quantization.qconfig import get_default_qat_qconfig

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


def _rgb(n: int = 2, h: int = 5, w: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, h, w), generator=torch.Generator().manual_seed(seed)).float()


def test_studio_matches_8bit_reference_and_ranges() -> None:
    rgb = _rgb()
    yuv = rgb2centered_yuv(rgb)  # studio
    r, g, b = (rgb[:, i].long() for i in range(3))
    # the classic BT.601 8-bit integer approximation, offsets then centred
    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16 - 128
    u = ((-38 * r - 74 * g + 112 * b + 128) >> 8) + 128 - 128
    v = ((112 * r - 94 * g - 18 * b + 128) >> 8) + 128 - 128
    ref = torch.stack([y, u, v], 1).float()
    assert (yuv - ref).abs().max() <= 1
    corners = torch.tensor([[0.0, 0, 0], [255, 255, 255], [255, 0, 0], [0, 0, 255]]).reshape(4, 3, 1, 1)
    c = rgb2centered_yuv(corners)
    assert c[:, 0].min() == -112 and c[:, 0].max() == 107
    assert c[:, 1:].min() >= -112 and c[:, 1:].max() <= 112


def test_full_swing_matches_jpeg_formula() -> None:
    rgb = _rgb(seed=1)
    yuv = rgb2centered_yuv(rgb, swing="full")
    r, g, b = rgb[:, 0], rgb[:, 1], rgb[:, 2]
    y = 0.299 * r + 0.587 * g + 0.114 * b
    u = -0.168736 * r - 0.331264 * g + 0.5 * b + 128
    v = 0.5 * r - 0.418688 * g - 0.081312 * b + 128
    ref = torch.stack([y, u, v], 1).clamp(0, 255) - 128
    assert (yuv - ref).abs().max() <= 0.5 + 1e-4
    assert yuv.min() >= -128 and yuv.max() <= 127
    assert torch.equal(bgr2centered_yuv(rgb.flip(1), swing="full"), yuv)


@pytest.mark.parametrize("swing", ["studio", "full"])
def test_round_trip_to_normalised_rgb(swing: str) -> None:
    rgb = _rgb(seed=2)
    yuv = rgb2centered_yuv(rgb, swing)
    codes = centered_yuv2rgb(yuv.to(torch.int8), swing)  # default mean 128, std 128, q_scale 1/128
    assert codes.dtype == torch.int8
    ref = numerics.quantize((rgb - 128) / 128, 1 / 128, "qint8")
    # YUV rounding loses < 1.5 RGB levels (studio compresses 256 levels into 220)
    assert int((codes.to(torch.int64) - ref.to(torch.int64)).abs().max()) <= 3
    floats = centered_yuv2rgb(yuv, swing)
    assert torch.equal(floats, numerics.dequantize(codes, 1 / 128))
    bgr = centered_yuv2bgr(yuv.to(torch.int8), swing, mean=(1.0, 2.0, 3.0), std=(60.0,), q_scale=0.05)
    rgb_codes = centered_yuv2rgb(yuv.to(torch.int8), swing, mean=(3.0, 2.0, 1.0), std=(60.0,), q_scale=0.05)
    assert torch.equal(bgr, rgb_codes.flip(1))


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="swing"):
        rgb2centered_yuv(_rgb(), swing="tv")
    with pytest.raises(ValueError, match=r"\(\.\.\., 3, H, W\)"):
        centered_yuv2rgb(torch.zeros(1, 4, 2, 2))
    with pytest.raises(ValueError, match="mean needs 1 or 3"):
        centered_yuv2rgb(torch.zeros(1, 3, 2, 2), mean=(1.0, 2.0))


class _Converted(nn.Module):
    """A converted model's head: quantized QuantStub -> quantized conv."""

    def __init__(self, stub: nn.Module, conv: nn.Module) -> None:
        super().__init__()
        self.quant = stub
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.quant(x))


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, name: str) -> bool:
        return isinstance(m, quantized.QuantizedModule) or super().is_leaf_module(m, name)


def test_seed_insertion_recipe() -> None:
    """The deployment recipe: insert centered_yuv2rgb after the QuantStub, set its scale to 1, trace."""
    qc = get_default_qat_qconfig()
    q_stub = qat.QuantStub.from_float(QuantStub(), qc)
    rgb = _rgb(1, 6, 6, seed=3)
    norm = (rgb - 128) / 128
    q_stub(norm)
    s_in = q_stub.activation_post_process.scale
    conv = qat.Conv2d.from_float(nn.Conv2d(3, 2, 3), qc)
    conv(q_stub(norm))
    model = _Converted(quantized.QuantStub.from_qat(q_stub), quantized.Conv2d.from_qat(conv, [s_in], "bayes"))
    expected = model(norm)

    gm = torch.fx.GraphModule(model, _LeafTracer().trace(model))
    for n in list(gm.graph.nodes):
        if n.target == "quant":
            with gm.graph.inserting_after(n):
                new = gm.graph.call_function(centered_yuv2rgb, (n,), {"swing": "full", "q_scale": float(s_in)})
                n.replace_all_uses_with(new)
                new.args = (n,)
    gm.quant.scale.fill_(1.0)
    gm.recompile()
    yuv = rgb2centered_yuv(rgb, swing="full")
    out = gm(yuv)
    # the YUV path feeds the conv codes within a few levels of the RGB path's codes
    assert out.dtype == expected.dtype
    assert int((out.to(torch.int64) - expected.to(torch.int64)).abs().max()) <= 8
    traced = torch.jit.trace(gm, (yuv,))
    assert torch.equal(traced(yuv), out)
