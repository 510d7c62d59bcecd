"""``numerics.quantize``'s float32 shortcut (``floor(v + 0.5)`` in float32, with a look for the one value
where that sum rounds up wrongly) gives the codes of the exact half-up rounding, ``round_half_up``.

An exhaustive run over all 2**32 float32 values (qint8 and qint16 clamps) found ``0.5 - 2**-25`` the only
value where the float32 sum differs; these tests keep the parts of that run where it could go wrong:
whole binades around 0.5, every integer and half-integer neighbourhood of the qint16 range, the values
beyond 2**22 whose sum ties, and random bit patterns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qir.ir.numerics import quantize, round_half_up
from qir.ir.types import DType

_RANGES = {DType.qint8: (-128, 127), DType.qint16: (-32768, 32767)}


def _reference(v: torch.Tensor, dtype: DType) -> torch.Tensor:
    lo, hi = _RANGES[dtype]
    return round_half_up(v.clone()).clamp_(lo, hi).to(dtype.to_torch())


def _bits(lo: int, hi: int) -> torch.Tensor:
    return torch.from_numpy(np.arange(lo, hi, dtype=np.uint32).view(np.float32).copy())


def _around_halves(limit: int, ulps: int) -> torch.Tensor:
    """The ``ulps`` float32 neighbours either side of every integer and half-integer in [-limit, limit]."""
    centres = np.arange(-2 * limit, 2 * limit + 1, dtype=np.float64) / 2
    base = centres.astype(np.float32).view(np.int32)[:, None]
    steps = np.arange(-ulps, ulps + 1, dtype=np.int32)[None, :]
    out = (base + np.where(base >= 0, steps, -steps)).view(np.float32).reshape(-1)
    return torch.from_numpy(out.copy())


@pytest.mark.parametrize("dtype", list(_RANGES))
def test_every_float_in_the_binades_around_one_half(dtype: DType) -> None:
    # [0.25, 1) and (-1, -0.25]: where the float32 sum v + 0.5 changes binade
    pos = _bits(0x3E800000, 0x3F800000)
    for v in (pos, -pos):
        assert torch.equal(quantize(v, 1.0, dtype), _reference(v, dtype))


@pytest.mark.parametrize("dtype", list(_RANGES))
def test_neighbours_of_every_integer_and_half_integer(dtype: DType) -> None:
    v = _around_halves(40_000, 4)
    assert torch.equal(quantize(v, 1.0, dtype), _reference(v, dtype))


def test_the_one_value_whose_float32_sum_rounds_up() -> None:
    below_half = float(np.nextafter(np.float32(0.5), np.float32(0.0)))
    v = torch.tensor([0.25, below_half, 0.5, 1.5], dtype=torch.float32)
    assert torch.tensor(below_half) + 0.5 == 1.0  # the float32 sum alone would give code 1
    assert quantize(v, 1.0, DType.qint8).tolist() == [0, 0, 1, 2]
    # per channel, and a non-contiguous quotient
    w = torch.tensor([[below_half, 2.5], [1.0, below_half]]).t()
    assert quantize(w, torch.tensor([1.0, 1.0]), DType.qint8, axis=0).tolist() == [[0, 1], [3, 0]]


def test_large_values_and_infinities() -> None:
    big = [2.0**22 + 0.5, 2.0**23 + 1, 2.0**23 + 3, -(2.0**23) - 1, 3e38, -3e38]
    v = torch.tensor([*big, float("inf"), float("-inf")], dtype=torch.float32)
    for dtype in _RANGES:
        assert torch.equal(quantize(v, 1.0, dtype), _reference(v, dtype))


@pytest.mark.parametrize("seed", range(3))
def test_random_bit_patterns_and_scales(seed: int) -> None:
    g = np.random.default_rng(seed)
    v = torch.from_numpy(g.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32).copy())
    v = torch.nan_to_num(v, nan=0.0).reshape(64, -1)
    s = torch.from_numpy(g.uniform(1e-3, 10, 64).astype(np.float32))
    for dtype in _RANGES:
        ref = _reference(v / s.reshape(-1, 1), dtype)
        assert torch.equal(quantize(v, s, dtype, axis=0), ref)
