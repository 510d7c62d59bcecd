"""The min-max observers' fast update (``ObserverBase._fast_update``) is the general update bit for bit:
two copies of each observer see the same batches, one with the fast path turned off, and their
buffers (signed zeros included) stay identical after every batch."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from qir.quantization import (
    MinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
)
from qir.quantization.observer import ObserverBase


def _batches(seed: int, per_channel: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (4, 3, 5)

    def rnd(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    nan = rnd()
    nan[1, 2, 3] = math.nan
    inf = rnd()
    inf[0, 0, 0] = -math.inf
    neg_zero = torch.full(shape, -0.0)
    huge = rnd()
    huge[0, 1, 0] = 3e38
    huge[1, 1, 0] = -3e38  # finite, but its sums overflow: the general path
    out: list[torch.Tensor] = [rnd(), rnd(3.0), nan, rnd(0.1), inf, neg_zero, rnd(), huge, rnd(2.0)]
    out += [rnd().double(), torch.empty(0, 3, 5) if per_channel else torch.empty(0), rnd(1e-9), rnd()]
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a signed zero differs from the other zero)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


MAKERS: list[tuple[str, Callable[[], ObserverBase], bool]] = [
    ("minmax", lambda: MinMaxObserver(), False),
    ("minmax-channel", lambda: MinMaxObserver(ch_axis=1), True),
    ("avg-0", lambda: MovingAveragePerTensorMinMaxObserver(averaging_constant=0.0), False),
    ("avg-0.01", lambda: MovingAveragePerTensorMinMaxObserver(averaging_constant=0.01), False),
    ("avg-0.5", lambda: MovingAveragePerTensorMinMaxObserver(averaging_constant=0.5), False),
    ("avg-1-qint16", lambda: MovingAveragePerTensorMinMaxObserver(averaging_constant=1.0, dtype="qint16"), False),
    ("channel-0.01", lambda: MovingAveragePerChannelMinMaxObserver(averaging_constant=0.01, ch_axis=1), True),
    ("channel-1", lambda: MovingAveragePerChannelMinMaxObserver(averaging_constant=1.0, ch_axis=-1), True),
]


@pytest.mark.parametrize(("name", "make", "per_channel"), MAKERS, ids=[m[0] for m in MAKERS])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_update_is_the_general_update(
    name: str, make: Callable[[], ObserverBase], per_channel: bool, seed: int
) -> None:
    fast, ref = make(), make()
    ref._fast_update = lambda x: False  # type: ignore[method-assign]
    taken = 0
    for i, x in enumerate(_batches(seed, per_channel)):
        settled = fast.min_val.numel() > 0 and bool((fast.min_val <= fast.max_val).all())
        if fast._fast_update(x.clone()):
            taken += 1
            assert settled, (name, i)  # never on a range that has not seen data everywhere
        else:
            fast(x.clone())  # what forward does when the fast path declines
        ref(x.clone())
        for buf in ("min_val", "max_val", "scale", "nonfinite_batches"):
            assert _same(getattr(fast, buf), getattr(ref, buf)), (name, i, buf)
    assert taken >= 5, (name, taken)  # the common batches took the fast path
    assert int(fast.nonfinite_batches) == 2  # the NaN and the Inf batch, counted by the general path


PER_TENSOR = [m for m in MAKERS if not m[2]]


@pytest.mark.parametrize(("name", "make", "per_channel"), PER_TENSOR, ids=[m[0] for m in PER_TENSOR])
def test_observe_extremes_is_forward_of_the_two_values(
    name: str, make: Callable[[], ObserverBase], per_channel: bool
) -> None:
    """``observe_extremes(lo, hi)`` leaves the buffers ``forward(tensor([lo, hi]))`` leaves, or declines
    (first batch, non-finite values, a range that has not seen data) and changes nothing."""
    fast, ref = make(), make()
    g = torch.Generator().manual_seed(len(name))
    pairs = [(-1.0, 2.0), (float("nan"), 1.0), (-0.5, 0.25), (0.5, 0.5), (-3e38, 3e38), (-1e-9, 1e-9)]
    pairs += [(float(a), float(b)) for a, b in (torch.randn(20, 2, generator=g) * 3).sort(dim=1).values]
    pairs += [(1.0, -1.0), (-math.inf, 1.0), (2.0, 4.0)]
    taken = 0
    for i, (lo, hi) in enumerate(pairs):
        x = torch.tensor([lo, hi])
        before = {b: getattr(fast, b).clone() for b in ("min_val", "max_val", "scale")}
        if fast.observe_extremes(float(x[0]), float(x[1])):
            taken += 1
        else:
            for b, v in before.items():
                assert _same(getattr(fast, b), v), (name, i, b)  # declined: nothing changed
            fast(x.clone())
        ref(x.clone())
        for buf in ("min_val", "max_val", "scale", "nonfinite_batches"):
            assert _same(getattr(fast, buf), getattr(ref, buf)), (name, i, buf)
    assert taken >= 15, (name, taken)


@pytest.mark.parametrize("act", [None, "relu", "relu6"])
def test_grid_output_observation_on_the_host_is_the_tensor_path(act: str | None) -> None:
    """``integer_grid._observe_host`` (the conv output's extremes, clamped by the fused activation, into the
    output fake quant) leaves the buffers the float32 tensor path leaves, zeros and clamped values included."""
    from qir.quantization import FakeQuantize
    from qir.quantization.integer_grid import _observe_activated, _observe_host

    fast, ref = FakeQuantize(), FakeQuantize()
    g = torch.Generator().manual_seed(3)
    pairs = [(-1.0, 2.0), (-2.0, 7.5), (0.0, 3.0), (-0.0, 1.0), (-4.0, 6.0), (1e-12, 5.9999999), (-8.0, -1.0)]
    pairs += [(7.0, 9.0), (float("nan"), 2.0), (-1e39, 1.0), (-1.0, 1.0 + 1e-12)]
    pairs += [(float(a), float(b)) for a, b in (torch.randn(20, 2, generator=g) * 4).sort(dim=1).values]
    taken = 0
    for i, (lo, hi) in enumerate(pairs):
        if _observe_host(fast, lo, hi, act):
            taken += 1
        else:
            _observe_activated(fast, torch.tensor([lo, hi], dtype=torch.float32), act)
        _observe_activated(ref, torch.tensor([lo, hi], dtype=torch.float32), act)
        for buf in ("min_val", "max_val", "scale"):
            assert _same(getattr(fast.observer, buf), getattr(ref.observer, buf)), (act, i, buf)
        assert _same(fast.scale, ref.scale), (act, i)
    assert taken >= 15, (act, taken)
