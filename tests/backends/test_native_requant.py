"""The native integer requantization (native_requant.h, requant_pack.py) against the float64 path
(base.RequantF64, what the torch kernels compute) and the int64 rule (numerics.requantize): edge
multipliers and shifts (0, 1, powers of two and their neighbours, the march limits, the widest the
kernels take), exact ties of the half-up rounding and their neighbours, int32 accumulators at both
ends, and both modes of the packed parameters; the AVX2 and the portable builds in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.common.kernels import conv as conv_mod
from backends.common.kernels import native
from backends.common.kernels.base import RequantF64
from backends.common.kernels.requant_pack import pack_requant
from qir.ir.numerics import requantize

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels unavailable: {native.status()}")

_I32 = (-(2**31), 2**31 - 1)
_EDGE_M = [0, 1, 2, 3, 127, 128, 255, 256, 16383, 16384, 32766, 32767]
_WIDE_M = [2**20 - 1, 2**20, 2**30, 2**31 - 1]
_EDGE_S = [0, 1, 2, 15, 16, 17, 30, 31]
_WIDE_S = [32, 33, 40, 52, 53, 62]


@st.composite
def _channel(draw: st.DrawFn, wide: bool) -> tuple[int, int, int]:
    """(M, s, bias) of one channel: an edge value or a random one in the march range (or the kernels')."""
    m_max, s_max = (2**31 - 1, 62) if wide else (32767, 31)
    m = draw(st.one_of(st.sampled_from(_EDGE_M + (_WIDE_M if wide else [])), st.integers(0, m_max)))
    s = draw(st.one_of(st.sampled_from(_EDGE_S + (_WIDE_S if wide else [])), st.integers(0, s_max)))
    b = draw(st.one_of(st.sampled_from([0, 1, -1, 2**20, -(2**20), *_I32]), st.integers(*_I32)))
    return m, s, b


def _tie(m: int, s: int, b: int, k: int) -> int | None:
    """An int32 accumulator whose (acc + b) * m / 2**s lies exactly halfway between two integers, or None."""
    if s == 0 or m == 0:
        return None
    a = (m & -m).bit_length() - 1  # m = odd * 2**a
    if a > s - 1:
        return None
    acc = (2 * k + 1) * (1 << (s - 1 - a)) - b  # (acc + b) * m = (2k + 1) * odd * 2**(s-1)
    return acc if _I32[0] <= acc <= _I32[1] else None


@st.composite
def _case(draw: st.DrawFn, wide: bool = False) -> dict:
    n = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 12))
    chans = [draw(_channel(wide)) for _ in range(n)]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    span = draw(st.sampled_from([2**8, 2**16, 2**31]))
    acc = torch.randint(max(_I32[0], -span), min(_I32[1], span) + 1, (rows, n), generator=g, dtype=torch.int64)
    # rows of exact ties (and the accumulators one below and one above them), and of the int32 extremes
    for r in range(rows):
        mode = draw(st.sampled_from(["random", "tie", "tie-1", "tie+1", "min", "max"]))
        for c, (m, s, b) in enumerate(chans):
            if mode == "min" or mode == "max":
                acc[r, c] = _I32[0] if mode == "min" else _I32[1]
            elif mode != "random":
                t = _tie(m, s, b, draw(st.integers(-(2**10), 2**10)))
                if t is not None:
                    t += {"tie": 0, "tie-1": -1, "tie+1": 1}[mode]
                    acc[r, c] = min(max(t, _I32[0]), _I32[1])
    m, s, b = (torch.tensor(v, dtype=torch.int64) for v in zip(*chans, strict=True))
    return {
        "acc": acc.to(torch.int32),
        "mult": m,
        "shift": s,
        "bias": b,
        "relu6": torch.randint(0, 128, (n,), generator=g),
        "act": draw(st.sampled_from([None, "relu", "relu6"])),
        "out": draw(st.sampled_from(["qint8", "qint16"])),
    }


def _clamps(out: torch.Tensor, c: dict) -> torch.Tensor:
    if c["act"] is not None:
        out = out.clamp(min=0)
    if c["act"] == "relu6":
        out = torch.minimum(out, c["relu6"].to(out.dtype))
    return out


def _int64_rule(c: dict) -> torch.Tensor:
    return _clamps(requantize(c["acc"].to(torch.int64) + c["bias"], c["mult"], c["shift"], c["out"], axis=-1), c)


def _float64_path(c: dict) -> torch.Tensor:
    """floor((acc + b) * M / 2**s + 1/2) in float64, saturated: exact while |acc + b| * M < 2**53."""
    v = RequantF64(c["mult"], c["shift"]).apply((c["acc"].to(torch.int64) + c["bias"]).to(torch.float64))
    lo, hi = (-128, 127) if c["out"] == "qint8" else (-32768, 32767)
    return _clamps(v.clamp(lo, hi).to(torch.int8 if c["out"] == "qint8" else torch.int16), c)


