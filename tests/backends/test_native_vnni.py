"""The native int8 conv / matrix product with the requantization fused (native.c ``qir_conv_vnni``,
``qir_gemm_vnni``, AVX-512 VNNI builds only) and the native max pool, against independent
references: float64 conv / matmul (exact at these sizes) followed by the int64 rules, and torch's
max pool in float32. Shapes cover the kernel's tails (output channels not a multiple of 16 or 64,
pixel counts not a multiple of its 6-row tiles, reductions over one 256-byte slice) and codes at
the extremes, where the a + 128 flip and its correction would show."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.common.integer_rules import fused_add_int
from backends.common.kernels import conv as conv_mod
from backends.common.kernels import native
from backends.common.kernels import pool as pool_mod
from backends.common.program import Instruction
from qir.ir.numerics import requantize

needs_lib = pytest.mark.skipif(native.library() is None, reason=f"native kernels unavailable: {native.status()}")
needs_vnni = pytest.mark.skipif(not native.has_vnni(), reason="the CPU or the build has no AVX-512 VNNI")


def _codes(mode: str, shape: tuple[int, ...], lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    if mode == "lo":
        return torch.full(shape, lo, dtype=torch.int64)
    if mode == "hi":
        return torch.full(shape, hi, dtype=torch.int64)
    t = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64)
    if mode == "mixed":
        t = torch.where(torch.rand(shape, generator=g) < 0.5, torch.full_like(t, lo), torch.full_like(t, hi))
    return t


def _state(w: torch.Tensor, c: dict[str, Any]) -> conv_mod.ConvState:
    """What ``conv.py``'s prepare builds for an int_mm conv / linear with the native product."""
    c_out = int(w.shape[0])
    k = int(w[0].numel())
    flat = w.permute(0, 2, 3, 1).reshape(c_out, k) if w.dim() == 4 else w.reshape(c_out, k)
    kp = -(-k // 8) * 8
    fr = conv_mod.fused_requant(c["out"], c["act"], c["mult"], c["shift"], c["bias"], c["relu6"], c_out, c["add"])
    assert fr is not None
    return conv_mod.ConvState(
        weight=torch.zeros(kp, c_out, dtype=torch.int8),
        bias=c["bias"],
        rq=conv_mod.RequantF64(c["mult"], c["shift"]),
        relu6_bound=c["relu6"],
        add_rq=None,
        chunks=[],
        bias_half=torch.zeros(c_out, dtype=torch.float64),
        k=k,
        n=c_out,
        fused=fr,
        vnni=native.pack_vnni(flat.t(), kp),
    )


def _reference(acc: torch.Tensor, addend: torch.Tensor | None, c: dict[str, Any]) -> torch.Tensor:
    """The int64 rules on an exact (rows..., C) accumulator: requantization or the fused add, then the clamps."""
    acc = acc.to(torch.int64) + c["bias"]
    if c["add"] is None:
        out = requantize(acc, c["mult"], c["shift"], c["out"], axis=-1)
    else:
        assert addend is not None
        out = fused_add_int(acc, addend, c["mult"], c["shift"], *c["add"], c["out"], axis=-1)
    if c["act"] is not None:
        out = out.clamp(min=0)
    if c["act"] == "relu6":
        out = torch.minimum(out, c["relu6"].to(out.dtype))
    return out


@st.composite
def _params(draw: st.DrawFn, c_out: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    add = None
    # the fused add's step onto its intermediate grid takes 31-bit multipliers and shifts up to 62 (the rule's
    # range; both modes of the packed requantization), the plain requantization the marches' 15 bits and 31
    wide = draw(st.booleans())
    if wide:
        add = (draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 62)), draw(st.integers(0, 8)))
    return {
        "mult": torch.randint(0, 2**31 if wide else 32768, (c_out,), generator=g),
        "shift": torch.randint(
            draw(st.sampled_from([0, 20, 32])) if wide else 0, 63 if wide else 32, (c_out,), generator=g
        ),
        "bias": torch.randint(-(2**20), 2**20, (c_out,), generator=g),
        "relu6": torch.randint(0, 128, (c_out,), generator=g),
        "act": draw(st.sampled_from([None, "relu", "relu6"])),
        "out": draw(st.sampled_from(["qint8", "qint16"])),
        "add": add,
        "add_dtype": draw(st.sampled_from([torch.int8, torch.int16])),
        "seed": draw(st.integers(0, 2**16)),
        "mode": draw(st.sampled_from(["random", "random", "lo", "hi", "mixed"])),
    }


