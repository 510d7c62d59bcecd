"""Nets of the op families besides conv / linear (pools, FloatFunctional methods, table lookups,
resizes, softmax, layer norm, ...) for the prepare-path oracle tests: each takes (N, 3, 16, 16)."""

from __future__ import annotations

import torch
from torch import nn

import qir.nn as qnn
from qir.nn.modules.functional import FloatFunctional
from qir.quantization import DeQuantStub, QuantStub


class PoolsAndFunctionals(nn.Module):
    """Pools, generated and user FloatFunctional methods (one FloatFunctional called four times),
    a sigmoid table lookup, bilinear and nearest resizes, ReLU / Dropout / Identity modules."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.pool, self.avg, self.gap = nn.MaxPool2d(2), nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1)
        self.ff = FloatFunctional()
        self.sig = nn.Sigmoid()
        self.up = qnn.Interpolate(scale_factor=2, mode="bilinear", align_corners=False)
        self.near = nn.Upsample(scale_factor=2, mode="nearest")
        self.relu, self.drop, self.ident = nn.ReLU(), nn.Dropout(0.1), nn.Identity()
        self.conv2 = nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv(self.quant(x))
        a, b = self.pool(x), self.avg(x)
        c = torch.cat([a + b, a * b], 1)
        c = self.ff.add_scalar(self.ff.mul_scalar(c, 0.5), 1.0)
        d = self.relu(self.drop(self.ident(self.conv2(self.up(self.sig(c))))))
        s = self.ff.add(d, self.near(a))
        m = self.ff.mean(s, dim=1, keepdim=True)
        return self.dequant(self.fc(torch.flatten(self.gap(s), 1))), self.dequant(m)


class NormsAndLuts(nn.Module):
    """Softmax, layer norm over a permuted tensor, tanh / SiLU / qir.nn.Exp / generated sigmoid
    table lookups, PReLU, GLU over a concatenation, qir.nn.Div, FloatFunctional sum and stack."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.sm = nn.Softmax(dim=1)
        self.ln = nn.LayerNorm(16)
        self.tanh, self.silu, self.exp = nn.Tanh(), nn.SiLU(), qnn.Exp()
        self.prelu = nn.PReLU(16)
        self.glu = nn.GLU(dim=1)
        self.div = qnn.Div()
        self.ff = FloatFunctional()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv(self.quant(x))
        s = self.sm(x)
        n = self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        g = self.glu(torch.cat([self.prelu(self.silu(self.tanh(n))), s], 1))
        q = self.div(self.exp(g), self.ff.add_scalar(torch.sigmoid(g), 1.0))
        return self.dequant(self.ff.sum(q, dim=(2, 3))), self.dequant(self.ff.stack([s, x], 1))


class TorchFunctionals(nn.Module):
    """torch's FloatFunctional (its own Identity ``activation_post_process`` child): an ``add`` that
    fuses into the conv before it (the ConvAdd takes the FloatFunctional's path), a ``mul`` that stays."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv0 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.add, self.mul = torch.ao.nn.quantized.FloatFunctional(), torch.ao.nn.quantized.FloatFunctional()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv0(self.quant(x))
        y = self.add.add(self.bn1(self.conv1(x)), x)
        return self.dequant(self.pool(self.mul.mul(y, x)))


class AddRelu(nn.Module):
    """``add_relu``, the FloatFunctional method with no float op of its own (an opaque call in the
    float IR), on qir's FloatFunctional after a conv + BN and on torch's after two max pools; and
    numbers on the left (``0.5 * x``, ``1.0 + x``: generated ``mul_scalar`` / ``add_scalar``)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv0 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.ar, self.tar = FloatFunctional(), torch.ao.nn.quantized.FloatFunctional()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv0(self.quant(x))
        y = self.ar.add_relu(self.bn1(self.conv1(x)), x)
        return self.dequant(self.tar.add_relu(self.pool(y), 1.0 + 0.5 * self.pool(x)))


