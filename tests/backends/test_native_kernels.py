"""The native one-pass kernels (backends/common/kernels/native.c) against the int64 reference rules:
requantization, the fused conv + add rule and the depthwise conv, on random shapes and values
with the extremes (int32 accumulators at +-2**31, codes at -128 / 127 everywhere); and the torch
paths that replace them when no C compiler is available."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from bitexact_models import digits_net, fx_converted
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qir
from backends.common.integer_rules import fused_add_int
from backends.common.kernels import conv as conv_mod
from backends.common.kernels import native
from qir.ir.numerics import requantize
from qir.quantization import QuantStub, compile_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels unavailable: {native.status()}")

_I32 = (-(2**31), 2**31 - 1)


def _codes(draw: st.DrawFn, shape: tuple[int, ...], lo: int, hi: int, seed: int) -> torch.Tensor:
    """Random integers in [lo, hi], or all at one extreme (where saturation and overflow live)."""
    mode = draw(st.sampled_from(["random", "lo", "hi", "mixed"]))
    if mode == "lo":
        return torch.full(shape, lo, dtype=torch.int64)
    if mode == "hi":
        return torch.full(shape, hi, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64)
    if mode == "mixed":
        t = torch.where(torch.rand(shape, generator=g) < 0.5, torch.full_like(t, lo), torch.full_like(t, hi))
    return t


@st.composite
def _requant_case(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 30))
    seed = draw(st.integers(0, 2**16))
    acc_span = draw(st.sampled_from([2**8, 2**20, 2**31]))
    acc = _codes(draw, (rows, n), max(_I32[0], -acc_span), min(_I32[1], acc_span), seed)
    g = torch.Generator().manual_seed(seed + 1)
    max_m = draw(st.sampled_from([255, 32767, 2**20]))
    return {
        "acc": acc.to(torch.int32),
        "mult": torch.randint(0, max_m + 1, (n,), generator=g),
        "shift": torch.randint(0, draw(st.sampled_from([8, 31, 52])) + 1, (n,), generator=g),
        "bias": torch.randint(-(2 ** draw(st.sampled_from([4, 20, 30]))), 2**20, (n,), generator=g),
        "relu6": torch.randint(0, 128, (n,), generator=g),
        "act": draw(st.sampled_from([None, "relu", "relu6"])),
        "out": draw(st.sampled_from(["qint8", "qint16"])),
        "pad": draw(st.integers(0, 9)),
    }


def _reference(acc: torch.Tensor, c: dict) -> torch.Tensor:
    """The int64 rule (channels last) and the activation clamps, as the converted model applies them."""
    out = requantize(acc.to(torch.int64) + c["bias"], c["mult"], c["shift"], c["out"], axis=-1)
    if c["act"] is not None:
        out = out.clamp(min=0)
    if c["act"] == "relu6":
        out = torch.minimum(out, c["relu6"].to(out.dtype))
    return out


def _params(c: dict, add: tuple[int, int, int] | None = None) -> conv_mod.FusedRequant | None:
    n = int(c["mult"].numel())
    return conv_mod.fused_requant(c["out"], c["act"], c["mult"], c["shift"], c["bias"], c["relu6"], n, add)


@settings(max_examples=150, deadline=None)
@given(c=_requant_case())
def test_requant_rows_equal_the_int64_rule(c: dict) -> None:
    fr = _params(c)
    rows, n = c["acc"].shape
    typical = int(c["mult"].max()) <= 32767 and int(c["shift"].max()) <= 31
    if fr is None:
        # the double path is refused only where its product could exceed 2**53
        assert not typical
        return
    # rows of the accumulator further apart than its channels (the padded _int_mm output)
    padded = torch.zeros(rows, n + c["pad"], dtype=torch.int32)
    padded[:, :n] = c["acc"]
    got = conv_mod.fused_finish(padded[:, :n], None, fr, rows)
    assert torch.equal(got, _reference(c["acc"], c))


@settings(max_examples=100, deadline=None)
@given(c=_requant_case(), data=st.data())
def test_fused_add_rows_equal_the_int64_rule(c: dict, data: st.DataObject) -> None:
    rows, n = c["acc"].shape
    add_dtype = data.draw(st.sampled_from(["qint8", "qint16"]))
    lo, hi = (-128, 127) if add_dtype == "qint8" else (-32768, 32767)
    addend = _codes(data.draw, (rows, n), lo, hi, data.draw(st.integers(0, 999)))
    addend = addend.to(torch.int8 if add_dtype == "qint8" else torch.int16)
    # the rule's ranges: 31-bit multipliers, shifts up to 62, up to 8 extra bits
    g = torch.Generator().manual_seed(int(c["mult"].sum()))
    c["mult"] = torch.randint(0, 2**31, (n,), generator=g)
    c["shift"] = torch.randint(0, 63, (n,), generator=g)
    add = (data.draw(st.integers(0, 2**31 - 1)), data.draw(st.integers(0, 62)), data.draw(st.integers(0, 8)))
    fr = _params(c, add)
    assert fr is not None
    got = conv_mod.fused_finish(c["acc"], addend, fr, rows)
    want = fused_add_int(c["acc"].to(torch.int64) + c["bias"], addend, c["mult"], c["shift"], *add, c["out"], axis=-1)
    if c["act"] is not None:
        want = want.clamp(min=0)
    if c["act"] == "relu6":
        want = torch.minimum(want, c["relu6"].to(want.dtype))
    assert torch.equal(got, want)


def test_rows_split_across_threads_equal_one_thread() -> None:
    g = torch.Generator().manual_seed(0)
    n, rows = 64, 3000  # above the hand-off threshold
    acc = torch.randint(-(2**24), 2**24, (rows, n), generator=g, dtype=torch.int32)
    c = {
        "mult": torch.randint(16384, 32768, (n,), generator=g),
        "shift": torch.randint(20, 28, (n,), generator=g),
        "bias": torch.randint(-1000, 1000, (n,), generator=g),
        "relu6": torch.zeros(n, dtype=torch.int64),
        "act": None,
        "out": "qint8",
    }
    fr = _params(c)
    assert fr is not None
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = conv_mod.fused_finish(acc, None, fr, rows)
        torch.set_num_threads(1)
        one = conv_mod.fused_finish(acc, None, fr, rows)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, two)
    assert torch.equal(one, _reference(acc, c))


def test_bad_accumulator_is_refused_naming_the_layout() -> None:
    c = {
        "mult": torch.tensor([3]),
        "shift": torch.tensor([2]),
        "bias": torch.tensor([0]),
        "relu6": torch.tensor([0]),
        "act": None,
        "out": "qint8",
    }
    fr = _params(c)
    assert fr is not None
    with pytest.raises(ValueError, match="int32"):
        conv_mod.fused_finish(torch.zeros(4, 1, dtype=torch.int64), None, fr, 4)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QIR_NATIVE", "0")
    lib, why = native._build()
    assert lib is None and "QIR_NATIVE=0" in why


def test_torch_paths_without_the_library_stay_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no library (no compiler), every kernel takes its torch path; the artifact is still bit-exact."""
    shape = (8, 1, 28, 28)
    converted = fx_converted(digits_net(), shape, "bayes", batches=2)
    path = tmp_path / "m.hbm"
    compile_model(converted, [torch.randn(*shape)], hbm=path, march="bayes", opt=1, check=False)
    x = torch.randn(64, 1, 28, 28) * 1.5
    with_native = qir.load_compiled(path)
    assert any(getattr(s, "fused", None) is not None for _, _, s, _ in with_native._steps)
    monkeypatch.setattr(native, "library", lambda: None)
    without = qir.load_compiled(path)
    assert all(getattr(s, "fused", None) is None for _, _, s, _ in without._steps)
    with torch.no_grad():
        want = converted(x)
    assert torch.equal(with_native(x), want)
    assert torch.equal(without(x), want)