@st.composite
def _conv_case(draw: st.DrawFn) -> dict[str, Any]:
    c_in = draw(st.sampled_from([1, 3, 4, 7, 16, 33, 70]))
    c_out = draw(st.sampled_from([1, 5, 16, 24, 63, 64, 65, 130]))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    stride = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    dilation = [draw(st.integers(1, 2)), draw(st.integers(1, 2))]
    padding = [draw(st.integers(0, kh)), draw(st.integers(0, kw))]
    h = draw(st.integers(max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0]), 12))
    w = draw(st.integers(max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1]), 12))
    c = draw(_params(c_out))
    c.update(
        shape=(draw(st.integers(1, 3)), c_in, h, w),
        weight=(c_out, c_in, kh, kw),
        stride=stride,
        padding=padding,
        dilation=dilation,
        nhwc=draw(st.booleans()),
    )
    return c


@needs_vnni
@settings(max_examples=120, deadline=None)
@given(c=_conv_case())
def test_native_conv_equals_float64_conv_and_the_int64_rules(c: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(c["seed"])
    x = _codes(c["mode"], c["shape"], -128, 127, g).to(torch.int8)
    w = _codes(c["mode"], c["weight"], -128, 127, g).to(torch.int8)
    if c["nhwc"]:
        x = x.contiguous(memory_format=torch.channels_last)
    st_ = _state(w, c)
    attrs = {"kernel_size": list(w.shape[2:]), "stride": c["stride"], "padding": c["padding"]}
    attrs["dilation"] = c["dilation"]
    acc = F.conv2d(x.double(), w.double(), None, c["stride"], c["padding"], c["dilation"]).permute(0, 2, 3, 1)
    addend = None
    if c["add"] is not None:
        lo, hi = (-128, 127) if c["add_dtype"] == torch.int8 else (-32768, 32767)
        addend = _codes(c["mode"], tuple(acc.shape), lo, hi, g).to(c["add_dtype"])
    got = conv_mod._conv_vnni(x, st_, attrs, addend)
    assert torch.equal(got, _reference(acc.to(torch.int64), addend, c))


@needs_vnni
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    k=st.sampled_from([1, 8, 20, 256, 264, 600]),
    n=st.sampled_from([1, 10, 16, 70]),
    data=st.data(),
)
def test_native_matrix_product_equals_the_int64_rules(rows: int, k: int, n: int, data: st.DataObject) -> None:
    """The product on rows of codes in place (1x1 convs, linear): rows further apart than the
    reduction (a padded buffer) and reductions longer than one 256-byte slice."""
    c = data.draw(_params(n))
    g = torch.Generator().manual_seed(c["seed"])
    w = _codes(c["mode"], (n, k), -128, 127, g).to(torch.int8)
    st_ = _state(w, c)
    kp = int(st_.weight.shape[0])
    a = torch.zeros(rows + 3, kp + 8, dtype=torch.int8)
    a[:rows, :k] = _codes(c["mode"], (rows, k), -128, 127, g).to(torch.int8)
    acc = a[:rows, :k].double() @ w.double().t()
    addend = None
    if c["add"] is not None:
        addend = _codes(c["mode"], (rows, n), -128, 127, g).to(torch.int8)
    out = torch.empty(rows, n, dtype=st_.fused.out_dtype if st_.fused else torch.int8)
    got = conv_mod._gemm_vnni(a, rows, st_, addend, out)
    assert torch.equal(got, _reference(acc.to(torch.int64), addend, c))