class Recurrent(nn.Module):
    """LSTM cells on pooled conv features: one called without a state, one called twice with the
    state before it (two call sites: shared weights, each its own activation fake quants)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.cell0, self.cell = nn.LSTMCell(8, 6), nn.LSTMCell(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.flatten(self.gap(self.conv(self.quant(x))), 1)
        h, c = self.cell0(f)
        for _ in range(2):
            h, c = self.cell(f, (h, c))
        return self.dequant(h)


class RoIPool(nn.Module):
    """RoIAlign on conv features with boxes as one (K, 5) tensor and as a list of (K_i, 4) tensors
    (float buffers: the boxes stay float at every stage), then a linear head; MultiScaleRoIAlign over
    two levels (a dict of features, boxes of both levels, constant image shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.roi = qnn.RoIAlign(4, 0.5, 2)
        self.roi_list = qnn.RoIAlign((2, 3), 1.0, -1, aligned=True)
        self.fc = nn.Linear(8 * 4 * 4, 10)
        self.pool = nn.MaxPool2d(2)
        self.levels = qnn.MultiScaleRoIAlign(["p2", "p3"], 3, 2, canonical_scale=32, canonical_level=3)
        self.register_buffer("boxes", torch.tensor([[0.0, 1.0, 2.0, 20.0, 24.0], [1.0, 0.0, 0.0, 31.0, 31.0]]))
        self.register_buffer("boxes0", torch.tensor([[1.0, 1.0, 9.0, 12.0]]))
        self.register_buffer("boxes1", torch.tensor([[0.0, 2.0, 15.0, 15.0], [3.0, 3.0, 6.0, 5.0]]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f = self.conv(self.quant(x))
        y = self.fc(torch.flatten(self.roi(f, self.boxes), 1))
        p = self.levels({"p2": f, "p3": self.pool(f)}, [self.boxes0, self.boxes1], [(16, 16), (16, 16)])
        return self.dequant(y), self.dequant(self.roi_list(f, [self.boxes0, self.boxes1])), self.dequant(p)


class Leftovers(nn.Module):
    """What no call reads and what is computed from buffers: a batch norm fused away (its slot
    stays), an unused conv and an unused Sequential, and RoIAlign boxes computed from the module's
    own buffer at run time (``self.boxes * 4``, ``(self.boxes + 1.0).flip(0)``: no folded constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.unused = nn.Conv2d(8, 8, 1)
        self.spare = nn.Sequential(nn.ReLU(), nn.Identity())
        self.roi = qnn.RoIAlign(2, 1.0, 2)
        self.register_buffer("boxes", torch.tensor([[0.0, 0.0, 2.0, 3.0], [1.0, 0.5, 3.5, 3.0]]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.bn(self.conv(self.quant(x)))
        y = self.roi(f, [self.boxes * 4, (self.boxes + 1.0).flip(0)])
        return self.dequant(y), self.dequant(f)


class Anchors(nn.Module):
    """AnchorGenerators over two feature levels: one reading the float images, one the quantized
    ones (only shapes are read; the anchors are float32 at every stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.anchor = qnn.AnchorGenerator(((16.0,), (32.0, 48.0)), ((0.5, 1.0), (1.0,)))
        self.anchor_q = qnn.AnchorGenerator(((8.0,),), ((1.0, 2.0),))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = self.quant(x)
        f1 = self.conv(q)
        f2 = self.pool(f1)
        a = self.anchor(x, [f1, f2])
        b = self.anchor_q(q, [f2])
        return self.dequant(f2), a[0], a[1], b[0]


class Attention(nn.Module):
    """Self-attention on pooled conv features returning its averaged weights, called again as a
    cross-attention (two call sites), and a sequence-first attention with bool key padding and
    causal masks (buffers: masks are not quantized at any stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AvgPool2d(4)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.masked = nn.MultiheadAttention(8, 4)
        padding = torch.zeros(2, 16, dtype=torch.bool)
        padding[1, 12:] = True
        self.register_buffer("padding", padding)
        self.register_buffer("causal", torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.flatten(self.pool(self.conv(self.quant(x))), 2).transpose(1, 2)  # (N, 16, 8)
        out, weights = self.attn(s, s, s)
        t = out.transpose(0, 1)
        m, _ = self.masked(t, t, t, key_padding_mask=self.padding, attn_mask=self.causal, need_weights=False)
        y = self.attn(m.transpose(0, 1), s, s)[0]
        return self.dequant(y), self.dequant(weights)


class SharedFusions(nn.Module):
    """One conv + batch norm called twice: fused with the ReLU after the first call (a ConvReLU2d) and
    with the add after the second (a ConvAdd2d); both layers hold the one folded weight."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(y), self.dequant(self.bn(self.conv(y)) + y)


class NumberOperands(nn.Module):
    """FloatFunctional add / sub / mul called with a Python number (either side of the commutative
    ones): each runs as the scalar method (add_scalar / mul_scalar) in QAT and converted models."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.add, self.sub = FloatFunctional(), FloatFunctional()
        self.mul, self.radd = FloatFunctional(), FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        y = self.mul.mul(self.sub.sub(self.add.add(y, 2.0), 0.5), 3.0)
        return self.dequant(self.radd.add(1.5, y))