def _native(c: dict) -> torch.Tensor:
    n = int(c["mult"].numel())
    fr = conv_mod.fused_requant(c["out"], c["act"], c["mult"], c["shift"], c["bias"], c["relu6"], n)
    assert fr is not None
    return conv_mod.fused_finish(c["acc"], None, fr, int(c["acc"].shape[0]))


@settings(max_examples=200, deadline=None)
@given(c=_case())
def test_march_range_equals_the_float64_path_and_the_int64_rule(c: dict) -> None:
    """Multipliers up to 32767 and shifts up to 31 (both marches): bit for bit the float64 path."""
    got = _native(c)
    assert torch.equal(got, _float64_path(c))
    assert torch.equal(got, _int64_rule(c))


@settings(max_examples=150, deadline=None)
@given(c=_case(wide=True))
def test_widest_parameters_equal_the_int64_rule(c: dict) -> None:
    """Multipliers up to 2**31 - 1 and shifts up to 62, where float64 is no longer exact (and the
    int64 sums may wrap, as the rule's do)."""
    assert torch.equal(_native(c), _int64_rule(c))


@pytest.mark.parametrize(
    ("mult", "shift", "fast"),
    [
        ([32767, 1, 16384, 0], [31, 20, 16, 0], True),  # every ratio below 1/2
        ([32767, 1, 16384], [31, 20, 15], False),  # 16384 / 2**15 = 1/2: one channel takes the whole layer general
        ([2**31 - 1, 5], [62, 40], True),  # shifts past 32: the last shift is s - 32
        ([2**30, 7], [30, 0], False),
    ],
)
def test_both_modes_equal_the_int64_rule(mult: list[int], shift: list[int], fast: bool) -> None:
    n = len(mult)
    g = torch.Generator().manual_seed(n)
    m, s = torch.tensor(mult), torch.tensor(shift)
    b = torch.randint(-(2**20), 2**20, (n,), generator=g)
    _, mode = pack_requant(m, s, b, torch.full((n,), -128), torch.full((n,), 127))
    assert mode is fast
    acc = torch.randint(-(2**31), 2**31, (37, n), generator=g, dtype=torch.int64)
    acc[0], acc[1] = _I32[0], _I32[1]
    c = {"acc": acc.to(torch.int32), "mult": m, "shift": s, "bias": b, "relu6": b, "act": None, "out": "qint8"}
    assert torch.equal(_native(c), _int64_rule(c))


def test_pack_refuses_parameters_outside_its_range() -> None:
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="multipliers must lie in"):
        pack_requant(one * 2**31, one, one, -one, one)
    with pytest.raises(ValueError, match="shifts in"):
        pack_requant(one, one * 63, one, -one, one)
    with pytest.raises(ValueError, match="biases must lie in the int32 range"):
        pack_requant(one, one, one * 2**31, -one, one)
    with pytest.raises(ValueError, match="lo <= hi"):
        pack_requant(one, one, one, one, -one)
    with pytest.raises(ValueError, match="int64 tensors of one length"):
        pack_requant(one, one.to(torch.int32), one, -one, one)


_OTHER_BUILD = """
import torch
from backends.common.kernels import conv as cm, native
from qir.ir.numerics import requantize
assert native.library() is not None, native.status()
g = torch.Generator().manual_seed(0)
seen = set()
for n, m_max, s_lo, s_hi in [(37, 32768, 10, 32), (23, 32768, 0, 16), (19, 2**31, 0, 63), (8, 2**15, 20, 32)]:
    for rows in (1, 7):
        m, s = torch.randint(0, m_max, (n,), generator=g), torch.randint(s_lo, s_hi, (n,), generator=g)
        b = torch.randint(-(2**31), 2**31, (n,), generator=g)
        acc = torch.randint(-(2**31), 2**31, (rows, n), generator=g, dtype=torch.int32)
        acc[0, ::2], acc[0, 1::2] = -(2**31), 2**31 - 1
        for out in ("qint8", "qint16"):
            fr = cm.fused_requant(out, "relu", m, s, b, torch.zeros(n, dtype=torch.int64), n)
            seen.add(fr.fast)
            want = requantize(acc.to(torch.int64) + b, m, s, out, axis=-1).clamp(min=0)
            assert torch.equal(cm.fused_finish(acc, None, fr, rows), want), (n, out, fr.fast)
assert seen == {True, False}, seen
print("ok")
"""


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512f -mno-avx2"], ids=["avx2", "portable"])
def test_builds_without_avx512_compute_the_same_codes(flags: str, tmp_path: Path) -> None:
    """The AVX2 requantization (fast mode; the general one per channel) and the portable loop, each
    built with the instructions switched off (``QIR_NATIVE_CFLAGS``) in a subprocess."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "QIR_NATIVE_CFLAGS": flags, "QIR_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
