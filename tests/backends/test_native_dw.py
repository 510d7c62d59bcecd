"""The four-taps-per-lane depthwise conv (native_dw.c, ``qir_dw_vnni``) against a float64 conv and the
int64 rule, and against the one-tap-per-lane kernel: odd channel counts (not multiples of 16 or 64),
kernels wider than one group of 4 columns, strides, dilations, padding wider than the input's edge,
every split of the work across threads (by rows, by channel groups, both)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_kernels import _codes, _params, _reference

from backends.common.kernels import conv as conv_mod
from backends.common.kernels import native

pytestmark = pytest.mark.skipif(not native.has_vnni(), reason=f"no AVX-512 VNNI build: {native.status()}")


@st.composite
def _case(draw: st.DrawFn) -> dict:
    c = draw(st.sampled_from([1, 3, 15, 16, 17, 31, 33, 48, 63, 64, 65, 70]))
    kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 9))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, kh)), draw(st.integers(0, kw)))
    reach = [max(1, d * (k - 1) + 1 - 2 * p) for d, k, p in zip(dilation, (kh, kw), padding, strict=True)]
    h, w = (draw(st.integers(r, r + 10)) for r in reach)
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    return {
        "x": _codes(draw, (draw(st.integers(1, 3)), c, h, w), -128, 127, seed).to(torch.int8),
        "w": _codes(draw, (c, 1, kh, kw), -128, 127, seed + 1).to(torch.int8),
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "mult": torch.randint(0, 32768, (c,), generator=g),
        "shift": torch.randint(0, 32, (c,), generator=g),
        "bias": torch.randint(-(2**20), 2**20, (c,), generator=g),
        "relu6": torch.randint(0, 128, (c,), generator=g),
        "act": draw(st.sampled_from([None, "relu", "relu6"])),
        "out": draw(st.sampled_from(["qint8", "qint16"])),
        "threads": draw(st.sampled_from([1, 2, 3])),
    }


@settings(max_examples=150, deadline=None)
@given(c=_case())
def test_four_taps_per_lane_equals_float64_conv_and_the_int64_rule(c: dict) -> None:
    fr = _params(c)
    assert fr is not None
    attrs = {"stride": list(c["stride"]), "padding": list(c["padding"]), "dilation": list(c["dilation"])}
    w = c["w"][:, 0].permute(1, 2, 0).contiguous()
    with pytest.MonkeyPatch.context() as mp, native.using_threads(c["threads"]):
        mp.setattr(native, "_SPLIT_MIN", 0)  # split even these small calls
        got = conv_mod._dw_native(c["x"], w, fr, attrs, packed=native.pack_dw(w))
        one_tap = conv_mod._dw_native(c["x"], w, fr, attrs)
    acc = F.conv2d(c["x"].double(), c["w"].double(), None, c["stride"], c["padding"], c["dilation"], c["x"].shape[1])
    assert torch.equal(got, _reference(acc.to(torch.int64).permute(0, 2, 3, 1), c))
    assert torch.equal(got, one_tap)


def test_pack_dw_layout() -> None:
    w = torch.randint(-128, 128, (3, 5, 18), dtype=torch.int8)  # 2 groups of 4 columns, 2 blocks of 16 channels
    packed, comp = native.pack_dw(w)
    assert packed.shape == (2, 3, 2, 16, 4) and comp.shape == (4, 32) and comp.dtype == torch.int32
    for cb, i, g, k, t in [(0, 0, 0, 0, 0), (1, 2, 1, 1, 0), (0, 1, 0, 15, 3), (1, 1, 0, 1, 2)]:
        assert int(packed[cb, i, g, k, t]) == int(w[i, 4 * g + t, 16 * cb + k])
    assert not bool(packed[:, :, 1, :, 1:].any())  # columns 5..7 of the kernel: zero
    assert not bool(packed[1, :, :, 2:].any())  # channels 18..31: zero
    sums = w.to(torch.int32).sum(1) * 128
    assert torch.equal(comp[:3, :18], sums) and torch.equal(comp[3, :18], -sums.sum(0))
    assert not bool(comp[:, 18:].any())
    with pytest.raises(ValueError, match="int8 \\(KH, KW, C\\)"):
        native.pack_dw(w.to(torch.int16))


@pytest.mark.parametrize(
    ("rows", "blocks", "threads", "want"),
    [
        (56, 9, 1, (9, 1)),  # one thread: one group
        (7, 60, 2, (10, 7)),  # many blocks: 6 groups, each part one group
        (112, 2, 2, (1, 1)),  # fewer blocks than parts: 2 groups, rows split too
        (14, 1, 2, (1, 1)),
    ],
)
def test_channel_groups(rows: int, blocks: int, threads: int, want: tuple[int, int]) -> None:
    with native.using_threads(threads):
        assert native.channel_groups(rows, blocks, 1 << 30) == want
        assert native.channel_groups(rows, blocks, 0) == (blocks, 1)  # too little work to split


def test_compiled_depthwise_layer_takes_the_packed_kernel() -> None:
    from bitexact_models import fx_converted
    from test_native_kernels import _Codes

    from qir.quantization import compile_model

    shape = (1, 8, 10, 10)
    converted = fx_converted(_Codes(), shape, "bayes", batches=2)
    compiled = compile_model(converted, [torch.randn(*shape)], march="bayes", opt=1, check=False)
    states = [s for inst, _, s, _ in compiled._steps if inst.attrs.get("engine") == "dw"]
    assert states and all(s.dw_pack is not None for s in states)
    x = torch.randn(*shape)
    with torch.no_grad():
        assert torch.equal(compiled(x), converted(x))


_OTHER_BUILD = """
import torch, torch.nn.functional as F
from backends.common.kernels import conv as cm, native
from qir.ir.numerics import requantize
assert native.library() is not None, native.status()
g = torch.Generator().manual_seed(0)
modes = set()
for c, k, s, d, p, hw, s0 in [(17, 3, 1, 1, 1, 9, 0), (33, 3, 2, 1, 1, 10, 0), (70, 5, 1, 2, 2, 11, 0),
                              (5, 7, 3, 1, 3, 8, 0), (40, 3, 1, 1, 1, 9, 20), (24, 3, 2, 1, 0, 12, 20)]:
    x = torch.randint(-128, 128, (2, c, hw, hw + 1), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (c, 1, k, k), dtype=torch.int8, generator=g)
    m, sh, b = (torch.randint(0, 32768, (c,), generator=g), torch.randint(s0, 32, (c,), generator=g),
                torch.randint(-(2**20), 2**20, (c,), generator=g))
    fr = cm.fused_requant("qint8", None, m, sh, b, torch.zeros(c, dtype=torch.int64), c)
    modes.add(fr.fast)
    attrs = {"stride": [s, s], "padding": [p, p], "dilation": [d, d]}
    w3 = w[:, 0].permute(1, 2, 0).contiguous()
    acc = F.conv2d(x.double(), w.double(), None, s, p, d, c).to(torch.int64).permute(0, 2, 3, 1)
    want = requantize(acc + b, m, sh, "qint8", axis=-1)
    for nt in (1, 2):
        with native.using_threads(nt):
            assert torch.equal(cm._dw_native(x, w3, fr, attrs), want)
            if native.has_vnni():
                assert torch.equal(cm._dw_native(x, w3, fr, attrs, packed=native.pack_dw(w3)), want)
assert modes == {True, False}, modes  # both modes of the requantization
print("vnni" if native.has_vnni() else "no vnni")
"""


@pytest.mark.parametrize(
    ("flags", "vnni"),
    [("-mno-avx512vbmi", "vnni"), ("-mno-avx512f", "no vnni"), ("-mno-avx512f -mno-avx2", "no vnni")],
    ids=["vnni-without-vpermb", "without-avx512", "without-avx2"],
)
def test_builds_without_vbmi_or_avx512_compute_the_same_codes(flags: str, vnni: str, tmp_path: Path) -> None:
    """The interleave without vpermb (AVX-512 VNNI CPUs without VBMI), the AVX2 loop without AVX-512
    and the portable loop without AVX2, each built with the instructions switched off
    (``QIR_NATIVE_CFLAGS``) in a subprocess."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "QIR_NATIVE_CFLAGS": flags, "QIR_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == vnni