class _Codes(nn.Module):
    """QuantStub -> depthwise conv -> 1x1 conv + ReLU, no DeQuantStub: the program returns the codes of a
    kernel's reused output buffer."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.pw = nn.Conv2d(c, c, 1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.pw(self.dw(self.quant(x))))


@pytest.mark.parametrize("with_native", [True, False])
def test_outputs_from_reused_buffers_survive_the_next_call(with_native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also the depthwise engine's torch path (float32) when there is no library."""
    shape = (2, 8, 10, 10)
    converted = fx_converted(_Codes(), shape, "bayes", batches=2)
    if not with_native:
        monkeypatch.setattr(native, "library", lambda: None)
    compiled = compile_model(converted, [torch.randn(*shape)], march="bayes", opt=1, check=False)
    assert {i.attrs.get("engine") for i in compiled.program.instructions if i.op == "conv2d"} >= {"dw"}
    g = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    first = compiled(x1)
    second = compiled(x2)
    with torch.no_grad():
        assert torch.equal(first, converted(x1))
        assert torch.equal(second, converted(x2))


@st.composite
def _dw_case(draw: st.DrawFn) -> dict:
    c = draw(st.integers(1, 20))
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, kh)), draw(st.integers(0, kw)))
    h = draw(st.integers(dilation[0] * (kh - 1) + 1 - 2 * padding[0], 14).filter(lambda v: v >= 1))
    w = draw(st.integers(max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1]), 14))
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
        "nhwc": draw(st.booleans()),
    }


@settings(max_examples=100, deadline=None)
@given(c=_dw_case())
def test_depthwise_rows_equal_float64_conv_and_the_int64_rule(c: dict) -> None:
    fr = _params(c)
    assert fr is not None
    x = c["x"].contiguous(memory_format=torch.channels_last) if c["nhwc"] else c["x"]
    attrs = {"stride": list(c["stride"]), "padding": list(c["padding"]), "dilation": list(c["dilation"])}
    w = c["w"][:, 0].permute(1, 2, 0).contiguous()
    got = conv_mod._dw_native(x, w, fr, attrs)
    acc = F.conv2d(c["x"].double(), c["w"].double(), None, c["stride"], c["padding"], c["dilation"], c["x"].shape[1])
    assert torch.equal(got, _reference(acc.to(torch.int64).permute(0, 2, 3, 1), c))


@settings(max_examples=100, deadline=None)
@given(c=_dw_case(), extra=st.sampled_from([0, 8]))
def test_native_im2col_equals_the_strided_copy(c: dict, extra: int) -> None:
    x = c["x"].contiguous(memory_format=torch.channels_last) if c["nhwc"] else c["x"]
    kh, kw = c["w"].shape[2:]
    k = kh * kw * x.shape[1]
    kp = -(-k // 8) * 8 + extra
    geometry = (kh, kw, list(c["stride"]), list(c["padding"]), list(c["dilation"]), kp)
    got, oh, ow = conv_mod._im2col(x, *geometry)
    got = got.clone()  # scratch: the torch path below may hand out the same buffer
    real = native.library
    try:
        native.library = lambda: None  # type: ignore[assignment]
        want, oh2, ow2 = conv_mod._im2col(x, *geometry)
    finally:
        native.library = real  # type: ignore[assignment]
    m = x.shape[0] * oh * ow
    assert (oh, ow) == (oh2, ow2)
    assert torch.equal(got[:m, :k], want[:m, :k])
    assert not bool(got[:, k:].any()) and not bool(got[m:].any())  # the padding _int_mm reads stays zero
