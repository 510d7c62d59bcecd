"""Each op family: trace a small module, then the interpreter and the emitted module agree with it."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fe_helpers import op_names, roundtrip
from torch import nn


class _Fn(nn.Module):
    def __init__(self, fn: Callable[..., Any], *mods: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        self.mods = nn.ModuleList(mods)


class _Fn1(_Fn):
    def forward(self, x: Any) -> Any:
        return self.fn(self, x)


class _Fn2(_Fn):
    def forward(self, x: Any, y: Any) -> Any:
        return self.fn(self, x, y)


class _Fn3(_Fn):
    def forward(self, x: Any, y: Any, z: Any) -> Any:
        return self.fn(self, x, y, z)


def Fn(fn: Callable[..., Any], *mods: nn.Module) -> nn.Module:
    """A module running ``fn(self, *inputs)``, so a table row can be one expression."""
    cls = {1: _Fn1, 2: _Fn2, 3: _Fn3}[fn.__code__.co_argcount - 1]
    return cls(fn, *mods)


def x4(*shape: int) -> torch.Tensor:
    return torch.randn(*(shape or (2, 4, 6, 6)))


POS = lambda: torch.rand(2, 4, 6, 6) * 0.8 + 0.1

CASES: list[tuple[str, Callable[[], nn.Module], Callable[[], tuple[Any, ...]], str]] = [
    # unary math: torch functions and Tensor methods
    *[
        (f"torch.{n}", (lambda n=n: Fn(lambda s, x: getattr(torch, n)(x))), lambda: (POS(),), n)
        for n in [
            "abs",
            "acos",
            "asin",
            "atan",
            "atanh",
            "ceil",
            "cos",
            "cosh",
            "erf",
            "exp",
            "floor",
            "log",
            "reciprocal",
            "rsqrt",
            "sin",
            "sinh",
            "sqrt",
            "tan",
            "tanh",
            "sigmoid",
            "neg",
            "round",
            "sign",
        ]
    ],
    ("torch.acosh", lambda: Fn(lambda s, x: torch.acosh(x + 1.5)), lambda: (POS(),), "acosh"),
    ("torch.asinh", lambda: Fn(lambda s, x: torch.asinh(x)), lambda: (x4(),), "asinh"),
    ("Tensor.exp", lambda: Fn(lambda s, x: x.exp().abs()), lambda: (x4(),), "exp"),
    # activations: modules and functions
    *[
        (f"nn.{m.__name__}", (lambda m=m: m()), lambda: (x4(),), "")
        for m in [
            nn.ReLU,
            nn.ReLU6,
            nn.Sigmoid,
            nn.Tanh,
            nn.SiLU,
            nn.GELU,
            nn.ELU,
            nn.SELU,
            nn.Hardswish,
            nn.Hardsigmoid,
            nn.LeakyReLU,
            nn.Softplus,
            nn.Mish,
            nn.Hardtanh,
            nn.Identity,
        ]
    ],
    ("nn.GLU", lambda: nn.GLU(1), lambda: (x4(),), "glu"),
    ("nn.PReLU", lambda: nn.PReLU(4), lambda: (x4(),), "prelu"),
    ("nn.Softmax", lambda: nn.Softmax(dim=1), lambda: (x4(),), "softmax"),
    ("F.relu/relu6/hardswish", lambda: Fn(lambda s, x: F.hardswish(F.relu6(F.relu(x) - 1))), lambda: (x4(),), ""),
    (
        "F.leaky_relu/gelu",
        lambda: Fn(lambda s, x: F.gelu(F.leaky_relu(x, 0.2), approximate="tanh")),
        lambda: (x4(),),
        "gelu",
    ),
    ("F.softmax/log_softmax", lambda: Fn(lambda s, x: F.log_softmax(x, -1) + x.softmax(dim=1)), lambda: (x4(),), ""),
    # binary: operators, torch functions, methods, scalars on either side
    ("x+y*z", lambda: Fn(lambda s, x, y: x + y * x - y / (x.abs() + 1)), lambda: (x4(), x4()), "add"),
    ("scalars", lambda: Fn(lambda s, x: 1 - 2 * x + x**2 / 3), lambda: (x4(),), "sub"),
    (
        "torch.add/sub/mul/div",
        lambda: Fn(lambda s, x, y: torch.div(torch.mul(torch.sub(torch.add(x, y), 1), y), 2)),
        lambda: (x4(), x4()),
        "div",
    ),
    ("div rounding", lambda: Fn(lambda s, x: torch.div(x * 10, 3, rounding_mode="floor")), lambda: (x4(),), "div"),
    (
        "compare",
        lambda: Fn(lambda s, x, y: (torch.eq(x, y), x > y, x.ge(0), torch.lt(x, y), x <= 0, x != y)),
        lambda: (x4(), x4()),
        "eq",
    ),
    (
        "maximum/minimum/max2",
        lambda: Fn(lambda s, x, y: torch.maximum(x, y) + torch.minimum(x, y) + torch.max(x, y)),
        lambda: (x4(), x4()),
        "maximum",
    ),
    (
        "clamp",
        lambda: Fn(lambda s, x: torch.clamp(x, -0.5, 0.5) + x.clamp(min=0) + torch.clip(x, max=0.1)),
        lambda: (x4(),),
        "clamp",
    ),
    ("clamp tensor", lambda: Fn(lambda s, x, lo: x.clamp(min=lo)), lambda: (x4(), x4()), "clamp"),
    ("where", lambda: Fn(lambda s, x: torch.where(x > 0, x, 0.0)), lambda: (x4(),), "where"),
    ("pow", lambda: Fn(lambda s, x: torch.pow(x.abs(), 1.5)), lambda: (x4(),), "pow"),
    (
        "einsum",
        lambda: Fn(lambda s, x, y: torch.einsum("bij,bjk->bik", x, y) + torch.einsum("bij,bjk->bik", [x, y])),
        lambda: (x4(2, 3, 4), x4(2, 4, 5)),
        "einsum",
    ),
    (
        "matmul",
        lambda: Fn(lambda s, x, y: torch.matmul(x, y) + x @ y + x.matmul(y)),
        lambda: (x4(2, 3, 4), x4(2, 4, 5)),
        "matmul",
    ),
    # reductions
    (
        "mean/sum",
        lambda: Fn(lambda s, x: (x.mean((2, 3), keepdim=True), torch.sum(x, 1), x.mean(), x.sum(dim=-1))),
        lambda: (x4(),),
        "mean",
    ),
    (
        "max/min dim",
        lambda: Fn(lambda s, x: (torch.max(x, 1)[0], x.min(dim=2).indices, x.max(), torch.amax(x, 1))),
        lambda: (x4(),),
        "max",
    ),
    (
        "argmax/topk",
        lambda: Fn(lambda s, x: (x.argmax(1), torch.argmin(x, -1), torch.topk(x, 2, dim=1).values)),
        lambda: (x4(),),
        "topk",
    ),
    # shapes
    (
        "reshape dynamic",
        lambda: Fn(lambda s, x: x.reshape(x.size(0), -1) + x.view(x.shape[0], -1)),
        lambda: (x4(),),
        "reshape",
    ),
    (
        "view varargs",
        lambda: Fn(lambda s, x: x.view(2, 4, 36).permute(0, 2, 1).contiguous()),
        lambda: (x4(),),
        "permute",
    ),
    (
        "flatten/transpose",
        lambda: Fn(lambda s, x: torch.flatten(x.transpose(1, 2), 1), nn.Flatten()),
        lambda: (x4(),),
        "flatten",
    ),
    ("nn.Flatten", lambda: nn.Flatten(), lambda: (x4(),), "flatten"),
    (
        "squeeze/unsqueeze",
        lambda: Fn(lambda s, x: x.unsqueeze(1).squeeze(1).mean(3, keepdim=True).squeeze(-1)),
        lambda: (x4(),),
        "squeeze",
    ),
    (
        "expand/repeat/tile",
        lambda: Fn(
            lambda s, x: (
                x[:, :1].expand(-1, 4, -1, -1) + x.repeat(1, 1, 1, 1) + torch.tile(x, (1, 1)) + x[:, :1].expand_as(x)
            )
        ),
        lambda: (x4(),),
        "expand",
    ),
    (
        "cat/stack",
        lambda: Fn(lambda s, x, y: torch.stack([torch.cat([x, y], 1), torch.cat((y, x), dim=1)])),
        lambda: (x4(), x4()),
        "cat",
    ),
    (
        "split/chunk/unbind",
        lambda: Fn(
            lambda s, x: (torch.split(x, 2, 1)[1], x.chunk(2, dim=1)[0], x.unbind(0)[1], x.split([1, 3], dim=1)[1])
        ),
        lambda: (x4(),),
        "split",
    ),
    (
        "roll/flip",
        lambda: Fn(lambda s, x: torch.roll(x, shifts=(1, -1), dims=(2, 3)) + x.flip(2)),
        lambda: (x4(),),
        "roll",
    ),
    ("getitem", lambda: Fn(lambda s, x: x[:, 1:3, ..., ::2] * x[0, None, :2, 1:, 0].sum()), lambda: (x4(),), "getitem"),
    (
        "gather/index_select",
        lambda: Fn(lambda s, x, i: torch.gather(x, 1, i) + torch.index_select(x, 1, i[0, :, 0, 0])),
        lambda: (x4(), torch.randint(0, 4, (2, 4, 6, 6))),
        "gather",
    ),
    (
        "pixel/channel shuffle",
        lambda: Fn(lambda s, x: F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2), nn.ChannelShuffle(2)),
        lambda: (x4(),),
        "pixel_shuffle",
    ),
    ("nn.PixelShuffle", lambda: nn.PixelShuffle(2), lambda: (x4(),), "pixel_shuffle"),
    ("nn.ChannelShuffle", lambda: nn.ChannelShuffle(2), lambda: (x4(),), "channel_shuffle"),
    # pools
    ("nn.MaxPool2d", lambda: nn.MaxPool2d(3, 2, 1), lambda: (x4(),), "max_pool2d"),
    ("nn.AvgPool2d", lambda: nn.AvgPool2d(2, ceil_mode=True), lambda: (x4(),), "avg_pool2d"),
    ("nn.AdaptiveAvgPool2d", lambda: nn.AdaptiveAvgPool2d((1, 2)), lambda: (x4(),), "adaptive_avg_pool2d"),
    ("nn.AdaptiveMaxPool2d", lambda: nn.AdaptiveMaxPool2d(2), lambda: (x4(),), "adaptive_max_pool2d"),
    (
        "F pools",
        lambda: Fn(lambda s, x: F.max_pool2d(x, 2) + F.avg_pool2d(x, 2, 2) + F.adaptive_avg_pool2d(x, 3)),
        lambda: (x4(),),
        "max_pool2d",
    ),
    # vision
    (
        "F.interpolate",
        lambda: Fn(
            lambda s, x: (
                F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) + F.interpolate(x, size=(12, 12))
            )
        ),
        lambda: (x4(),),
        "interpolate",
    ),
    (
        "interpolate to size of",
        lambda: Fn(lambda s, x, y: F.interpolate(x, size=y.shape[-2:], mode="nearest")),
        lambda: (x4(), x4(2, 4, 9, 9)),
        "interpolate",
    ),
    ("nn.Upsample", lambda: nn.Upsample(scale_factor=2, mode="nearest"), lambda: (x4(),), "interpolate"),
    (
        "F.pad",
        lambda: Fn(lambda s, x: F.pad(x, [1, 2, 0, 1]) + 0 * F.pad(x, (1, 2, 0, 1), mode="reflect")),
        lambda: (x4(),),
        "pad",
    ),
    *[
        (f"nn.{m.__name__}", (lambda m=m: m(1)), lambda: (x4(),), "pad")
        for m in [nn.ZeroPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d]
    ],
    ("nn.ConstantPad2d", lambda: nn.ConstantPad2d((1, 0, 2, 0), 0.5), lambda: (x4(),), "pad"),
    (
        "F.grid_sample",
        lambda: Fn(lambda s, x, g: F.grid_sample(x, g, align_corners=False)),
        lambda: (x4(), torch.rand(2, 3, 3, 2) * 2 - 1),
        "grid_sample",
    ),
    # weighted and normalisation
    (
        "nn.Conv2d/BN/Linear",
        lambda: nn.Sequential(nn.Conv2d(4, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(108, 5)),
        lambda: (x4(),),
        "conv2d",
    ),
    (
        "nn.ConvTranspose2d",
        lambda: nn.Sequential(nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)),
        lambda: (x4(),),
        "conv_transpose2d",
    ),
    (
        "nn.Conv1d/BatchNorm1d",
        lambda: nn.Sequential(nn.Conv1d(4, 3, 3), nn.BatchNorm1d(3)),
        lambda: (x4(2, 4, 9),),
        "conv1d",
    ),
    (
        "F.conv2d/linear",
        lambda: Fn(lambda s, x, w, v: F.linear(F.conv2d(x, w, stride=2).flatten(1), v)),
        lambda: (x4(), x4(3, 4, 3, 3), x4(5, 12)),
        "conv2d",
    ),
    ("nn.LayerNorm", lambda: nn.LayerNorm([6]), lambda: (x4(),), "layer_norm"),
    (
        "F.layer_norm",
        lambda: Fn(lambda s, x, w: F.layer_norm(x, (6,), w, None, 1e-6)),
        lambda: (x4(), x4(6)),
        "layer_norm",
    ),
    ("nn.GroupNorm", lambda: nn.GroupNorm(2, 4), lambda: (x4(),), "group_norm"),
    ("nn.Dropout", lambda: nn.Sequential(nn.Dropout(0.3), nn.Dropout2d()), lambda: (x4(),), "dropout"),
    ("F.dropout eval", lambda: Fn(lambda s, x: F.dropout(x, 0.5, training=False)), lambda: (x4(),), "dropout"),
    # composite modules
    (
        "nn.MultiheadAttention",
        lambda: Fn(
            lambda s, x: s.mods[0](x, x, x, need_weights=False)[0], nn.MultiheadAttention(8, 2, batch_first=True)
        ),
        lambda: (x4(2, 5, 8),),
        "multihead_attention",
    ),
    (
        "nn.MultiheadAttention weights",
        lambda: Fn(lambda s, q, k: s.mods[0](q, k, k), nn.MultiheadAttention(8, 2)),
        lambda: (x4(5, 2, 8), x4(3, 2, 8)),
        "multihead_attention",
    ),
    (
        "nn.LSTMCell",
        lambda: Fn(lambda s, x, h, c: s.mods[0](x, (h, c)), nn.LSTMCell(4, 6)),
        lambda: (x4(3, 4), x4(3, 6), x4(3, 6)),
        "lstm_cell",
    ),
    ("nn.LSTMCell no state", lambda: nn.Sequential(nn.LSTMCell(4, 6)), lambda: (x4(3, 4),), "lstm_cell"),
    (
        "cast",
        lambda: Fn(
            lambda s, x: x.to(torch.float16).float() + x.long().to(dtype=torch.float32) + (x > 0).type(torch.float32)
        ),
        lambda: (x4(),),
        "cast",
    ),
    ("size/dim/numel", lambda: Fn(lambda s, x: x * x.dim() + x.numel() + x.size(1)), lambda: (x4(),), "size"),
    ("operator.getitem on size", lambda: Fn(lambda s, x: x.new_zeros(1) + x.size()[1]), lambda: (x4(),), "getitem"),
]


@pytest.mark.parametrize("label,make,inputs,expect", CASES, ids=[c[0] for c in CASES])
def test_op_family(
    label: str, make: Callable[[], nn.Module], inputs: Callable[[], tuple[Any, ...]], expect: str
) -> None:
    torch.manual_seed(0)
    m = make().eval()
    g = roundtrip(m, *inputs())
    names = op_names(g)
    if expect:
        assert expect in names, names
    assert "call" not in names or label.startswith("operator.getitem"), [
        (n.name, n.op.attributes(), n.meta.get("frontend_note")) for n in g.nodes if n.op.name == "call"
    ]


def test_operator_functions_map_to_ops() -> None:
    m = Fn(lambda s, x: operator.neg(operator.mul(x, 2)))
    g = roundtrip(m, x4())
    assert op_names(g) == ["mul", "neg"]