@needs_vnni
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    k=st.sampled_from([8, 264, 600]),
    n=st.sampled_from([17, 70, 1000]),
    threads=st.sampled_from([2, 3]),
    data=st.data(),
)
def test_few_rows_split_by_output_channels(rows: int, k: int, n: int, threads: int, data: st.DataObject) -> None:
    """Fewer rows than one register tile (a batch-1 linear) split by panels of 16 output channels
    (``qir_gemm_vnni_cols``), every call split however small: the codes of the int64 rules, with the
    plain requantization and the fused add (int8 and int16 addends), output channels not a multiple of 16."""
    c = data.draw(_params(n))
    g = torch.Generator().manual_seed(c["seed"])
    w = _codes(c["mode"], (n, k), -128, 127, g).to(torch.int8)
    st_ = _state(w, c)
    kp = int(st_.weight.shape[0])
    a = torch.zeros(rows + 1, kp + 8, dtype=torch.int8)
    a[:rows, :k] = _codes(c["mode"], (rows, k), -128, 127, g).to(torch.int8)
    acc = a[:rows, :k].double() @ w.double().t()
    addend = None
    if c["add"] is not None:
        lo, hi = (-128, 127) if c["add_dtype"] == torch.int8 else (-32768, 32767)
        addend = _codes(c["mode"], (rows, n), lo, hi, g).to(c["add_dtype"])
    out = torch.empty(rows, n, dtype=st_.fused.out_dtype if st_.fused else torch.int8)
    split_min = native._SPLIT_MIN
    native._SPLIT_MIN = 0  # split every call (hypothesis runs the examples without function fixtures)
    try:
        with native.using_threads(threads):
            call, keep = conv_mod._gemm_call(a, rows, st_, addend, out)
            assert call.name == "qir_gemm_vnni_cols"
            assert call() == 0
    finally:
        native._SPLIT_MIN = split_min
    del keep
    assert torch.equal(out, _reference(acc.to(torch.int64), addend, c))


