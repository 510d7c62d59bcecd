"""A SegFormer-style segmentation model as BPU users write it with the plugin's FloatFunctional:
overlapping patch embeddings, efficient self-attention (a strided ``sr`` conv shrinks keys and values,
``self.matmul.matmul(q, k, x_trans=False, y_trans=True)``, ``mul_scalar`` by the head scale,
``nn.Softmax``, a second matmul for the context), Mix-FFN (Linear, depthwise 3x3 conv on the tokens
reshaped to an image, GELU, Linear), pre-norm residual blocks with ``nn.LayerNorm``, sizes read from
``x.shape`` (``h // 2`` in the decode head), and the all-MLP decode head (per-stage Linear, bilinear
upsampling, ``torch.cat``, a 1x1 fuse conv + BN + ReLU, the classifier at a high-precision qint32
output set by ``set_qconfig()``). Calibration -> QAT (a fresh model, the calibration checkpoint
loaded strictly) -> convert -> check -> compile -> run.

Prepared without example inputs, the model failed twice: the rank-only typing gave a Linear on
(B, N, C) tokens a rank-2 output (the FloatFunctional matmul's ``y_trans`` transpose then failed), and
a ``reshape(b, -1, h // 2, w // 2)`` on invented sizes kept its input's rank, so ``torch.cat`` of the
decode head's levels was no cat op, got no generated FloatFunctional, trained in float and was refused
only by convert."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from names_flow import finish
from torch import nn

from qir.march import March, march_scope
from qir.nn import Interpolate
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    default_calib_8bit_weight_32bit_out_fake_quant_qconfig,
    default_qat_8bit_weight_32bit_out_fake_quant_qconfig,
    get_default_calib_qconfig,
    get_default_qat_qconfig,
    prepare_qat_fx,
    set_fake_quantize,
)


class EfficientSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, reduction: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim * 2)
        self.sr = nn.Conv2d(dim, dim, reduction, reduction)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.matmul, self.matmul2, self.mul = FloatFunctional(), FloatFunctional(), FloatFunctional()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.heads, c // self.heads).permute(0, 2, 1, 3)
        x_ = x.permute(0, 2, 1).reshape(b, c, h, w)
        x_ = self.norm(self.sr(x_).reshape(b, c, -1).permute(0, 2, 1))
        kv = self.kv(x_).reshape(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        attn = self.matmul.matmul(q, k, x_trans=False, y_trans=True)
        attn = self.softmax(self.mul.mul_scalar(attn, self.scale))
        out = self.matmul2.matmul(attn, v).transpose(1, 2).reshape(b, n, c)
        return self.proj(out)


class MixFFN(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.dwconv = nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = self.fc1(x)
        b, _, c = x.shape
        x = self.dwconv(x.transpose(1, 2).reshape(b, c, h, w)).flatten(2).transpose(1, 2)
        return self.fc2(self.act(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, reduction: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = EfficientSelfAttention(dim, heads, reduction)
        self.ffn = MixFFN(dim, dim * 2)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), h, w)
        return x + self.ffn(self.norm2(x), h, w)


class Stage(nn.Module):
    def __init__(self, cin: int, dim: int, heads: int, reduction: int, stride: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(cin, dim, stride + 1, stride, (stride + 1) // 2)
        self.embed_norm = nn.LayerNorm(dim)
        self.block = Block(dim, heads, reduction)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        b, c, h, w = x.shape
        x = self.embed_norm(x.flatten(2).transpose(1, 2))
        x = self.norm(self.block(x, h, w))
        return x.reshape(b, h, w, c).permute(0, 3, 1, 2)


class SegFormerLite(nn.Module):
    def __init__(self, classes: int = 5, embed: int = 16) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stage1 = Stage(3, 16, heads=1, reduction=2, stride=4)
        self.stage2 = Stage(16, 32, heads=2, reduction=1, stride=2)
        self.linear_c1, self.linear_c2 = nn.Linear(16, embed), nn.Linear(32, embed)
        self.up = Interpolate(scale_factor=2, align_corners=False)
        self.fuse = nn.Sequential(nn.Conv2d(2 * embed, embed, 1, bias=False), nn.BatchNorm2d(embed), nn.ReLU())
        self.classifier = nn.Conv2d(embed, classes, 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        c1 = self.stage1(self.quant(img))
        c2 = self.stage2(c1)
        b, _, h, w = c1.shape
        e1 = self.linear_c1(c1.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(b, -1, h, w)
        e2 = self.linear_c2(c2.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(b, -1, h // 2, w // 2)
        fused = self.fuse(torch.cat([self.up(e2), e1], dim=1))
        return self.dequant(self.classifier(fused))

    def set_qconfig(self, qat: bool) -> None:
        # the toolkit's segmentation configs: the classifier gives a high-precision (qint32) output
        self.classifier.qconfig = (
            default_qat_8bit_weight_32bit_out_fake_quant_qconfig
            if qat
            else default_calib_8bit_weight_32bit_out_fake_quant_qconfig
        )


def _images() -> tuple[torch.Tensor]:
    return (torch.rand(2, 3, 32, 32),)


@pytest.fixture(autouse=True)
def bayes() -> Iterator[object]:
    torch.manual_seed(0)
    with march_scope(March.BAYES) as m:
        yield m


def test_the_float_model_segments() -> None:
    with torch.no_grad():
        out = SegFormerLite().eval()(*_images())
    assert out.shape == (2, 5, 8, 8)
    assert F.softmax(out, 1).sum(1).allclose(torch.ones(2, 8, 8))


def test_segformer_calibrates_trains_converts_and_compiles() -> None:
    model = SegFormerLite().eval()
    model.set_qconfig(qat=False)
    calib = prepare_qat_fx(model, {"": get_default_calib_qconfig()})
    calib.eval()
    with torch.no_grad():
        for _ in range(4):
            calib(*_images())
    # the toolkit's calibration -> QAT step: a fresh float model, QAT qconfigs, the checkpoint loaded strictly
    fresh = SegFormerLite().eval()
    fresh.set_qconfig(qat=True)
    qat = prepare_qat_fx(fresh, {"": get_default_qat_qconfig()})
    qat.load_state_dict(calib.state_dict(), strict=True)
    qat.train()
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(3):
        loss = F.cross_entropy(qat(*_images()), torch.randint(0, 5, (2, 8, 8)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    qat.eval()
    set_fake_quantize(qat, "validation")
    result = finish(qat, convert_fx(qat), _images())
    assert result.integer_out.shape == (2, 5, 8, 8)
    assert qat.get_submodule("classifier").activation_post_process is None  # the qint32 output
    # validation runs the integer model: QAT and converted agree within the documented bound (the
    # qint32 output: 2 LSB of its per-channel scale, at most 2 * max scale)
    lsb = float(convert_fx(qat).get_submodule("classifier").scale.max())
    assert result.max_error() <= 2.01 * lsb, (result.max_error(), lsb)
