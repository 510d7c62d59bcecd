"""The integer grid's native requantization and input codes equal the torch path bit for bit."""

from __future__ import annotations

import pytest
import torch

from backends.common.kernels import native
from qir.quantization import integer_grid_native
from qir.quantization.integer_grid_conv import RequantConstants, input_codes, requant_blocks

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable")


def _both(fn, monkeypatch):  # type: ignore[no-untyped-def]
    calls: list[int] = []
    real = native.run

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(native, "run", counted)
    fast = fn()
    assert calls, "the native pass did not run"
    monkeypatch.setattr(integer_grid_native, "NATIVE", False)
    calls.clear()
    slow = fn()
    assert not calls
    return fast, slow


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _constants(c: int, g: torch.Generator, lo: int, hi: int, per_tensor: bool = False) -> RequantConstants:
    n = 1 if per_tensor else c
    mult = torch.randint(1 << 14, 1 << 15, (n,), generator=g).to(torch.float64)
    shift = torch.randint(18, 30, (n,), generator=g)
    ratio = torch.ldexp(mult, -shift)
    bias = torch.randint(-(1 << 20), 1 << 20, (n,), generator=g).to(torch.float64)
    shape = (1, n, 1, 1)
    acc_grad = torch.rand(n, generator=g) * 1e-3
    return RequantConstants(
        (bias * ratio + 0.5).view(shape), ratio.view(shape), lo, hi, 0.0173, acc_grad.view(shape).float()
    )