@needs_vnni
def test_threads_split_the_pixels_and_agree_with_one_thread() -> None:
    g = torch.Generator().manual_seed(1)
    c = {
        "mult": torch.randint(16384, 32768, (40,), generator=g),
        "shift": torch.randint(18, 26, (40,), generator=g),
        "bias": torch.randint(-1000, 1000, (40,), generator=g),
        "relu6": torch.zeros(40, dtype=torch.int64),
        "act": "relu",
        "out": "qint8",
        "add": None,
    }
    x = torch.randint(-128, 128, (2, 24, 30, 30), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (40, 24, 3, 3), generator=g, dtype=torch.int8)
    st_ = _state(w, c)
    attrs = {"kernel_size": [3, 3], "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1]}
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = conv_mod._conv_vnni(x, st_, attrs, None).clone()
        torch.set_num_threads(1)
        one = conv_mod._conv_vnni(x, st_, attrs, None).clone()
    finally:
        torch.set_num_threads(prev)
    acc = F.conv2d(x.double(), w.double(), None, 1, 1).permute(0, 2, 3, 1).to(torch.int64)
    assert torch.equal(one, two)
    assert torch.equal(one, _reference(acc, None, c))


@needs_vnni
def test_native_conv_refuses_inputs_that_do_not_fit_the_layer() -> None:
    c = {
        "mult": torch.tensor([3] * 8),
        "shift": torch.tensor([2] * 8),
        "bias": torch.zeros(8, dtype=torch.int64),
        "relu6": torch.zeros(8, dtype=torch.int64),
        "act": None,
        "out": "qint8",
        "add": None,
    }
    st_ = _state(torch.ones(8, 4, 3, 3, dtype=torch.int8), c)
    attrs = {"kernel_size": [3, 3], "stride": [1, 1], "padding": [0, 0], "dilation": [1, 1]}
    with pytest.raises(ValueError, match="5 channels, the layer 4"):
        conv_mod._conv_vnni(torch.zeros(1, 5, 8, 8, dtype=torch.int8), st_, attrs, None)
    with pytest.raises(TypeError, match="int8"):
        conv_mod._conv_vnni(torch.zeros(1, 4, 8, 8, dtype=torch.int16), st_, attrs, None)
    with pytest.raises(ValueError, match="smaller than the 3x3"):
        conv_mod._conv_vnni(torch.zeros(1, 4, 2, 8, dtype=torch.int8), st_, attrs, None)
    with pytest.raises(ValueError, match="columns must be int8"):
        conv_mod._gemm_vnni(torch.zeros(4, 8, dtype=torch.int8), 4, st_, None, torch.empty(4, 8, dtype=torch.int8))


@needs_lib
@settings(max_examples=100, deadline=None)
@given(
    c=st.integers(1, 20),
    k=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    s=st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3))),
    ceil=st.booleans(),
    dtype=st.sampled_from([torch.int8, torch.int16]),
    data=st.data(),
)
def test_native_maxpool_equals_the_float_path(
    c: int, k: tuple[int, int], s: tuple[int, int] | None, ceil: bool, dtype: torch.dtype, data: st.DataObject
) -> None:
    pad = [data.draw(st.integers(0, k[0] // 2)), data.draw(st.integers(0, k[1] // 2))]
    h, w = data.draw(st.integers(k[0], 13)), data.draw(st.integers(k[1], 13))
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    x = torch.randint(info.min, info.max + 1, (data.draw(st.integers(1, 3)), c, h, w), generator=g).to(dtype)
    if data.draw(st.booleans()):
        x = x.contiguous(memory_format=torch.channels_last)
    attrs = {"kernel_size": list(k), "stride": None if s is None else list(s), "padding": pad}
    attrs.update(dilation=[1, 1], ceil_mode=ceil)
    inst = Instruction("maxpool2d", ("x",), ("y",), attrs)
    got = pool_mod.maxpool2d(inst, [x], None)[0]
    want = F.max_pool2d(x.float(), list(k), None if s is None else list(s), pad, 1, ceil).to(dtype)
    assert pool_mod._maxpool_native(x, attrs) is not None
    assert got.shape == want.shape and torch.equal(got, want)


@needs_lib
@settings(max_examples=80, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 9), st.integers(1, 9)),
    scale=st.sampled_from([0.0078125, 0.01, 0.1, 1 / 3, 3.7, 1e-6]),
    dtype=st.sampled_from(["qint8", "qint16"]),
    kind=st.sampled_from(["normal", "ties", "huge", "channels_last", "nan", "inf"]),
    seed=st.integers(0, 999),
)
def test_native_quantize_equals_the_torch_rule(
    shape: tuple[int, int, int, int], scale: float, dtype: str, kind: str, seed: int
) -> None:
    """Ties at k + 1/2 (half up), saturation, any memory format; a NaN / Inf input goes to the torch path."""
    from backends.common.kernels import quant as quant_mod

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    if kind == "ties":
        x = (torch.randint(-300, 300, shape, generator=g) + 0.5) * torch.tensor(scale, dtype=torch.float32)
    elif kind == "huge":
        x = x * 1e6
    elif kind == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif kind in ("nan", "inf"):
        x.view(-1)[seed % x.numel()] = float(kind)
    inst = Instruction("quantize", ("x",), ("q",), {"scale": scale, "dtype": dtype})
    got = quant_mod.quantize(inst, [x], None)[0]
    real = native.library
    try:
        native.library = lambda: None  # type: ignore[assignment]
        want = quant_mod.quantize(inst, [x], None)[0]
    finally:
        native.library = real  # type: ignore[assignment]
    assert (quant_mod._quantize_native(x, scale, dtype) is None) == (kind in ("nan", "inf"))
    assert got.dtype == want.dtype and torch.equal(got, want)


@needs_vnni
def test_a_reused_epilogue_follows_the_addend_and_the_batch() -> None:
    """The layer keeps its last native epilogue; a new addend tensor or batch size rebuilds it."""
    g = torch.Generator().manual_seed(5)
    c = {
        "mult": torch.randint(16384, 32768, (20,), generator=g),
        "shift": torch.randint(18, 26, (20,), generator=g),
        "bias": torch.randint(-1000, 1000, (20,), generator=g),
        "relu6": torch.zeros(20, dtype=torch.int64),
        "act": None,
        "out": "qint8",
        "add": (20000, 14, 1),
    }
    w = torch.randint(-128, 128, (20, 6, 3, 3), generator=g, dtype=torch.int8)
    st_ = _state(w, c)
    attrs = {"kernel_size": [3, 3], "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1]}
    for nb in (2, 2, 3):
        x = torch.randint(-128, 128, (nb, 6, 9, 9), generator=g, dtype=torch.int8)
        addend = torch.randint(-128, 128, (nb, 9, 9, 20), generator=g, dtype=torch.int8)
        got = conv_mod._conv_vnni(x, st_, attrs, addend).clone()
        acc = F.conv2d(x.double(), w.double(), None, 1, 1).permute(0, 2, 3, 1).to(torch.int64)
        assert torch.equal(got, _reference(acc, addend, c))


@needs_vnni
@pytest.mark.parametrize("kernel", [3, 1])
def test_a_repeated_call_reuses_its_packed_call_only_for_the_same_places(kernel: int) -> None:
    """A conv called again on the same NHWC input and addend tensors repeats its packed native call
    (what a compiled model does call after call); new contents in place give their own codes, and a
    new input or addend tensor, another batch size in between, or an NCHW input (copied on each
    call) build a new call: every result equals the int64 rules."""
    g = torch.Generator().manual_seed(6)
    c = {
        "mult": torch.randint(16384, 32768, (20,), generator=g),
        "shift": torch.randint(18, 26, (20,), generator=g),
        "bias": torch.randint(-1000, 1000, (20,), generator=g),
        "relu6": torch.zeros(20, dtype=torch.int64),
        "act": "relu",
        "out": "qint8",
        "add": (20000, 14, 1),
    }
    w = torch.randint(-128, 128, (20, 8, kernel, kernel), generator=g, dtype=torch.int8)
    st_ = _state(w, c)
    pad = kernel // 2
    attrs = {"kernel_size": [kernel, kernel], "stride": [1, 1], "padding": [pad, pad], "dilation": [1, 1]}

    def codes(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)

    def check(x: torch.Tensor, addend: torch.Tensor) -> None:
        got = conv_mod._conv_vnni(x, st_, attrs, addend).clone()
        acc = F.conv2d(x.double(), w.double(), None, 1, pad).permute(0, 2, 3, 1).to(torch.int64)
        assert torch.equal(got, _reference(acc, addend, c))

    x = codes((2, 8, 7, 9)).contiguous(memory_format=torch.channels_last)
    addend = codes((2, 7, 9, 20))
    check(x, addend)
    first = st_.last_call
    assert first is not None
    check(x, addend)
    assert st_.last_call is first  # repeated, not rebuilt
    x.copy_(codes(tuple(x.shape)))  # new contents in place
    addend.copy_(codes(tuple(addend.shape)))
    check(x, addend)
    assert st_.last_call is first
    check(x.clone(memory_format=torch.channels_last), addend)  # another input tensor
    assert st_.last_call is not first
    second = st_.last_call
    check(x, addend.clone())  # another addend tensor
    assert st_.last_call is not second
    check(codes((3, 8, 7, 9)).contiguous(memory_format=torch.channels_last), codes((3, 7, 9, 20)))
    check(x, addend)  # back to the first batch size: the output buffer was replaced in between
    nchw = codes((2, 8, 7, 9))
    check(nchw, addend)
    assert st_.last_call is None  # an input copied to NHWC on each call is never repeated


@needs_vnni
@pytest.mark.parametrize(
    ("c_in", "k", "stride", "padding", "dilation"),
    [
        (3, (7, 7), [2, 2], [3, 3], [1, 1]),  # a stem: window rows of 21 codes
        (16, (3, 4), [1, 2], [1, 2], [2, 1]),  # window rows of exactly 64 codes, dilated rows
        (22, (2, 3), [1, 1], [0, 1], [1, 1]),  # 66 codes: the general path
        (3, (5, 5), [1, 1], [0, 0], [1, 2]),  # dilated columns: the general path
    ],
)
def test_interior_windows_copy_whole_rows(
    c_in: int, k: tuple[int, int], stride: list[int], padding: list[int], dilation: list[int]
) -> None:
    """im2col's one-copy-per-row path for windows inside the input (rows of at most 64 codes) and the
    per-row clipping at the borders give the reference codes together, at 1 and 3 threads."""
    g = torch.Generator().manual_seed(sum(k) + c_in)
    c = {
        "mult": torch.randint(16384, 32768, (24,), generator=g),
        "shift": torch.randint(18, 26, (24,), generator=g),
        "bias": torch.randint(-1000, 1000, (24,), generator=g),
        "relu6": torch.zeros(24, dtype=torch.int64),
        "act": None,
        "out": "qint8",
        "add": None,
    }
    x = torch.randint(-128, 128, (2, c_in, 29, 31), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (24, c_in, *k), generator=g, dtype=torch.int8)
    attrs = {"kernel_size": list(k), "stride": stride, "padding": padding, "dilation": dilation}
    acc = F.conv2d(x.double(), w.double(), None, stride, padding, dilation).permute(0, 2, 3, 1).to(torch.int64)
    want = _reference(acc, None, c)
    for nt in (1, 3):
        with native.using_threads(nt):
            got = conv_mod._conv_vnni(x, _state(w, c), attrs, None)
        assert torch.equal(got, want), nt
