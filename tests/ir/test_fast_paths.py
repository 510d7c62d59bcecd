"""Shortcuts the pipeline takes for speed give what the slow, general way gives.

``abs_sums`` / ``abs_sum_max`` (float reductions of integer codes) equal the int64 reduction, and
so does the per-channel weight L1 the verifier bounds conv / linear accumulators with; ReLU / ReLU6 /
batch norm shape inference on meta tensors agrees with torch's meta kernels, and inputs torch
rejects still reach torch for its error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qir.ir import TensorType
from qir.ir.numerics import abs_sum_max, abs_sums
from qir.ir.ops.elementwise import Relu, Relu6
from qir.ir.ops.integer_values import _channel_l1
from qir.ir.ops.nn import BatchNorm
from qir.ir.types import DType


def _int64_reference(codes: torch.Tensor, axis: int) -> int:
    t = codes.to(torch.int64).abs().transpose(0, axis)
    return int(t.reshape(t.shape[0], -1).sum(dim=1).max()) if codes.numel() else 0


_DTYPES = {torch.int8: (-128, 127), torch.int16: (-32768, 32767), torch.int32: (-(2**31), 2**31 - 1)}


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(_DTYPES)),
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    extremes=st.booleans(),
)
def test_abs_sum_max_equals_the_int64_reduction(
    dtype: torch.dtype, shape: list[int], seed: int, extremes: bool
) -> None:
    lo, hi = _DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(dtype)
    if extremes and codes.numel():
        codes.view(-1)[::2] = lo  # |lo| does not fit the dtype: the reduction must not wrap
    for axis in range(len(shape)):
        assert abs_sum_max(codes, axis) == _int64_reference(codes, axis)
        sums = abs_sums(codes, axis)
        want = torch.zeros(shape[axis], dtype=torch.int64)
        if codes.numel():
            want = codes.to(torch.int64).abs().transpose(0, axis).reshape(shape[axis], -1).sum(dim=1)
        assert sums.dtype == torch.int64 and torch.equal(sums, want)


@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_transposed_conv_channel_l1_equals_the_int64_reduction(groups: int) -> None:
    torch.manual_seed(groups)
    w = torch.randint(-128, 128, (8, 4, 3, 3), dtype=torch.int8)  # (in, out / groups, kh, kw)
    w[0, 0, 0, 0] = -128
    g = groups if 8 % groups == 0 else 1
    want = w.to(torch.int64).abs().reshape(g, 8 // g, 4, -1).sum(dim=(1, 3)).reshape(-1)
    assert torch.equal(_channel_l1(w, 1, groups), want)


@pytest.mark.parametrize(
    ("dtype", "fill", "columns"),
    [
        (torch.int8, -128, 131071),  # 128 * 131071 < 2**24: float32
        (torch.int8, -128, 131072),  # reaches 2**24: float64
        (torch.int16, -32768, 600),
        (torch.int32, -(2**31), 3),
    ],
)
def test_abs_sum_max_is_exact_at_the_float_limits(dtype: torch.dtype, fill: int, columns: int) -> None:
    codes = torch.full((2, columns), fill, dtype=dtype)
    codes[1, 0] = fill + 1  # the other row sums one less: an inexact sum would tie or flip them
    assert abs_sum_max(codes) == abs(fill) * columns == _int64_reference(codes, 0)


def test_abs_sum_max_of_float_codes_truncates_like_int64() -> None:
    w = torch.tensor([[1.7, -2.9], [0.5, 3.2]])
    assert abs_sum_max(w) == _int64_reference(w, 0) == 3


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


@pytest.mark.parametrize("op", [Relu(), Relu6()])
def test_relu_shape_inference_agrees_with_torch(op: Relu | Relu6) -> None:
    t = TensorType((2, 3, 5, 5), DType.float32)
    assert op.infer_type([t]) == t
    x = torch.randn(2, 3)
    assert torch.equal(op.compute(x), F.relu(x) if isinstance(op, Relu) else F.relu6(x))  # real tensors: computed


def test_batch_norm_shape_inference_agrees_with_torch() -> None:
    op = BatchNorm()
    x = _meta(2, 4, 6, 6)
    params = [_meta(4) for _ in range(4)] + [torch.empty((), device="meta", dtype=torch.int64)]
    fast = op.compute(x, *params)
    slow = F.batch_norm(x, params[2], params[3], params[0], params[1], False, 0.1, 1e-5)
    assert (fast.shape, fast.dtype) == (slow.shape, slow.dtype)


def test_batch_norm_shape_inference_refuses_what_torch_refuses() -> None:
    op = BatchNorm()
    x = _meta(2, 4, 6, 6)
    wrong = [_meta(3) for _ in range(4)] + [torch.empty((), device="meta", dtype=torch.int64)]
    with pytest.raises(RuntimeError, match="running_mean should contain 4 elements"):
        op.compute(x, *wrong)  # 3 statistics for 4 channels: torch's own error