@pytest.mark.parametrize("bounds", [(-128, 127), (0, 127), (0, 93), (-32768, 32767)])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (3, 40, 64, 64), (1, 1, 1, 1), (4, 16, 9)])
def test_requant_equals_torch_path(shape, bounds, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(sum(shape) + bounds[1])
    acc = torch.randint(-(1 << 24), 1 << 24, shape, generator=g).float()
    acc.view(-1)[:: max(1, acc.numel() // 50)] = 0.0  # ties and zeros
    c = _constants(shape[1], g, *bounds)
    if len(shape) != 4:
        c = c._replace(offset=c.offset.view(1, -1, 1), ratio=c.ratio.view(1, -1, 1), acc_grad=c.acc_grad.view(1, -1, 1))
    (o1, g1), (o2, g2) = _both(lambda: requant_blocks(acc, c), monkeypatch)
    assert _bits_equal(o1, o2) and _bits_equal(g1, g2)
    assert ((g1 == 0).any() and (g1 != 0).any()) or acc.numel() < 100


def test_requant_in_place_and_per_tensor(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(5)
    acc = torch.randint(-(1 << 22), 1 << 22, (2, 6, 33, 31), generator=g).float()
    c = _constants(6, g, -128, 127, per_tensor=True)._replace(out_scale=torch.tensor(0.031))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        a = acc.clone()
        out, gain = requant_blocks(a, c, out=a)
        assert out is a
        return out, gain

    (o1, g1), (o2, g2) = _both(run, monkeypatch)
    assert _bits_equal(o1, o2) and _bits_equal(g1, g2)


def test_requant_nan_and_large_values(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    acc = torch.tensor([float("nan"), 2.0**31, -(2.0**31), 1e30, -1e30, 0.5, -0.5, 3.0]).view(1, 1, 2, 4)
    c = _constants(1, torch.Generator().manual_seed(1), -128, 127)
    (o1, g1), (o2, g2) = _both(lambda: requant_blocks(acc, c), monkeypatch)
    assert _bits_equal(o1, o2) and _bits_equal(g1, g2)
    assert g1[0, 0, 0, 0] != 0  # a NaN keeps its gradient, as torch's hardtanh_backward


def test_requant_falls_back_where_it_does_not_apply(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    acc = torch.randint(-1000, 1000, (2, 4, 6, 6)).float()
    c = _constants(4, torch.Generator().manual_seed(2), -128, 127)
    called: list[int] = []
    monkeypatch.setattr(native, "run", lambda *a, **k: called.append(1))
    tensor_hi = c._replace(lo=torch.zeros(1, 4, 1, 1), hi=torch.full((1, 4, 1, 1), 90.0))  # per-channel bounds
    for args in (
        (acc.transpose(2, 3), c),  # not contiguous
        (acc.double(), c),  # float64 accumulator
        (acc, tensor_hi),
        (acc, c._replace(ratio=c.ratio.expand(1, 4, 6, 1).contiguous())),  # varies along another axis
        (acc, c._replace(lo=-(2**31), hi=2**31 - 1)),  # beyond float32's exact integers
    ):
        requant_blocks(*args)
    assert not called


@pytest.mark.parametrize("shape", [(8, 3, 50, 50), (5,), (2, 7, 3)])
def test_codes_equal_torch_path(shape, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(len(shape))
    s = 0.0421
    x = (torch.randint(-128, 128, shape, generator=g).float() * s) + (torch.rand(shape, generator=g) - 0.5) * 1e-3
    x.view(-1)[:3] = torch.tensor([0.5, 1.5, -2.5]) * s  # ties: half to even as torch.round
    inv = float(torch.tensor(1.0) / torch.tensor(s))
    for scale in (inv, torch.tensor(inv)):
        a, b = _both(lambda: input_codes(x, scale), monkeypatch)  # noqa: B023
        assert _bits_equal(a, b)
        monkeypatch.setattr(integer_grid_native, "NATIVE", True)


@pytest.mark.parametrize("shape", [(32, 1, 3, 3), (100, 64), (7, 5, 3, 3), (1, 9)])
@pytest.mark.parametrize("per_channel", [True, False])
def test_weight_codes_equal_torch_path(shape, per_channel, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from qir.ir import numerics
    from qir.quantization.integer_grid import _WeightCodes

    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g)
    w.view(-1)[:4] = torch.tensor([0.0, -0.0, float("nan"), 1e30])
    amax = w.nan_to_num(0.0, 0.0, 0.0).abs().reshape(shape[0], -1).amax(1).clamp_min(1e-6)
    scale = (amax / 127.5).clone() if per_channel else (amax.max() / 127.5).reshape(1)
    scale = scale * (1 - 0.3 * (torch.arange(scale.numel()) % 2))  # some channels clamp
    sb = numerics.broadcast_along(scale, 0 if per_channel else None, w.dim())
    w.view(-1)[4:8] = torch.tensor([0.5, 1.5, -0.5, -1.5]) * scale[0]  # ties: half up

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        p = w.clone().requires_grad_()
        q = _WeightCodes.apply(p, sb, -128, 127, 0.0173)
        q.backward(torch.ones_like(q))
        assert p.grad is not None
        return q.detach(), p.grad

    (q1, g1), (q2, g2) = _both(run, monkeypatch)
    assert _bits_equal(q1, q2) and _bits_equal(g1, g2)
    assert (g1 == 0).any() and (g1 != 0).any()


def test_scalars_the_kernel_cannot_take_fall_back(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A scale float32 cannot hold (struct refuses to pack it) or a one-value float64 tensor that is
    not 0-d (torch computes in float64 then): the torch path runs and gives its result."""
    called: list[int] = []
    monkeypatch.setattr(native, "run", lambda *a, **k: called.append(1))
    x = torch.tensor([1e-30, 2.0, -3.0])
    acc = torch.randint(-1000, 1000, (2, 4, 6, 6)).float()
    c = _constants(4, torch.Generator().manual_seed(3), -128, 127)
    for scale in (1e39, float("inf"), torch.tensor([1 / 0.3], dtype=torch.float64)):
        assert integer_grid_native.native_codes(x, scale) is None
        assert integer_grid_native.native_requant(acc, c.ratio, c.offset, -128, 127, scale, c.acc_grad, acc) is None
    assert not called
    monkeypatch.setattr(integer_grid_native, "NATIVE", False)
    huge = input_codes(x, 1e39)  # the torch path's result, without an error
    assert huge.dtype == torch.float32 and torch.isinf(huge[1:]).all()


@pytest.mark.parametrize(
    ("kind", "shape", "groups", "spread"),
    [
        ("Linear", (40, 1280), 1, 64),  # fits in one piece
        ("Linear", (40, 1280), 1, 127),  # some rows past 2**24 / 128: chunks
        ("Conv2d", (16, 512, 3, 3), 1, 127),
        ("Conv2d", (16, 160, 3, 3), 1, 30),
        ("Conv2d", (32, 1024, 3, 3), 4, 127),  # grouped, past the bound: float64
        ("Conv2d", (32, 256, 3, 3), 4, 20),  # grouped, within
    ],
)
def test_reduction_split_native_equals_torch(kind, shape, groups, spread, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The largest output channel's sum of |weight codes| taken natively gives the split the torch sums give."""
    from qir.quantization.integer_grid import _reduction_split

    g = torch.Generator().manual_seed(shape[1] + spread)
    wq = torch.randint(-spread, spread + 1, shape, generator=g).float()
    wq[0].fill_(127.0 if spread > 100 else float(spread))  # one row at its largest
    wq.view(-1)[1::7] = -0.0

    class _M:
        out_features = out_channels = shape[0]

    m = _M()
    m.groups = groups  # type: ignore[attr-defined]
    fast, slow = _both(lambda: _reduction_split(m, kind, wq, 128), monkeypatch)
    assert fast == slow
    monkeypatch.setattr(integer_grid_native, "NATIVE", True)
    top = integer_grid_native.native_abs_row_max(wq)
    assert top == int(wq.abs().reshape(shape[0], -1).sum(1).max())
    wq.view(-1)[5] = float("nan")
    assert integer_grid_native.native_abs_row_max(wq) is None
