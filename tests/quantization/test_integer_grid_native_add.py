"""The integer grid's native fused conv + add (``qir_grid_fused_add_rows``) equals the float64 torch path of
``integer_grid_conv.fused_add_blocks`` bit for bit: outputs and keep masks, in place, with NaN and
infinities, clamped accumulators and addends, both marches' rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.common.kernels import native
from qir.ir.types import DType
from qir.quantization import integer_grid_native
from qir.quantization.integer_grid import _fused_add_np
from qir.quantization.integer_grid_conv import AddConstants, fused_add_blocks

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable")


def _both(fn, monkeypatch):  # type: ignore[no-untyped-def]
    calls: list[str] = []
    real = native.run

    def counted(name, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(native, "run", counted)
    fast = fn()
    assert calls == ["qir_grid_fused_add_rows"], calls
    monkeypatch.setattr(integer_grid_native, "NATIVE", False)
    calls.clear()
    slow = fn()
    assert not calls
    monkeypatch.setattr(integer_grid_native, "NATIVE", True)
    return fast, slow


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _constants(c: int, g: torch.Generator, march: str, dtype: DType, act: str | None, nd: int = 4) -> AddConstants:
    """The float64 rule's constants as the grid's fused conv + add builds them (``_fused_add_np``)."""
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, (1,), generator=g)))
    a_max = max(-dtype.qrange[0], dtype.qrange[1])
    for _ in range(50):  # scales whose float64 bounds hold (bernoulli2's 31-bit multipliers fail some)
        s_in, s_add, s_out = 0.02 * rng.uniform(0.5, 2), 0.03 * rng.uniform(0.5, 2), 0.05 * rng.uniform(0.5, 2)
        s_w = (rng.uniform(0.2, 2.0, c) * 1e-3).astype(np.float32).astype(np.float64)
        s_acc = s_w * np.float64(np.float32(s_in))
        b_codes = np.floor(rng.uniform(-3000, 3000, c))
        fast = _fused_add_np(b_codes, s_acc, float(np.float32(s_add)), float(np.float32(s_out)), a_max, dtype, march)
        if fast is not None:
            break
    assert fast is not None
    acc_lo, acc_hi, r1, off1, r2, bits = fast
    shape = [1] * nd
    shape[1] = c

    def along(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).view(shape)

    lo, hi = dtype.qrange
    if act in ("relu", "relu6"):
        lo = 0
    if act == "relu6":
        hi = min(hi, 6 * int(1 / s_out))
    inv_add = torch.tensor(np.float32(1.0) / np.float32(s_add))
    r2_t = torch.full([1] * nd, r2, dtype=torch.float64)
    return AddConstants(along(acc_lo), along(acc_hi), along(r1), along(off1), r2_t, inv_add, bits, lo, hi, s_out)


def _data(shape: tuple[int, ...], c: AddConstants, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    hi = float(c.acc_hi.abs().max()) * 1.5  # some accumulators beyond the clamp
    acc = torch.randint(-int(hi), int(hi) + 1, shape, generator=g).float()
    acc.view(-1)[:: max(1, acc.numel() // 40)] = 0.0
    s_add = 1.0 / float(c.inv_add)
    addend = torch.randint(-140, 140, shape, generator=g).float() * np.float32(s_add)  # some past the range
    addend.view(-1)[1 :: max(2, addend.numel() // 30)] *= 1.0 + 1e-6  # codes not exactly on the grid
    return acc, addend


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
@pytest.mark.parametrize("act", [None, "relu", "relu6"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (3, 24, 56, 56), (1, 1, 1, 1), (4, 16, 9)])
def test_fused_add_equals_torch_path(shape, act, march, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(sum(shape) + len(march))
    c = _constants(shape[1], g, march, DType.qint8, act, len(shape))
    acc, addend = _data(shape, c, g)
    (o1, k1), (o2, k2) = _both(lambda: fused_add_blocks(acc, addend, c), monkeypatch)
    assert _bits_equal(o1, o2) and _bits_equal(k1, k2)
    if acc.numel() > 100:
        assert (k1 == 0).any() and (k1 != 0).any()  # both sides of the clamp were tested


def test_fused_add_in_place_and_many_blocks(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from qir.quantization import blockwise

    monkeypatch.setattr(blockwise, "BLOCK", 40)  # the torch path in many blocks, the last one short
    g = torch.Generator().manual_seed(7)
    c = _constants(6, g, "bernoulli2", DType.qint8, "relu")
    acc, addend = _data((2, 6, 17, 13), c, g)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        a = acc.clone()
        out, keep = fused_add_blocks(a, addend, c, out=a)
        assert out is a
        return out, keep

    (o1, k1), (o2, k2) = _both(run, monkeypatch)
    assert _bits_equal(o1, o2) and _bits_equal(k1, k2)


def test_fused_add_nan_and_infinities(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    c = _constants(1, g, "bayes", DType.qint8, None)
    nan, inf = float("nan"), float("inf")
    acc = torch.tensor([nan, 1.0, 2.0**31, -(2.0**31), 0.0, -0.0, 5.0, nan]).view(1, 1, 2, 4)
    addend = torch.tensor([0.1, nan, inf, -inf, -0.0, 1e30, -1e30, inf]).view(1, 1, 2, 4)
    (o1, k1), (o2, k2) = _both(lambda: fused_add_blocks(acc, addend, c), monkeypatch)
    assert _bits_equal(o1, o2) and _bits_equal(k1, k2)


def test_fused_add_falls_back_where_it_does_not_apply(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(2)
    c = _constants(4, g, "bayes", DType.qint8, None)
    acc, addend = _data((2, 4, 6, 6), c, g)
    called: list[int] = []
    monkeypatch.setattr(native, "run", lambda *a, **k: called.append(1))
    for args in (
        (acc.transpose(2, 3), addend, c),  # not contiguous
        (acc, addend.transpose(2, 3).contiguous().transpose(2, 3), c),  # the addend not contiguous
        (acc, addend, c._replace(r1=c.r1.expand(1, 4, 6, 1).contiguous())),  # varies along another axis
        (acc, addend, c._replace(lo=-(2**31), hi=2**31 - 1)),  # beyond float32's exact integers
        (acc, addend, c._replace(out_scale=1e39)),  # a scale float32 cannot hold
    ):
        fused_add_blocks(*args)
    assert not called
