"""Conv / linear / add shape inference on meta tensors (qir/ir/meta_shapes.py) agrees with torch's
meta kernels, and what it does not answer (or torch rejects) still reaches torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qir.ir.meta_shapes import binary_shape, conv_shape, linear_shape
from qir.ir.ops.elementwise import Add, Mul, Sub
from qir.ir.ops.nn import Conv1d, Conv2d, Conv3d, Linear


def _meta(shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(tuple(shape), device="meta", dtype=dtype)


def _torch(fn: Any, *args: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    try:
        out = fn(*args)
    except (RuntimeError, ValueError):
        return None
    return tuple(out.shape), out.dtype


@settings(max_examples=150, deadline=None)
@given(
    dims=st.integers(1, 3),
    batch=st.integers(1, 2),
    groups=st.integers(1, 3),
    cin=st.integers(1, 3),
    cout=st.integers(1, 3),
    sizes=st.lists(st.integers(1, 9), min_size=3, max_size=3),
    kernel=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    stride=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    padding=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    dilation=st.lists(st.integers(1, 2), min_size=3, max_size=3),
    bias=st.booleans(),
    add=st.booleans(),
    wrong_channels=st.booleans(),
)
def test_conv_shape_agrees_with_torch(
    dims: int,
    batch: int,
    groups: int,
    cin: int,
    cout: int,
    sizes: list[int],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    bias: bool,
    add: bool,
    wrong_channels: bool,
) -> None:
    op_cls: Any = (Conv1d, Conv2d, Conv3d)[dims - 1]
    s, p, d = tuple(stride[:dims]), tuple(padding[:dims]), tuple(dilation[:dims])
    x = _meta((batch, cin * groups + int(wrong_channels), *sizes[:dims]))
    w = _meta((cout * groups, cin, *kernel[:dims]))
    b = _meta((cout * groups,)) if bias else None
    fn = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    want = _torch(fn, x, w, b, s, p, d, groups)
    addend = _meta(want[0]) if add and want is not None else None
    got = conv_shape(x, w, b, addend, s, p, d, groups)
    if want is None:
        assert got is None  # torch refuses: the op's compute goes on to torch for its error
        op = op_cls(stride=s, padding=p, dilation=d, groups=groups, bias=bias)
        with pytest.raises(RuntimeError):
            op.compute(x, w, *([b] if bias else []))
        return
    assert got == want[0]
    op = op_cls(stride=s, padding=p, dilation=d, groups=groups, bias=bias, add=add)
    out = op.compute(x, w, *([b] if bias else []), *([addend] if add else []))
    assert (tuple(out.shape), out.dtype) == want


def test_what_the_formulas_leave_to_torch() -> None:
    x, w = _meta((1, 2, 5, 5)), _meta((4, 2, 3, 3))
    assert conv_shape(x, w, None, None, (1, 1), "same", (1, 1), 1) is None  # padding by name
    assert conv_shape(x, w.to(torch.float64), None, None, (1, 1), (1, 1), (1, 1), 1) is None  # mixed dtypes
    assert conv_shape(torch.empty(1, 2, 5, 5), w, None, None, (1, 1), (1, 1), (1, 1), 1) is None  # real tensor
    assert conv_shape(_meta((2, 5, 5)), w, None, None, (1, 1), (1, 1), (1, 1), 1) is None  # unbatched
    assert conv_shape(x, w, None, _meta((1, 4, 1, 1)), (1, 1), (0, 0), (1, 1), 1) is None  # broadcast addend
    y = Conv2d(padding="same").compute(x, w, _meta((4,)))  # torch computes those
    assert tuple(y.shape) == (1, 4, 5, 5)
    assert linear_shape(_meta((3,)), _meta((4, 3)), None, None) is None  # 1-D input
    assert binary_shape(_meta((2, 3)), 1.0) is None
    assert binary_shape(_meta((2, 3)), _meta((4, 3))) is None  # does not broadcast
    with pytest.raises(RuntimeError):
        Add().compute(_meta((2, 3)), _meta((4, 3)))


@pytest.mark.parametrize("rows", [(5,), (2, 5), (2, 3, 5)])
@pytest.mark.parametrize(("bias", "add"), [(False, False), (True, False), (True, True)])
def test_linear_shape_agrees_with_torch(rows: tuple[int, ...], bias: bool, add: bool) -> None:
    x, w = _meta(rows), _meta((4, 5))
    b = _meta((4,)) if bias else None
    want = _torch(F.linear, x, w, b)
    assert want is not None
    operands = [x, w, *([b] if bias else []), *([_meta(want[0])] if add else [])]
    out = Linear(bias=bias, add=add).compute(*operands)
    assert (tuple(out.shape), out.dtype) == want
    with pytest.raises(RuntimeError):
        Linear(bias=False).compute(x, _meta((4, 6)))  # 5 features for a weight of 6: torch's error


@pytest.mark.parametrize("op", [Add(), Sub(), Mul()])
@pytest.mark.parametrize(("a", "b"), [((2, 3), (2, 3)), ((2, 1, 4), (3, 1)), ((), (2, 2)), ((4,), (2, 3, 4))], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_binary_shape_agrees_with_torch(op: Any, a: tuple[int, ...], b: tuple[int, ...], dtype: torch.dtype) -> None:
    x, y = _meta(a, dtype), _meta(b, dtype)
    out = op.compute(x, y)
    want = op.fn(x, y)
    assert (out.shape, out.dtype) == (want.shape, want.dtype)
    mixed = op.compute(x, _meta(b, torch.float64))  # mixed dtypes: torch promotes
    assert mixed.dtype == torch.promote_types(dtype, torch.float64)
