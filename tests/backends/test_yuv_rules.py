"""centered YUV -> RGB codes: the integer rule against the float64 formula, and the compiled program
(conv2d + clamp) against the converted model, bit for bit, on both marches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.common import numerics
from backends.common.optable import load_table
from backends.common.yuv_rules import RGB2YUV, yuv2rgb_codes, yuv2rgb_params
from passes.legality_facts import shape_facts
from qir.functional import centered_yuv2bgr, centered_yuv2rgb
from qir.ir.types import DType, TensorType
from qir.march import March, march_scope
from qir.quantization import QuantStub, check_model, compile_model, convert_fx, prepare_qat_fx
from qir.quantization.qconfig import default_qat_8bit_fake_quant_qconfig

_NORMS = [((128.0,), (128.0,), 1 / 128), ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375), 0.0208)]


def _float_formula(
    yuv: torch.Tensor, swing: str, mean: tuple[float, ...], std: tuple[float, ...], q: float
) -> torch.Tensor:
    """Inverse BT.601 in float64, RGB clamped to 0..255, normalised, quantized: an independent reference."""
    m, off, _ = RGB2YUV[swing]
    inv = torch.linalg.inv(torch.tensor(m, dtype=torch.float64))
    full = yuv.to(torch.float64) + 128 - torch.tensor(off, dtype=torch.float64).reshape(3, 1, 1)
    rgb = torch.einsum("ij,njhw->nihw", inv, full).clamp(0, 255)
    norm = (rgb - torch.tensor(mean, dtype=torch.float64).expand(3).reshape(3, 1, 1)) / torch.tensor(
        std, dtype=torch.float64
    ).expand(3).reshape(3, 1, 1)
    return numerics.quantize(norm, q, "qint8")


def _every_yuv(step: int = 3) -> torch.Tensor:
    v = torch.arange(-128, 128, step)
    y, u, w = torch.meshgrid(v, v, v, indexing="ij")
    return torch.stack([y, u, w]).reshape(1, 3, -1, 1).to(torch.int8)


@pytest.mark.parametrize("swing", ["full", "studio"])
@pytest.mark.parametrize(("mean", "std", "q"), _NORMS)
def test_within_one_code_of_the_float_formula(
    swing: str, mean: tuple[float, ...], std: tuple[float, ...], q: float
) -> None:
    yuv = _every_yuv()
    codes = centered_yuv2rgb(yuv, swing, mean, std, q)
    ref = _float_formula(yuv, swing, mean, std, q)
    assert codes.dtype == torch.int8
    assert int((codes.to(torch.int64) - ref.to(torch.int64)).abs().max()) <= 1
    # BGR is RGB with its channels (and mean / std) reversed
    bgr = centered_yuv2bgr(
        yuv, swing, tuple(reversed(mean * (3 // len(mean)))), tuple(reversed(std * (3 // len(std)))), q
    )
    assert torch.equal(bgr, codes.flip(1))


def test_params_are_integers_and_errors_name_the_argument() -> None:
    p = yuv2rgb_params("full", (128.0,), (128.0,), 1 / 128)
    assert p.weight.dtype == torch.int8 and p.bias.dtype == torch.int32 and int(p.multiplier.max()) <= 255
    with pytest.raises(ValueError, match="swing"):
        yuv2rgb_params("tv", (128.0,), (128.0,), 1 / 128)
    with pytest.raises(ValueError, match="std must be positive"):
        yuv2rgb_params("full", (128.0,), (0.0,), 1 / 128)
    with pytest.raises(ValueError, match=r"q_scale .* too small"):
        yuv2rgb_params("full", (128.0,), (128.0,), 1e-9)
    with pytest.raises(TypeError, match="integer codes"):
        yuv2rgb_codes(torch.zeros(1, 3, 1, 1), p)


class SeedNet(nn.Module):
    """Seed 001's "RGB888 Data Deployment" model."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(self.quant(input))))


def _deployed(fn: object, kwargs: dict[str, object]) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    net = SeedNet()
    net.qconfig = default_qat_8bit_fake_quant_qconfig
    qat = prepare_qat_fx(net)
    qat(torch.rand(1, 3, 28, 28))
    traced = convert_fx(qat)
    for n in traced.graph.nodes:  # seed 001's insertion, verbatim
        if n.target == "quant":
            with traced.graph.inserting_after(n):
                new_node = traced.graph.call_function(fn, (n,), kwargs)
                n.replace_all_uses_with(new_node)
                new_node.args = (n,)
    traced.quant.scale.fill_(1.0)
    traced.recompile()
    return traced


@pytest.mark.parametrize("march", [March.BAYES, March.BERNOULLI2])
@pytest.mark.parametrize(
    ("fn", "kwargs"),
    [
        (centered_yuv2rgb, {"swing": "full"}),
        (
            centered_yuv2bgr,
            {"swing": "studio", "mean": [103.53, 116.28, 123.675], "std": [57.375, 57.12, 58.395], "q_scale": 0.0208},
        ),
    ],
)
def test_seed_rgb888_deployment_checks_and_compiles_bit_exact(
    march: March, fn: object, kwargs: dict[str, object]
) -> None:
    with march_scope(march):
        traced = _deployed(fn, kwargs)
        yuv = torch.randint(-128, 128, (2, 3, 28, 28)).float()
        report = check_model(traced, yuv)
        assert report.ok and not report.unknown, str(report)
        assert any(f.spelling == f"qir.functional.{fn.__name__}" for f in report.findings)  # type: ignore[attr-defined]
        program = compile_model(traced, [yuv])
        extremes = torch.tensor([-128.0, 127.0])[torch.randint(0, 2, (1, 3, 28, 28))]
        for x in (yuv, extremes, torch.randint(-128, 128, (1, 3, 28, 28)).float()):
            assert torch.equal(program(x), traced(x))


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_the_row_takes_n_3_h_w_qint8_codes(march: str) -> None:
    entry = load_table(march).lookup("qir.functional.centered_yuv2rgb")
    ok = {**shape_facts(TensorType((2, 3, 8, 8), DType.qint8)), "input_dtype": "qint8", "output_dtype": "qint8"}
    assert entry.violations(ok) == []
    unbatched = {**ok, **shape_facts(TensorType((3, 8, 8), DType.qint8))}
    assert [v.message for v in entry.violations(unbatched)]  # (C, H, W) is rank 3: refused
    assert entry.violations({**ok, "input_dtype": "qint16"})
