"""An IPM (inverse perspective mapping) BEV segmentation model as the toolkit's BEV configs write
it: the view transformer samples the image features at a fixed ground-plane grid projected through a
homography (a float buffer, repeated over the batch read from ``feat.shape[0]``), quantized by its
own ``QuantStub`` at qint16 (``set_qconfig()`` sets the module attribute before prepare), with
``GridSample``; a residual BEV encoder, a bilinear 2x ``Interpolate`` and two heads (segmentation
logits, an occupancy ``sigmoid``). Calibration -> QAT -> convert -> check -> compile -> run, and the
calibration checkpoint loads strictly into the QAT model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from names_flow import _flat, finish
from torch import nn

from qir.dtype import qinfo
from qir.march import March, march_scope
from qir.nn import GridSample, Interpolate
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


def ipm_grid(homography: torch.Tensor, bev_hw: tuple[int, int], feat_hw: tuple[int, int]) -> torch.Tensor:
    """(1, Hb, Wb, 2) normalized image coordinates of the BEV cells' ground points."""
    ys, xs = torch.meshgrid(torch.linspace(0.5, 4.0, bev_hw[0]), torch.linspace(-2.0, 2.0, bev_hw[1]), indexing="ij")
    ground = torch.stack([xs, ys, torch.ones_like(xs)], -1)  # (Hb, Wb, 3)
    uvw = ground @ homography.T
    uv = uvw[..., :2] / uvw[..., 2:]
    norm = torch.tensor([feat_hw[1] - 1, feat_hw[0] - 1], dtype=torch.float32)
    return (uv / norm * 2 - 1).unsqueeze(0)


class IPMViewTransformer(nn.Module):
    def __init__(self, bev_hw: tuple[int, int] = (8, 8), feat_hw: tuple[int, int] = (8, 16)) -> None:
        super().__init__()
        homography = torch.tensor([[3.5, 0.0, 7.5], [0.0, -1.2, 8.0], [0.0, 0.25, 1.0]])
        self.register_buffer("grid", ipm_grid(homography, bev_hw, feat_hw))
        self.grid_quant = QuantStub()
        self.grid_sample = GridSample(mode="bilinear", padding_mode="zeros")

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        grid = self.grid_quant(self.grid.repeat(feat.shape[0], 1, 1, 1))
        return self.grid_sample(feat, grid)

    def set_qconfig(self, qat: bool) -> None:
        # a grid of pixel positions needs qint16 (an 8-bit grid moves samples by a pixel or more)
        self.grid_quant.qconfig = get_default_qat_qconfig("qint16") if qat else get_default_calib_qconfig("qint16")


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = conv_bn_relu(c, c)
        self.conv2 = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.conv1(x)) + x)


class IPMBevSeg(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.backbone = nn.Sequential(conv_bn_relu(3, 8, 2), conv_bn_relu(8, 16, 2))
        self.view_transformer = IPMViewTransformer()
        self.bev_encoder = nn.Sequential(BasicBlock(16), BasicBlock(16))
        self.up = Interpolate(scale_factor=2)  # the plugin's default: bilinear
        self.seg_head = nn.Conv2d(16, classes, 1)
        self.occ_head = nn.Conv2d(16, 1, 1)
        self.dequant_seg, self.dequant_occ = DeQuantStub(), DeQuantStub()

    def forward(self, img: torch.Tensor) -> dict[str, torch.Tensor]:
        bev = self.bev_encoder(self.view_transformer(self.backbone(self.quant(img))))
        bev = self.up(bev)
        return {"seg": self.dequant_seg(self.seg_head(bev)), "occ": self.dequant_occ(self.occ_head(bev).sigmoid())}

    def set_qconfig(self, qat: bool = True) -> None:
        self.view_transformer.set_qconfig(qat)


def _images() -> tuple[torch.Tensor]:
    return (torch.rand(2, 3, 32, 64),)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_the_ipm_grid_samples_inside_the_image() -> None:
    grid = IPMBevSeg().view_transformer.grid
    assert grid.shape == (1, 8, 8, 2) and float(grid.abs().max()) <= 1.0


def test_the_bev_model_calibrates_trains_converts_and_compiles() -> None:
    model = IPMBevSeg().eval()
    model.set_qconfig(qat=False)
    calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
    calib.eval()
    with torch.no_grad():
        for _ in range(4):
            calib(*_images())
    state = calib.state_dict()
    # the toolkit's calibration -> QAT step: a fresh float model, QAT qconfigs, the checkpoint loaded strictly
    fresh = IPMBevSeg().eval()
    fresh.set_qconfig(qat=True)
    qat = prepare_qat_fx(fresh, {"": get_default_qat_qconfig()})
    qat.load_state_dict(state, strict=True)
    assert qinfo(qat.get_submodule("view_transformer.grid_quant").activation_post_process.dtype).bits == 16
    qat.train()
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(3):
        out = qat(*_images())
        loss = out["seg"].square().mean() + out["occ"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    result = finish(qat, convert_fx(qat), _images())
    assert list(result.integer_out) == ["seg", "occ"]
    assert result.integer_out["seg"].shape == (2, 4, 16, 16)
    lsb = max(
        float(qat.get_submodule(p).activation_post_process.scale) for p in ("seg_head", "view_transformer.grid_sample")
    )
    # validation runs the integer model: QAT and converted agree within the documented 2 LSB
    assert result.max_error() <= 2.01 * lsb, (result.max_error(), lsb)
    assert all(torch.isfinite(t).all() for t in _flat(result.integer_out))
