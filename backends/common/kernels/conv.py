"""Convolution and linear kernels: exact int32/int64 accumulators from one of several engines,
then bias, requantization (optionally fused with an add), and the ReLU / ReLU6 clamp.

Engines (chosen per layer by the lowering, docs/backends.md "Kernel choices"):

* ``int_mm`` / ``int_mm_t``: int8 im2col (NHWC, K padded to a multiple of 8) times the
  int8 weight with int32 accumulation (exact while |acc| < 2**31): on CPUs with AVX-512 VNNI
  the native product with the requantization fused (``native.c`` ``qir_gemm_vnni``), else
  ``torch._int_mm`` (``_t`` keeps the weight column-major) then one native requantization pass.
* ``dw``: depthwise conv (one int8 filter per channel) with int32 accumulation and the
  requantization fused, one native pass (``native.c``); without the native library, float32
  (exact: the lowering offers it only for ``kh * kw <= 1024``, so every sum stays below 2**24).
* ``f32``: float32 conv / linear; exact while every partial sum stays below 2**24, which
  the lowering proves per layer from ``max|x| * max_c sum|w_c|``.
* ``f32_chunked``: float32 over input-channel chunks that each keep that bound, summed in float64.
* ``f64``: float64 (exact below 2**53); the fallback for anything.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from backends.common.kernels import native
from backends.common.kernels.base import RequantF64, qbounds, register_kernel, requant_i64, sat_to, scratch
from backends.common.kernels.conv_shape import conv2d_shape, conv_nd_shape, conv_work, linear_shape
from backends.common.kernels.native import Call
from backends.common.kernels.requant_pack import BLOCK_INT64, pack_requant
from backends.common.kernels.schema import (
    INT_DTYPES,
    MAX_EXTENT,
    OUT_DTYPE,
    Attr,
    Const,
    KernelSchema,
    boolean,
    integer,
    ints,
    one_of,
)
from backends.common.program import Instruction

__all__ = ["ConvState", "FusedRequant", "conv_engines", "fused_finish", "fused_requant", "linear_engines"]

_CODE_DTYPES = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}
CONV2D_ENGINES = ("dw", "int_mm", "int_mm_t", "f32", "f32_chunked", "f64")
LINEAR_ENGINES = ("int_mm", "f32", "f64")


def conv_engines() -> tuple[str, ...]:
    return CONV2D_ENGINES


def linear_engines() -> tuple[str, ...]:
    return LINEAR_ENGINES


@dataclass
class ConvState:
    """What a conv / linear instruction needs at run time (built once by ``prepare``)."""

    weight: torch.Tensor  # engine layout
    bias: torch.Tensor  # float64 (C,), or int64 for the i64 path
    rq: RequantF64
    relu6_bound: torch.Tensor
    add_rq: RequantF64 | None
    chunks: list[tuple[int, int, torch.Tensor]]
    bias_half: torch.Tensor  # float64 per channel: bias * M/2**s + half/2**s (exact: integers < 2**53, scaled)
    k: int  # unpadded reduction length (int_mm)
    n: int  # output channels
    fused: FusedRequant | None = None  # the one-pass native requantization, where it applies
    vnni: tuple[torch.Tensor, torch.Tensor] | None = None  # native.pack_vnni's panels and column sums
    dw_pack: tuple[torch.Tensor, torch.Tensor] | None = None  # native.pack_dw's weights and compensation
    epilogue: tuple[tuple[Any, ...], Any] | None = None  # the last native.Epilogue and what it was built for
    native: bool = False  # every call runs in the native library (the runtime's thread policy reads it)
    # the last native product call, (key, call, result) with key = _call_key(...): repeated as it is
    # while its input and addend are the same tensors' layout and place (every call of a compiled model)
    last_call: tuple[Any, Call, torch.Tensor] | None = None
    spaces: dict[tuple[int, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    outs: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(default_factory=dict)

    def output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This instruction's output buffer, reused from call to call (the value of the previous call
        is dead by then: the runtime copies any program output that lives in one, see ``owned_buffers``)."""
        key = (tuple(shape), dtype)
        buf = self.outs.get(key)
        if buf is None:
            self.outs.clear()  # one shape at a time: a new batch size replaces the old buffer
            buf = self.outs[key] = torch.empty(shape, dtype=dtype)
        return buf

    def owned_buffers(self) -> list[torch.Tensor]:
        return list(self.outs.values())

    def workspace(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """A float64 buffer shaped like ``like``, kept between calls: large fresh allocations are
        page-faulted in on every call, which cost more than the arithmetic itself."""
        key = (slot, tuple(like.shape))
        ws = self.spaces.get(key)
        if ws is None:
            ws = self.spaces[key] = torch.empty(like.shape, dtype=torch.float64)
        return ws.copy_(like)


@dataclass
class FusedRequant:
    """Per-channel parameters of the native one-pass requantization (``native.c``).

    Plain requantization runs in integer arithmetic on ``rq`` (``requant_pack.pack_requant``: the
    multiplier, shift, bias and half-up rounding, with the saturation and the activation clamp as
    one per-channel range, per block of 16 channels) in the mode ``fast`` names; exact for every
    int32 accumulator. The fused add runs in int64 (``bias``, ``mult``, ``half``, ``shift``,
    ``lo_i``, ``hi_i``), as the rule does.
    """

    rq: torch.Tensor  # int64, ceil(n / 16) * BLOCK_INT64 (native_requant.h's qir_rqblock)
    fast: bool
    bias: torch.Tensor  # int64 per channel (also the fused add's parameters)
    mult: torch.Tensor
    half: torch.Tensor
    shift: torch.Tensor
    lo_i: torch.Tensor
    hi_i: torch.Tensor
    out_dtype: torch.dtype
    add: tuple[int, int, int, int] | None  # (multiplier, half, shift, extra_bits) of the fused add
    lib: Any  # the loaded native library (ctypes.CDLL)
    # the fused add's two requantizations onto its intermediate grid, packed as rq with the int32 range as
    # their clamp (the accumulator's per channel; the addend's in one block of 16 equal lanes), and their modes
    add_packs: tuple[torch.Tensor, bool, torch.Tensor, bool] | None = None

    def __post_init__(self) -> None:
        # the C loops index every per-channel array with c < n: checked once here, not on every call
        n = self.n
        arrays = (self.bias, self.half, self.shift, self.lo_i, self.hi_i)
        if not all(t.is_contiguous() and t.numel() == n for t in (self.mult, *arrays)):
            raise ValueError(f"native requantization: every per-channel array must be contiguous with {n} entries")
        blocks = -(-n // 16)  # the C loops read whole blocks of 16 channels' parameters
        if not (self.rq.is_contiguous() and self.rq.dtype == torch.int64 and self.rq.numel() == blocks * BLOCK_INT64):
            raise ValueError(f"native requantization: the packed parameters must hold {blocks} blocks")
        if self.add_packs is not None:
            rq_mid, _, rq_add, _ = self.add_packs  # the fused add's: one block per 16 channels, and one block
            if not (rq_mid.numel() == blocks * BLOCK_INT64 and rq_add.numel() == BLOCK_INT64):
                raise ValueError(f"fused add: the packed requantizations must hold {blocks} blocks and 1 block")

    @property
    def n(self) -> int:
        return int(self.mult.numel())


def _per_channel(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.to(torch.int64).reshape(-1)
    return (t.expand(n) if t.numel() == 1 else t).contiguous()


def _half(shift: torch.Tensor) -> torch.Tensor:
    return torch.where(shift > 0, torch.ones_like(shift) << (shift - 1).clamp(min=0), torch.zeros_like(shift))


def fused_requant(
    out_dtype: str,
    act: str | None,
    multiplier: torch.Tensor,
    shift: torch.Tensor,
    bias: torch.Tensor,
    relu6_bound: torch.Tensor,
    n: int,
    add: tuple[int, int, int] | None = None,
) -> FusedRequant | None:
    """The native requantization's parameters, or None where it does not apply (no library, qint32
    output, multipliers outside [0, 2**31), shifts outside 0..62, biases outside int32); ``add``: the
    fused add's ``(multiplier, shift, extra_bits)``."""
    lib = native.library()
    if out_dtype not in ("qint8", "qint16") or lib is None:
        return None
    s = _per_channel(shift, n)
    m = _per_channel(multiplier, n)
    b = _per_channel(bias, n)
    # int64 shifts take up to 62; an int32 bias keeps b * M + 2**(s-1) inside int64
    if int(s.min()) < 0 or int(s.max()) > 62 or int(m.min()) < 0 or int(m.max()) >= 2**31:
        return None
    if int(b.min()) < -(2**31) or int(b.max()) >= 2**31:
        return None
    lo, hi = qbounds(out_dtype)
    if act is not None:
        lo = max(lo, 0)
    hi_t = torch.full((n,), hi, dtype=torch.int64)
    if act == "relu6":
        hi_t = torch.minimum(hi_t, _per_channel(relu6_bound, n))
        if bool((hi_t < lo).any()):
            return None  # min(clamp(v), bound) is one range only while the bound is above the lower end
    half = _half(s)
    fused_add = None
    add_packs: tuple[torch.Tensor, bool, torch.Tensor, bool] | None = None
    if add is not None:
        am, ash, p = add
        if not (0 <= ash <= 62 and 0 <= p <= 62 and 0 <= am < 2**31):
            return None
        fused_add = (am, (1 << ash) >> 1, ash, p)
        i32 = (torch.full((n,), -(2**31)), torch.full((n,), 2**31 - 1))
        rq_mid, fast_mid = pack_requant(m, s, b, *i32)
        one = torch.ones(16, dtype=torch.int64)
        rq_add, fast_add = pack_requant(one * am, one * ash, one * 0, one * -(2**31), one * (2**31 - 1))
        add_packs = (rq_mid, fast_mid, rq_add, fast_add)
    lo_t = torch.full((n,), lo, dtype=torch.int64)
    rq, fast = pack_requant(m, s, b, lo_t, hi_t)
    return FusedRequant(
        rq=rq,
        fast=fast,
        bias=b,
        mult=m,
        half=half,
        shift=s,
        lo_i=lo_t,
        hi_i=hi_t.contiguous(),
        out_dtype=_CODE_DTYPES[out_dtype],
        add=fused_add,
        lib=lib,
        add_packs=add_packs,
    )


def _fused_requant(inst: Instruction, consts: Mapping[str, torch.Tensor], n: int) -> FusedRequant | None:
    a = inst.attrs
    add = (int(a["add_multiplier"]), int(a["add_shift"]), int(a["extra_bits"])) if a.get("has_add") else None
    c = inst.consts
    return fused_requant(
        str(a["out_dtype"]),
        a.get("act"),
        consts[c["multiplier"]],
        consts[c["shift"]],
        consts[c["bias"]],
        consts[c["relu6_bound"]],
        n,
        add,
    )


def fused_finish(
    acc: torch.Tensor, addend: torch.Tensor | None, fr: FusedRequant, rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Requantize the int32 ``acc`` (first ``rows`` rows; channels contiguous, rows ``acc.stride(0)``
    apart) in one native pass; ``addend``: the fused add's other operand, (rows, C); ``out``: where
    to write the (rows, C) codes (a fresh tensor when None)."""
    n = fr.n
    if acc.dtype != torch.int32 or acc.dim() != 2 or acc.shape[1] != n or acc.stride(1) != 1 or acc.shape[0] < rows:
        raise ValueError(
            f"native requantization takes int32 ({rows}, {n}) with contiguous channels, "
            f"got {acc.dtype} {tuple(acc.shape)}"
        )
    # every per-channel array holds n values (FusedRequant checks it when built)
    if out is None:
        out = torch.empty((rows, n), dtype=fr.out_dtype)
    if out.shape != (rows, n) or out.dtype != fr.out_dtype or not out.is_contiguous():
        raise ValueError(f"native requantization: output must be contiguous {fr.out_dtype} ({rows}, {n})")
    tag = "i8" if fr.out_dtype == torch.int8 else "i16"
    p = native.ptr
    lda = int(acc.stride(0))
    if fr.add is None:
        name = f"qir_requant_rows_{tag}"
        args: tuple[int, ...] = (p(acc), lda, n, p(fr.rq), int(fr.fast))
    else:
        if addend is None or addend.dtype not in (torch.int8, torch.int16):
            raise TypeError(f"fused add: addend codes must be int8 or int16, got {getattr(addend, 'dtype', None)}")
        addend = addend.reshape(rows, n).contiguous()
        atag = "i8" if addend.dtype == torch.int8 else "i16"
        name = f"qir_fused_add_rows_{atag}_{tag}"
        am, ah, ash, ep = fr.add
        args = (p(acc), lda, n, p(addend), p(fr.bias), p(fr.mult), p(fr.half), p(fr.shift), am, ah, ash, ep)
        args = (*args, p(fr.lo_i), p(fr.hi_i))
    native.run(name, (*args, p(out)), rows, rows * n)
    return out


def _prepare(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> ConvState:
    a = inst.attrs
    w = consts[inst.consts["weight"]]
    engine = str(a["engine"])
    c_out = int(w.shape[0]) if a["kind"] != "conv_transpose2d" else int(consts[inst.consts["bias"]].numel())
    k = int(w[0].numel())
    chunks: list[tuple[int, int, torch.Tensor]] = []
    if engine == "dw":
        # (KH, KW, C) for the native loop; the float32 (C, 1, KH, KW) filter for the torch path
        weight = w[:, 0].permute(1, 2, 0).contiguous()
        chunks = [(0, c_out, w.to(torch.float32))]
    elif engine in ("int_mm", "int_mm_t"):
        # (K, N) int8 with K = kh*kw*C (NHWC order) and K, N padded to multiples of 8 (torch._int_mm)
        flat = w.permute(0, 2, 3, 1).reshape(c_out, k) if w.dim() == 4 else w.reshape(c_out, k)
        kp, np_ = -(-k // 8) * 8, -(-c_out // 8) * 8
        wt = torch.zeros(kp, np_, dtype=torch.int8)
        wt[:k, :c_out] = flat.t()
        weight = wt.t().contiguous().t() if engine == "int_mm_t" else wt.contiguous()
    elif engine == "f32":
        weight = w.to(torch.float32)
    elif engine == "f32_chunked":
        weight = w.to(torch.float32)
        chunks = [(int(c0), int(c1), weight[:, int(c0) : int(c1)].contiguous()) for c0, c1 in a["chunks"]]
    elif engine == "f64":
        weight = w.to(torch.float64)
    else:
        raise ValueError(f"{inst.op} ({inst.source}): unknown engine '{engine}'")
    bias = consts[inst.consts["bias"]].to(torch.int64).reshape(-1)
    add_rq = None
    if a.get("has_add"):
        add_rq = RequantF64(torch.tensor(int(a["add_multiplier"])), torch.tensor(int(a["add_shift"])))
    rq = RequantF64(consts[inst.consts["multiplier"]], consts[inst.consts["shift"]])
    scale, half = (rq.scale, rq.half) if rq.scale.numel() == c_out else (rq.scale.expand(c_out), rq.half.expand(c_out))
    fused = _fused_requant(inst, consts, c_out) if engine in ("dw", "int_mm", "int_mm_t") else None
    vnni = None
    if fused is not None and engine in ("int_mm", "int_mm_t") and native.has_vnni():
        vnni = native.pack_vnni(weight[:k, :c_out], int(weight.shape[0]))
    dw_pack = native.pack_dw(weight) if fused is not None and engine == "dw" and native.has_vnni() else None
    return ConvState(
        weight=weight,
        bias=bias.to(torch.float64) if a.get("requant", "f64") == "f64" else bias,
        rq=rq,
        bias_half=torch.addcmul(half, bias.to(torch.float64), scale),
        relu6_bound=consts[inst.consts["relu6_bound"]].to(torch.int64).reshape(-1),
        add_rq=add_rq,
        chunks=chunks,
        k=k,
        n=c_out,
        fused=fused,
        vnni=vnni,
        dw_pack=dw_pack,
        native=fused is not None and (engine == "dw" or vnni is not None),
    )


# ----------------------------------------------------------------------------- accumulators


def _im2col(
    x: torch.Tensor, kh: int, kw: int, stride: list[int], padding: list[int], dilation: list[int], kp: int
) -> tuple[torch.Tensor, int, int]:
    """int8 (N*OH*OW, kp) columns in (kh, kw, C) order from NCHW ``x`` (any memory format)."""
    n, c, h, w = x.shape
    ph, pw = padding
    sh, sw = stride
    dh, dw = dilation
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    k, m = kh * kw * c, n * oh * ow
    if k > kp or oh < 1 or ow < 1:
        raise ValueError(
            f"conv input of shape {tuple(x.shape)} does not fit the layer ({kh}x{kw} kernel over at most "
            f"{kp // (kh * kw)} input channels): pass the input shape the model was compiled for"
        )
    copy_free = kh == kw == 1 and sh == sw == 1 and not (ph or pw) and kp == k and m > 16
    if native.library() is not None and x.dtype == torch.int8 and not copy_free:
        # one pass from NHWC codes into the columns, padding included (no zero-padded copy of x)
        xh = x.permute(0, 2, 3, 1).contiguous()
        cols = scratch(("im2col", k, m), (max(m, 17), kp), x.dtype)
        p = native.ptr
        args = (p(xh), h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, p(cols), kp)
        native.run("qir_im2col_i8", args, n * oh, m * k)
        return cols, oh, ow
    xh = x.permute(0, 2, 3, 1)
    if ph or pw:
        # the border stays zero: only the interior is ever written
        xp = scratch(("im2col_pad", ph, pw), (n, h + 2 * ph, w + 2 * pw, c), x.dtype)
        xp[:, ph : ph + h, pw : pw + w] = xh
    else:
        xp = xh.contiguous()
    s0, s1, s2, s3 = xp.stride()
    view = xp.as_strided((n, oh, ow, kh, kw, c), (s0, s1 * sh, s2 * sw, s1 * dh, s2 * dw, s3))
    rows = max(m, 17)  # torch._int_mm needs more than 16 rows
    if kp == k and rows == m:
        return view.reshape(m, k), oh, ow
    # rows past m and columns past k stay zero: k and m are in the key
    cols = scratch(("im2col", k, m), (rows, kp), x.dtype)
    cols[:m].view(n, oh, ow, kp)[..., :k].unflatten(-1, (kh, kw, c)).copy_(view)
    return cols, oh, ow


def _acc_conv2d(x: torch.Tensor, st: ConvState, a: Mapping[str, Any]) -> torch.Tensor:
    """Exact accumulator (no bias) in NHWC view order (N, OH, OW, C_out): float64, or int32 from ``_int_mm``."""
    engine = a["engine"]
    stride, padding, dilation, groups = list(a["stride"]), list(a["padding"]), list(a["dilation"]), int(a["groups"])
    if a.get("padding_mode", "zeros") != "zeros":
        x = F.pad(x.to(torch.float64), list(a["reversed_padding"]), mode=str(a["padding_mode"]))
        padding = [0, 0]
    if engine in ("int_mm", "int_mm_t"):
        kh, kw = int(a["kernel_size"][0]), int(a["kernel_size"][1])
        if x.shape[1] * kh * kw != st.k:
            raise ValueError(
                f"conv input has {x.shape[1]} channels, the layer {st.k // (kh * kw)}: "
                "pass the input shape the model was compiled for"
            )
        cols, oh, ow = _im2col(x, kh, kw, stride, padding, dilation, int(st.weight.shape[0]))
        m = x.shape[0] * oh * ow
        # the accumulator never leaves this call (requantization reads it), so it can live in scratch
        acc = torch._int_mm(cols, st.weight, out=scratch(("acc",), (cols.shape[0], st.weight.shape[1]), torch.int32))
        return acc[:m, : st.n].reshape(x.shape[0], oh, ow, st.n)
    if engine == "dw":  # the torch path (no native library): float32, exact for kh * kw <= 1024
        xf = x.to(torch.float32, memory_format=torch.channels_last)
        wf = st.chunks[0][2]
        return F.conv2d(xf, wf, None, stride, padding, dilation, groups).permute(0, 2, 3, 1).to(torch.float64)
    if engine == "f32":
        xf = x.to(torch.float32, memory_format=torch.channels_last)
        return F.conv2d(xf, st.weight, None, stride, padding, dilation, groups).permute(0, 2, 3, 1).to(torch.float64)
    if engine == "f32_chunked":
        xf = x.to(torch.float32, memory_format=torch.channels_last)
        total: torch.Tensor | None = None
        for c0, c1, wc in st.chunks:
            part = F.conv2d(xf[:, c0:c1], wc, None, stride, padding, dilation, 1).to(torch.float64)
            total = part if total is None else total.add_(part)
        assert total is not None
        return total.permute(0, 2, 3, 1)
    y = F.conv2d(x.to(torch.float64), st.weight, None, stride, padding, dilation, groups)
    return y.permute(0, 2, 3, 1)


def _epilogue(
    fr: FusedRequant, m: int, addend: torch.Tensor | None, out: torch.Tensor, st: ConvState | None = None
) -> Any:
    """``native.Epilogue`` for ``m`` rows of ``fr``'s requantization into ``out``; checks every size
    the C side will index with (``out`` and the addend (m, n); each per-channel array holds
    ``fr.n`` values, checked when ``fr`` was built), and returns the structure with the tensors it
    points into (keep both alive). With ``st``, the last structure is kept there and handed out
    again while its sizes and pointers are the same (the usual case: the layer's own output
    buffer, the addend another layer's), which spares the Python work at batch 1."""
    n = fr.n
    if addend is not None and fr.add is not None:
        addend = addend.reshape(m, n).contiguous()
    key = (
        m,
        out.data_ptr(),
        out.dtype,
        out.shape,
        0 if addend is None else addend.data_ptr(),
        getattr(addend, "dtype", None),
    )
    if st is not None and st.epilogue is not None and st.epilogue[0] == key:
        return st.epilogue[1], addend
    if out.shape != (m, n) or out.dtype != fr.out_dtype or not out.is_contiguous():
        raise ValueError(f"native requantization: output must be contiguous {fr.out_dtype} ({m}, {n})")
    p = native.ptr
    e = native.Epilogue(kind=1, out_bits=8 if fr.out_dtype == torch.int8 else 16, n=n, out=p(out))
    e.rq, e.fast = p(fr.rq), int(fr.fast)
    if fr.add is not None:
        if addend is None or addend.dtype not in (torch.int8, torch.int16):
            raise TypeError(f"fused add: addend codes must be int8 or int16, got {getattr(addend, 'dtype', None)}")
        e.kind, e.add_bits, e.addend = 2, 8 if addend.dtype == torch.int8 else 16, p(addend)
        e.bias, e.mult, e.half, e.shift = p(fr.bias), p(fr.mult), p(fr.half), p(fr.shift)
        e.add_mult, e.add_half, e.add_shift, e.p = fr.add
        e.lo_i, e.hi_i = p(fr.lo_i), p(fr.hi_i)
        if fr.add_packs is not None:
            rq_mid, fast_mid, rq_add, fast_add = fr.add_packs
            e.rq_mid, e.fast_mid, e.rq_add, e.fast_add = p(rq_mid), int(fast_mid), p(rq_add), int(fast_add)
    if st is not None:
        st.epilogue = (key, e)
    return e, addend


def _gemm_vnni(a: torch.Tensor, m: int, st: ConvState, addend: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Codes (m, n) = requantize(a[:m] @ w) in one native pass (``qir_gemm_vnni``): ``a`` int8 with
    contiguous rows of at least the packed reduction length; writes ``out``."""
    call, keep = _gemm_call(a, m, st, addend, out)
    if call() != 0:
        raise MemoryError("int8 matrix product: out of memory for a chunk of accumulators")
    del keep
    return out


def _gemm_call(
    a: torch.Tensor, m: int, st: ConvState, addend: torch.Tensor | None, out: torch.Tensor
) -> tuple[Call, Any]:
    """``_gemm_vnni``'s checked native call, and what must stay alive while it runs."""
    assert st.vnni is not None and st.fused is not None
    panels, comp = st.vnni
    nblocks, kq = int(panels.shape[0]), int(panels.shape[1])
    # the sizes qir_gemm_vnni indexes with: a[i * lda + 4 kq - 1] for i < m, panels and comp whole
    if a.dtype != torch.int8 or a.dim() != 2 or a.stride(1) != 1 or a.shape[0] < m or a.shape[1] < 4 * kq:
        raise ValueError(
            f"int8 matrix product: the columns must be int8 (>= {m}, >= {4 * kq}) with contiguous rows, "
            f"got {a.dtype} {tuple(a.shape)}"
        )
    assert a.stride(0) >= 4 * kq and panels.is_contiguous() and panels.shape[2:] == (16, 4)
    assert comp.is_contiguous() and comp.numel() == nblocks * 16 and st.fused.n <= nblocks * 16
    e, keep = _epilogue(st.fused, m, addend, out, st)
    p = native.ptr
    work = m * st.n * 4 * kq
    if m < 6 and nblocks > 1 and native.threads() > 1:
        # fewer rows than one 6-row register tile (a batch-1 linear): nothing for a row split to cut, so
        # the parts are panels of 16 output channels, each part reading only its panels of the weight
        cols = (p(a), int(a.stride(0)), m, p(panels), kq, nblocks, p(comp), ctypes.addressof(e))
        return Call("qir_gemm_vnni_cols", cols, nblocks, work, keep=(e, out)), keep
    args = (p(a), int(a.stride(0)), p(panels), kq, nblocks, p(comp), ctypes.addressof(e))
    # parts cut at multiples of the 6-row register tile
    return Call("qir_gemm_vnni", args, m, work, grain=6, per=native.gemm_parts(m), keep=(e, out)), keep


def _call_key(x: torch.Tensor, addend: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What a native conv call's arguments depend on beyond the layer: the input's and the addend's
    dtype, shape, strides and place; None where the call copies either (an input not in NHWC
    order, an addend whose rows are not contiguous), whose place then changes from call to call."""
    if not x.is_contiguous(memory_format=torch.channels_last) or x.dim() != 4:
        return None
    key: tuple[Any, ...] = (x.dtype, x.shape, x.stride(), x.data_ptr())
    if addend is None:
        return key
    if not addend.is_contiguous():  # the (N, OH, OW, C) view of the addend
        return None
    return (*key, addend.dtype, addend.shape, addend.data_ptr())


def _conv_vnni(x: torch.Tensor, st: ConvState, a: Mapping[str, Any], addend: torch.Tensor | None) -> torch.Tensor:
    """The int8 conv with the requantization fused, one native pass per chunk of output pixels
    (``qir_conv_vnni``: im2col into a cached buffer, VNNI product, epilogue); 1x1 stride-1 convs
    multiply the NHWC codes in place. Returns codes (N, OH, OW, C_out) in ``st``'s output buffer."""
    assert st.vnni is not None and st.fused is not None
    key = _call_key(x, addend)
    last = st.last_call
    if key is not None and last is not None and last[0] == key:
        # the same input, addend and output places as the last call, which checked them all
        if last[1]() != 0:
            raise MemoryError("int8 conv: out of memory for a chunk of columns and accumulators")
        return last[2]
    st.last_call = None
    if x.dtype != torch.int8 or x.dim() != 4:
        raise TypeError(f"int8 conv: input codes must be int8 (N, C, H, W), got {x.dtype} {tuple(x.shape)}")
    kh, kw = int(a["kernel_size"][0]), int(a["kernel_size"][1])
    nb, c, h, w = (int(d) for d in x.shape)
    if c * kh * kw != st.k:
        raise ValueError(
            f"conv input has {c} channels, the layer {st.k // (kh * kw)}: "
            "pass the input shape the model was compiled for"
        )
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], a["dilation"]
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"conv: input {h}x{w} is smaller than the {kh}x{kw} kernel's reach")
    m = nb * oh * ow
    xh = x.permute(0, 2, 3, 1).contiguous()  # free when x already lives in NHWC (the previous conv's output)
    out = st.output((m, st.n), st.fused.out_dtype)
    panels, comp = st.vnni
    nblocks, kq = int(panels.shape[0]), int(panels.shape[1])
    if kh == kw == 1 and sh == sw == 1 and ph == pw == 0 and c == 4 * kq:
        call, _keep = _gemm_call(xh.view(m, c), m, st, addend, out)  # _keep: alive until the call has run
        return _run_conv(call, st, key, out.view(nb, oh, ow, st.n))
    # qir_conv_vnni reads x[n][yi][xi][0:c] for n < nb and (yi, xi) it checks against (h, w), and writes
    # kh * kw * c column bytes per row of 4 kq: both bounded here
    assert xh.is_contiguous() and xh.numel() == nb * h * w * c and st.k <= 4 * kq
    assert panels.is_contiguous() and comp.numel() == nblocks * 16 and st.fused.n <= nblocks * 16
    e, _keep = _epilogue(st.fused, m, addend, out, st)  # _keep: alive until the call has run
    p = native.ptr
    geometry = (p(xh), h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow)
    args = (*geometry, p(panels), kq, nblocks, p(comp), ctypes.addressof(e))
    # parts cut at multiples of the 6-row register tile
    call = Call("qir_conv_vnni", args, m, m * st.n * 4 * kq, grain=6, per=native.gemm_parts(m), keep=(e, out, panels))
    return _run_conv(call, st, key, out.view(nb, oh, ow, st.n))


def _run_conv(call: Call, st: ConvState, key: tuple[Any, ...] | None, result: torch.Tensor) -> torch.Tensor:
    """Run a native conv call and keep it for the next call with the same ``key`` (the call holds
    its epilogue structure and output buffer; the key pins the input's and the addend's place)."""
    if call() != 0:
        raise MemoryError("int8 conv: out of memory for a chunk of columns and accumulators")
    if key is not None:
        st.last_call = (key, call, result)
    return result


def _dw_native(
    x: torch.Tensor,
    w: torch.Tensor,
    fr: FusedRequant,
    a: Mapping[str, Any],
    st: ConvState | None = None,
    packed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Depthwise conv + requantization in one native pass: int8 NCHW ``x`` (any memory format) ->
    codes (N, OH, OW, C), written into ``st``'s output buffer when given. With ``packed``
    (``native.pack_dw(w)``, on a VNNI build) the four-taps-per-lane kernel ``qir_dw_vnni``, else
    ``qir_dw_rows``: the same codes."""
    if x.dtype != torch.int8:
        raise TypeError(f"depthwise conv: input codes must be int8, got {x.dtype}")
    nb, c, h, wd = x.shape
    kh, kw = int(w.shape[0]), int(w.shape[1])
    if c != w.shape[2]:
        raise ValueError(f"depthwise conv: input has {c} channels, the layer {int(w.shape[2])}")
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], a["dilation"]
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"depthwise conv: input {h}x{wd} is smaller than the {kh}x{kw} kernel's reach")
    xh = x.permute(0, 2, 3, 1).contiguous()  # free when x already lives in NHWC (the previous conv's output)
    # the C loop reads x[b][yi][xi][0:c] for b < nb, (yi, xi) it tests against (h, wd), the (kh, kw, c)
    # weight and c requantization entries, and writes rows (b, oy) < nb * oh of out
    assert w.is_contiguous() and w.dim() == 3 and fr.n == c and xh.numel() == nb * h * wd * c
    out = (
        st.output((nb, oh, ow, c), fr.out_dtype) if st is not None else torch.empty((nb, oh, ow, c), dtype=fr.out_dtype)
    )
    tag = "i8" if fr.out_dtype == torch.int8 else "i16"
    p = native.ptr
    rq = (p(fr.rq), int(fr.fast), p(out))
    work = nb * oh * ow * c * kh * kw
    taps = (kh, kw, sh, sw, ph, pw, dh, dw, oh, ow)
    if packed is not None and _dw_ring_bytes(kh, kw, c, sw, dh, dw, ow) <= _DW_RING_MAX:
        wpk, comp = packed
        blocks = -(-c // 16)
        # qir_dw_vnni reads blocks * kh * ceil(kw / 4) * 64 packed weight bytes and (kh + 1) * 16 * blocks
        # compensation entries, x as above, and writes out's (b, oy) rows for the channels of its units
        assert wpk.dtype == torch.int8 and wpk.is_contiguous() and wpk.numel() == blocks * kh * -(-kw // 4) * 64
        assert comp.dtype == torch.int32 and comp.is_contiguous() and comp.numel() == (kh + 1) * blocks * 16
        gcb, grain = native.channel_groups(nb * oh, blocks, work)
        args = (p(xh), h, wd, c, *taps, p(wpk), p(comp), nb * oh, gcb, *rq)
        if native.run(f"qir_dw_vnni_{tag}", args, -(-blocks // gcb) * nb * oh, work, grain) != 0:
            raise MemoryError("depthwise conv: out of memory for the rearranged input rows")
        return out
    if native.run(f"qir_dw_rows_{tag}", (p(xh), h, wd, c, p(w), *taps, *rq), nb * oh, work) != 0:
        raise MemoryError("depthwise conv: out of memory for a row of accumulators")
    return out


#: the most memory one part of qir_dw_vnni keeps for its rearranged input rows; past it (very wide
#: or very dilated kernels) the one-tap-per-lane kernel runs instead
_DW_RING_MAX = 16 << 20


def _dw_ring_bytes(kh: int, kw: int, c: int, sw: int, dh: int, dw: int, ow: int) -> int:
    """What qir_dw_vnni allocates per part at most (one group of all the channel blocks)."""
    entries = ow if kw <= 4 else (ow - 1) * sw + 4 * (-(-kw // 4) - 1) * dw + 1
    return ((kh - 1) * dh + 1) * -(-c // 16) * entries * 64


def _finish(
    acc: torch.Tensor, addend: torch.Tensor | None, st: ConvState, a: Mapping[str, Any], axis: int
) -> torch.Tensor:
    """Bias, requantization (or the fused add), activation clamp, saturation; ``axis``: channels."""
    out_dtype = str(a["out_dtype"])
    lo, hi = qbounds(out_dtype)
    shape = [1] * acc.dim()
    shape[axis % acc.dim()] = -1
    if a.get("requant", "f64") != "f64":
        return _finish_i64(acc, addend, st, a, axis)
    act = a.get("act")
    if st.add_rq is not None:
        assert addend is not None
        i32lo, i32hi = qbounds("qint32")
        mid = st.workspace(0, acc)
        torch.addcmul(st.bias_half.reshape(shape), mid, st.rq.scale.reshape(shape), out=mid).floor_()
        mid.clamp_(i32lo, i32hi)
        add = st.workspace(1, addend)
        sc, hf = st.add_rq.along(-1, add.dim())
        torch.addcmul(hf, add, sc, out=add).floor_().clamp_(i32lo, i32hi)
        mid += add
        p = int(a["extra_bits"])
        out = mid.add_(float((1 << p) >> 1)).mul_(2.0**-p).floor_() if p else mid
    elif out_dtype == "qint32":
        out = acc + st.bias.reshape(shape)
    else:
        # floor((acc + b) * M/2**s + half) with the bias folded into the per-channel offset (exact, see base)
        out = st.workspace(0, acc)
        torch.addcmul(st.bias_half.reshape(shape), out, st.rq.scale.reshape(shape), out=out).floor_()
    # saturation then ReLU is one clamp to [max(lo, 0), hi]
    out = out.clamp_(max(lo, 0) if act is not None else lo, hi)
    if act == "relu6":
        torch.minimum(out, st.relu6_bound.reshape(shape).to(out.dtype), out=out)
    return out.to(_CODE_DTYPES[out_dtype])  # already within the dtype's range


def _finish_i64(
    acc: torch.Tensor, addend: torch.Tensor | None, st: ConvState, a: Mapping[str, Any], axis: int
) -> torch.Tensor:
    out_dtype = str(a["out_dtype"])
    lo, hi = qbounds(out_dtype)
    shape = [1] * acc.dim()
    shape[axis % acc.dim()] = -1
    acc64 = acc.to(torch.int64) + st.bias.to(torch.int64).reshape(shape)
    if st.add_rq is not None:
        assert addend is not None
        i32lo, i32hi = qbounds("qint32")
        mid = requant_i64(acc64, st.rq.multiplier, st.rq.shift, axis).clamp_(i32lo, i32hi)
        mid += requant_i64(addend, st.add_rq.multiplier, st.add_rq.shift, None).clamp_(i32lo, i32hi)
        p = int(a["extra_bits"])
        out = torch.bitwise_right_shift(mid + ((1 << p) >> 1), p).clamp_(lo, hi)
    elif out_dtype == "qint32":
        out = acc64
    else:
        out = requant_i64(acc64, st.rq.multiplier, st.rq.shift, axis).clamp_(lo, hi)
    if a.get("act") is not None:
        out = out.clamp(min=0)
        if a["act"] == "relu6":
            out = torch.minimum(out, st.relu6_bound.reshape(shape))
    return sat_to(out, out_dtype)


def _timings_check(v: Any) -> str | None:
    ok = isinstance(v, dict) and len(v) <= 8
    ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in v.values())
    return None if ok else "must map engine names to non-negative times"


def _chunks_check(v: Any) -> str | None:
    ok = isinstance(v, list) and 1 <= len(v) <= 4096
    ok = ok and all(
        isinstance(c, list)
        and len(c) == 2
        and all(isinstance(i, int) and not isinstance(i, bool) for i in c)
        and 0 <= c[0] < c[1] <= 2**20
        for c in v
    )
    return None if ok else "must be 1 to 4096 [start, stop) input-channel ranges"


def _conv_extra(inst: Instruction, consts: Mapping[str, torch.Tensor] | None) -> str | None:
    a = inst.attrs
    fused = ("add_multiplier", "add_shift", "extra_bits")
    if a.get("has_add"):
        if len(inst.inputs) != 2 or any(k not in a for k in fused):
            return "has_add needs the addend as a second input and add_multiplier, add_shift, extra_bits"
    elif len(inst.inputs) != 1 or any(k in a for k in fused):
        return "without has_add there is one input and no add_multiplier / add_shift / extra_bits"
    if (a.get("engine") == "f32_chunked") != ("chunks" in a):
        return "the f32_chunked engine needs chunks, and only it has them"
    if consts is None or any(inst.consts[r] not in consts for r in _CONV_CONSTS):
        return None
    w, b = consts[inst.consts["weight"]], consts[inst.consts["bias"]]
    c_out = int(b.numel()) if a["kind"] == "conv_transpose2d" else int(w.shape[0])
    spatial = {"linear": 0, "conv1d": 1, "conv2d": 2, "conv3d": 3, "conv_transpose2d": 2}[str(a["kind"])]
    if w.dim() != 2 + spatial:
        return f"a {a['kind']} weight has rank {2 + spatial}, the constant has rank {w.dim()}"
    if "kernel_size" in a and list(w.shape[2:]) != list(a["kernel_size"]):
        return f"kernel_size {a['kernel_size']} differs from the weight's {list(w.shape[2:])}"
    if b.numel() != c_out:
        return f"the bias has {b.numel()} entries for {c_out} output channel(s)"
    for role in ("multiplier", "shift", "relu6_bound"):
        if consts[inst.consts[role]].numel() not in (1, c_out):
            return f"{role} has {consts[inst.consts[role]].numel()} entries for {c_out} output channel(s)"
    for key in ("stride", "dilation", "padding"):
        v = a.get(key)
        if spatial and isinstance(v, list) and len(v) != spatial:
            return f"{key} has {len(v)} entries for a {spatial}-d kernel"
    return None


_COMMON_ATTRS = {
    "kind": one_of("conv1d", "conv2d", "conv3d", "conv_transpose2d", "linear"),
    "out_dtype": OUT_DTYPE,
    "act": one_of(None, "relu", "relu6"),
    "has_add": boolean(),
    "add_multiplier": integer(-(2**32), 2**32, required=False),
    "add_shift": integer(0, 63, required=False),
    "extra_bits": integer(0, 30, required=False),
    "requant": one_of("f64", "i64"),
    "timings_us": Attr(_timings_check, "engine -> microseconds", required=False),
}
_SPATIAL = {
    "stride": ints(1, MAX_EXTENT, (1, 3), scalar=True),
    "dilation": ints(1, MAX_EXTENT, (1, 3), scalar=True),
    "groups": integer(1, 2**20),
    "padding_mode": one_of("zeros", "reflect", "replicate", "circular"),
    "reversed_padding": ints(0, MAX_EXTENT, (2, 6)),
    "kernel_size": ints(1, MAX_EXTENT, (1, 3)),
}
_CONV2D_ATTRS = {
    **_COMMON_ATTRS,
    **_SPATIAL,
    "padding": ints(0, MAX_EXTENT, 2),
    "engine": one_of(*CONV2D_ENGINES),
    "chunks": Attr(_chunks_check, "input-channel ranges", required=False),
}
_CONV_ND_ATTRS = {
    **_COMMON_ATTRS,
    **_SPATIAL,
    "padding": Attr(
        lambda v: None if v in ("same", "valid") else ints(0, MAX_EXTENT, (1, 3), scalar=True).check(v),
        "'same', 'valid' or pad widths",
    ),
    "output_padding": ints(0, MAX_EXTENT, (1, 3), scalar=True, required=False),
    "engine": one_of("f32", "f64"),
}
_LINEAR_ATTRS = {**_COMMON_ATTRS, "engine": one_of(*LINEAR_ENGINES)}
_CONV_CONSTS = {
    "weight": Const(("int8", "int16"), (2, 5)),
    "bias": Const(INT_DTYPES, (1, 1)),
    "multiplier": Const(INT_DTYPES, (0, 1)),
    "shift": Const(INT_DTYPES, (0, 1)),
    "relu6_bound": Const(INT_DTYPES, (0, 1)),
}


@register_kernel(
    "conv2d",
    prepare=_prepare,
    schema=KernelSchema(
        inputs=(1, 2),
        attrs=_CONV2D_ATTRS,
        consts=_CONV_CONSTS,
        extra=_conv_extra,
        shape=conv2d_shape,
        work=conv_work,
    ),
)
def conv2d(inst: Instruction, args: list[Any], st: ConvState) -> list[Any]:
    """``act(requant(conv(x, w) + b))`` or, with ``has_add``, the fused conv + add rule; NCHW in and out."""
    x = args[0]
    if inst.attrs["engine"] == "dw" and st.fused is not None:
        return [_dw_native(x, st.weight, st.fused, inst.attrs, st, st.dw_pack).permute(0, 3, 1, 2)]
    if st.vnni is not None and st.fused is not None:
        addend = args[1].permute(0, 2, 3, 1) if len(args) > 1 else None
        return [_conv_vnni(x, st, inst.attrs, addend).permute(0, 3, 1, 2)]
    acc = _acc_conv2d(x, st, inst.attrs)
    addend = args[1].permute(0, 2, 3, 1) if len(args) > 1 else None
    if st.fused is not None:
        nb, oh, ow, c = acc.shape
        rows = nb * oh * ow
        out = fused_finish(acc.flatten(0, 2), addend, st.fused, rows, st.output((rows, c), st.fused.out_dtype))
        return [out.view(nb, oh, ow, c).permute(0, 3, 1, 2)]
    return [_finish(acc, addend, st, inst.attrs, -1).permute(0, 3, 1, 2)]


@register_kernel(
    "conv_nd",
    prepare=_prepare,
    schema=KernelSchema(
        inputs=(1, 2),
        attrs=_CONV_ND_ATTRS,
        consts=_CONV_CONSTS,
        extra=_conv_extra,
        shape=conv_nd_shape,
        work=conv_work,
    ),
)
def conv_nd(inst: Instruction, args: list[Any], st: ConvState) -> list[Any]:
    """Conv1d / Conv3d / ConvTranspose2d on the f32 or f64 engine (channels on axis 1)."""
    a = inst.attrs
    x = args[0]
    ct = torch.float32 if a["engine"] == "f32" else torch.float64
    xf = x.to(ct)
    w = st.weight.to(ct)
    kind = a["kind"]
    if kind == "conv_transpose2d":
        y = F.conv_transpose2d(
            xf, w, None, a["stride"], a["padding"], a["output_padding"], int(a["groups"]), a["dilation"]
        )
    else:
        padding = a["padding"]
        if a.get("padding_mode", "zeros") != "zeros":
            xf = F.pad(xf, list(a["reversed_padding"]), mode=str(a["padding_mode"]))
            padding = 0
        fn = F.conv1d if kind == "conv1d" else F.conv3d
        y = fn(xf, w, None, a["stride"], padding, a["dilation"], int(a["groups"]))
    addend = args[1] if len(args) > 1 else None
    return [_finish(y.to(torch.float64), addend, st, a, 1)]


@register_kernel(
    "linear",
    prepare=_prepare,
    schema=KernelSchema(
        inputs=(1, 2),
        attrs=_LINEAR_ATTRS,
        consts=_CONV_CONSTS,
        extra=_conv_extra,
        shape=linear_shape,
        work=conv_work,
    ),
)
def linear(inst: Instruction, args: list[Any], st: ConvState) -> list[Any]:
    """``act(requant(x @ w.T + b))`` over the last axis (any leading shape)."""
    x = args[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    engine = inst.attrs["engine"]
    if engine == "int_mm":
        m = x2.shape[0]
        kp = int(st.weight.shape[0])
        if m <= 16 or kp != x2.shape[1]:
            buf = scratch(("linear_rows", m, x2.shape[1]), (max(m, 17), kp), x2.dtype)
            buf[:m, : x2.shape[1]] = x2
            x2 = buf
        x2 = x2.contiguous()
        if st.vnni is not None and st.fused is not None:
            addend = args[1].reshape(m, st.n) if len(args) > 1 else None
            out = _gemm_vnni(x2, m, st, addend, st.output((m, st.n), st.fused.out_dtype))
            return [out.reshape(*lead, st.n)]
        acc = torch._int_mm(x2, st.weight, out=scratch(("acc",), (x2.shape[0], st.weight.shape[1]), torch.int32))
        acc = acc[:m, : st.n]
        if st.fused is not None:
            addend = args[1].reshape(m, st.n) if len(args) > 1 else None
            out = fused_finish(acc, addend, st.fused, m, st.output((m, st.n), st.fused.out_dtype))
            return [out.reshape(*lead, st.n)]
    elif engine == "f32":
        acc = F.linear(x2.to(torch.float32), st.weight).to(torch.float64)
    else:
        acc = F.linear(x2.to(torch.float64), st.weight)
    addend = args[1].reshape(-1, args[1].shape[-1]) if len(args) > 1 else None
    out = _finish(acc, addend, st, inst.attrs, -1)
    return [out.reshape(*lead, st.n)]
