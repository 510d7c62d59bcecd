"""Pool / adaptive pool / cat shape formulas (qir/ir/meta_shapes.py) agree with torch's meta kernels,
the ops that use them infer what torch's meta kernels infer, and a QAT model's IR typed by inference
(``trace(..., infer_types=True)``, what ``convert_fx`` uses) has the types one run of the model gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qir.frontend import trace
from qir.ir.meta_shapes import adaptive_pool_shape, cat_shape, pool_shape
from qir.ir.op import Op
from qir.ir.ops.pool import AdaptiveAvgPool2d, AvgPool1d, AvgPool2d, MaxPool1d, MaxPool2d, MaxPool3d
from qir.ir.ops.shape import Cat
from qir.ir.types import DType, TensorType


def _meta(shape: Any) -> torch.Tensor:
    return torch.empty(tuple(shape), device="meta")


def _torch_shape(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, ...] | None:
    try:
        return tuple(fn(*args, **kwargs).shape)
    except (RuntimeError, ValueError, IndexError, TypeError):
        return None


_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_ADAPTIVE = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


@settings(max_examples=300, deadline=None)
@given(
    nd=st.integers(1, 3),
    avg=st.booleans(),
    batch=st.integers(0, 2),
    sizes=st.lists(st.integers(0, 9), min_size=3, max_size=3),
    kernel=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    stride=st.one_of(st.none(), st.lists(st.integers(1, 3), min_size=3, max_size=3)),
    padding=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    dilation=st.lists(st.integers(1, 2), min_size=3, max_size=3),
    ceil_mode=st.booleans(),
    scalar=st.booleans(),
)
def test_pool_shape_agrees_with_torch(
    nd: int,
    avg: bool,
    batch: int,
    sizes: list[int],
    kernel: list[int],
    stride: list[int] | None,
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
    scalar: bool,
) -> None:
    shape = (batch, 2, *sizes[:nd])
    k = kernel[0] if scalar else tuple(kernel[:nd])
    s = None if stride is None else (stride[0] if scalar else tuple(stride[:nd]))
    p = padding[0] if scalar else tuple(padding[:nd])
    d = 1 if avg else (dilation[0] if scalar else tuple(dilation[:nd]))
    if avg:
        want = _torch_shape(_AVG[nd], _meta(shape), k, s, p, ceil_mode)
    else:
        want = _torch_shape(_MAX[nd], _meta(shape), k, s, p, d, ceil_mode)
    got = pool_shape(shape, nd, k, s, p, d, ceil_mode)
    if got is not None:  # the formula answers only what torch computes, and gives torch's shape
        assert got == want
    elif batch and all(sizes[:nd]) and want is not None:
        # it leaves to torch only padding beyond half the kernel (which torch refuses), and 3-d inputs
        # smaller than the kernel (which avg_pool3d refuses)
        small = nd == 3 and any(n < kk for n, kk in zip(sizes, _t(k, nd), strict=True))
        assert small or any(pp > kk // 2 for pp, kk in zip(_t(p, nd), _t(k, nd), strict=True))


def _t(v: Any, nd: int) -> tuple[int, ...]:
    return (v,) * nd if isinstance(v, int) else tuple(v)


@settings(max_examples=150, deadline=None)
@given(
    nd=st.integers(1, 3),
    batch=st.integers(0, 2),
    sizes=st.lists(st.integers(0, 9), min_size=3, max_size=3),
    out=st.lists(st.one_of(st.none(), st.integers(1, 5)), min_size=3, max_size=3),
    scalar=st.booleans(),
)
def test_adaptive_pool_shape_agrees_with_torch(
    nd: int, batch: int, sizes: list[int], out: list[int | None], scalar: bool
) -> None:
    shape = (batch, 3, *sizes[:nd])
    o: Any = (out[0] or 1) if scalar else tuple(out[:nd])
    want = _torch_shape(_ADAPTIVE[nd], _meta(shape), o)
    got = adaptive_pool_shape(shape, nd, o)
    if got is not None:
        assert got == want
    else:
        assert want is None or batch == 0 or 0 in sizes[:nd]


@settings(max_examples=150, deadline=None)
@given(
    rank=st.integers(1, 4),
    count=st.integers(1, 3),
    dim=st.integers(-4, 3),
    base=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    along=st.lists(st.integers(0, 4), min_size=3, max_size=3),
    off=st.integers(-1, 3),
)
def test_cat_shape_agrees_with_torch(
    rank: int, count: int, dim: int, base: list[int], along: list[int], off: int
) -> None:
    shapes = []
    for i in range(count):
        s = list(base[:rank])
        if -rank <= dim < rank:
            s[dim % rank] = along[i]
        if i == 1 and 0 <= off < rank:
            s[off] += 1  # sizes off the cat dim that may disagree
        shapes.append(tuple(s))
    want = _torch_shape(torch.cat, [_meta(s) for s in shapes], dim)
    got = cat_shape(shapes, dim)
    if got is not None:
        assert got == want
    else:
        assert want is None or any(s == (0,) for s in shapes)


@pytest.mark.parametrize(
    "op",
    [
        MaxPool1d(kernel_size=3),
        MaxPool2d(kernel_size=3, stride=2, padding=1),
        MaxPool2d(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), dilation=(1, 2), ceil_mode=True),
        MaxPool3d(kernel_size=2),
        AvgPool1d(kernel_size=2, ceil_mode=True),
        AvgPool2d(kernel_size=3, stride=2, padding=1, ceil_mode=True),
        AdaptiveAvgPool2d(output_size=(1, None)),
        AdaptiveAvgPool2d(output_size=1),
    ],
    ids=repr,
)
def test_pool_ops_infer_what_the_meta_kernels_give(op: Op) -> None:
    nd = int(op.name[-2])
    x = TensorType((2, 3, *(7, 6, 5)[:nd]), DType.float32)
    by_formula = op.infer_type([x])
    by_torch = Op.infer_type(op, [x])
    assert by_formula == by_torch


def test_pool_ops_leave_what_the_formula_does_not_answer_to_torch() -> None:
    with pytest.raises(RuntimeError):  # padding over half the window: torch's own error
        MaxPool2d(kernel_size=2, padding=2).infer_type([TensorType((1, 1, 5, 5), DType.float32)])
    x = TensorType((1, 4, 4), DType.float32)  # unbatched: torch's meta kernel answers
    assert MaxPool2d(kernel_size=2).infer_type([x]) == Op.infer_type(MaxPool2d(kernel_size=2), [x])


def test_cat_infers_what_the_meta_kernel_gives() -> None:
    a, b = TensorType((2, 3, 4), DType.float32), TensorType((2, 5, 4), DType.float32)
    assert Cat(dim=1).infer_type([a, b]) == Op.infer_type(Cat(dim=1), [a, b]) == TensorType((2, 8, 4), DType.float32)
    mixed = [a, TensorType((2, 5, 4), DType.float16)]  # type promotion: torch's kernel decides
    assert Cat(dim=-2).infer_type(mixed) == Op.infer_type(Cat(dim=-2), mixed)


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, stride=1, padding=1)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)


class _Net(nn.Module):
    """resnet's and mobilenet's layers: stem, max pool, a residual block, a depthwise conv, cat, an
    average pool, adaptive pool, flatten, dropout, linear; ``opaque`` adds a call with no op."""

    def __init__(self, opaque: bool = False) -> None:
        super().__init__()
        from qir.quantization import DeQuantStub, QuantStub

        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU6())
        self.pool = nn.MaxPool2d(3, 2, 1, ceil_mode=True)
        self.block = _Block(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.avg = nn.AvgPool2d(2, ceil_mode=True)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(16, 5)
        self.opaque = opaque

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.pool(self.stem(self.quant(x))))
        x = torch.cat([x, self.dw(x)], 1)
        if self.opaque:
            x = _opaque(x)
        x = self.drop(torch.flatten(self.gap(self.avg(x)), 1))
        return self.dequant(self.fc(x))


@torch.fx.wrap
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


@pytest.mark.parametrize("opaque", [False, True], ids=["formulas", "opaque call: typed by a run"])
def test_qat_ir_typed_by_inference_equals_the_run(opaque: bool) -> None:
    from qir.march import march_scope
    from qir.quantization import get_default_qat_qconfig, prepare_qat_fx

    x = torch.randn(2, 3, 19, 17)
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Net(opaque).train(), {"": get_default_qat_qconfig()}, x)
    qat(x)
    qat.eval()
    by_run = trace(qat, x)
    by_inference = trace(qat, x, infer_types=True)
    ops = {n.op.name for n in by_inference.nodes}
    layers = {"qat_conv", "qat_max_pool2d", "qat_functional", "flatten", "qat_avg_pool2d", "qat_adaptive_avg_pool2d"}
    assert layers <= ops
    assert [(n.name, n.op, n.type) for n in by_inference.nodes] == [(n.name, n.op, n.type) for n in by_run.nodes]
    assert [a.type for a in by_inference.inputs] == [a.type for a in by_run.inputs]
