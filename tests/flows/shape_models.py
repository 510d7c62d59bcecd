"""Small float models computing sizes the way Horizon users write them (``b * heads`` in
attention, ``h // 2`` for a crop, ``x.view(x.shape[0], -1)`` before a Linear, ``len(x)``,
``x.numel()``, ``x.dim()``), shared by the shape-arithmetic tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import DeQuantStub

from qir.quantization import QuantStub


class HeadsAttention(nn.Module):
    """Multi-head self-attention with the head split computed from ``x.shape``: ``b * heads``."""

    def __init__(self, c: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        self.heads = heads
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = (q @ k.transpose(-2, -1)).softmax(-1)
        y = (a @ v).reshape(b * self.heads, n, c // self.heads)  # (b*heads, n, d): the size users compute
        y = y.reshape(b, self.heads, n, c // self.heads).transpose(1, 2).reshape(b, n, c)
        return self.dequant(self.proj(y))


class HalfCrop(nn.Module):
    """A crop from sizes: rows ``[: h // 2]``, columns ``[w % 3 : w - 1]`` (``x.size(3)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.quant(x))
        h, w = x.shape[2], x.size(3)
        return self.dequant(x[:, :, : h // 2, w % 3 : w - 1])


class FlattenHead(nn.Module):
    """``x.view(x.shape[0], -1)`` before a Linear (MTCNN's RNet / ONet do this)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.quant(x))
        return self.dequant(self.fc(x.view(x.shape[0], -1)))


class SizeQueries(nn.Module):
    """``len(x)``, ``x.numel()``, ``x.dim()``, ``x.size()``, ``x.shape[2:]`` into reshape / permute /
    repeat / expand / slicing."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.quant(x))
        b, c, n, d = len(x), x.size(1), x.numel(), x.dim()
        h, w = x.shape[2:]
        y = x.reshape(b, c // 2, 2, -1).permute(0, 2, 1, 3).reshape(x.size())
        y = y.repeat(1, 1, 1, 2)[:, :, :, : x.shape[-1]]
        z = y[:, :1].expand(b, c, h, w)
        return self.dequant(z.reshape(b, n // b + d - 4))


class FPNTopDown(nn.Module):
    """FPN top-down step: upsample the coarser level to ``size=lateral.shape[2:]`` and add."""

    def __init__(self, mode: str = "bilinear") -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        self.mode = mode
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.lateral = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c1 = self.c1(self.quant(x))
        lateral = self.lateral(c1)
        top = self.c2(c1)
        kw = {"align_corners": False} if self.mode == "bilinear" else {}
        up = F.interpolate(top, size=lateral.shape[2:], mode=self.mode, **kw)
        return self.dequant(lateral + up)


class FPNTopDownNearest(FPNTopDown):
    def __init__(self) -> None:
        super().__init__("nearest")


class CoordHead(nn.Module):
    """CoordConv-style head: x positions built from sizes (``torch.arange(w)``, ``torch.zeros((b, 1, h, 1))``)
    in float, quantized by their own QuantStub, concatenated to the features."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.quant_pos = QuantStub()
        self.dequant = DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Conv2d(5, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.conv(self.quant(x))
        b, _, h, w = f.shape
        pos = torch.arange(w, dtype=torch.float32).view(1, 1, 1, w).expand(b, 1, h, w) + torch.zeros((b, 1, h, 1))
        return self.dequant(self.head(torch.cat([f, self.quant_pos(pos)], 1)))


#: name -> (model class, input shape, marches where every op is legal)
SHAPE_MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...], tuple[str, ...]]] = {
    "attention": (HeadsAttention, (8, 6, 16), ("bayes",)),
    "fpn_bilinear": (FPNTopDown, (8, 3, 10, 14), ("bayes", "bernoulli2")),
    "fpn_nearest": (FPNTopDownNearest, (8, 3, 10, 14), ("bayes", "bernoulli2")),
    "coord_head": (CoordHead, (8, 3, 8, 10), ("bayes", "bernoulli2")),
    "crop": (HalfCrop, (8, 3, 8, 8), ("bayes", "bernoulli2")),
    "flatten_head": (FlattenHead, (8, 3, 8, 8), ("bayes",)),
    "size_queries": (SizeQueries, (8, 4, 6, 6), ("bayes",)),
}
