"""Pooling and reductions on codes: max pool (exact), average pools (exact window sums, then one
requantization per window divisor), sum / mean over dims.

Window sums of int8 codes are exact in float32 while ``window * 128 < 2**24``; wider
windows and int16 codes use float64 (exact below 2**53).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from backends.common.kernels import native
from backends.common.kernels.base import RequantF64, qbounds, register_kernel, sat_to
from backends.common.kernels.conv import FusedRequant, fused_finish, fused_requant
from backends.common.kernels.infer import ShapeError, code, meta, meta_call, tensor_arg
from backends.common.kernels.schema import (
    MAX_COUNT,
    MAX_EXTENT,
    MAX_INDEX,
    MULT,
    OUT_DTYPE,
    PAIR_PAD,
    PAIR_POS,
    SHIFT,
    Attr,
    Const,
    KernelSchema,
    boolean,
    integer,
    ints,
    optional,
)
from backends.common.program import Instruction

_WINDOW_CONSTS = {"multipliers": Const(("int64",), (1, 1)), "shifts": Const(("int64",), (1, 1))}


def _output_size_check(v: Any) -> str | None:
    ok = isinstance(v, list) and len(v) == 2
    ok = ok and all(d is None or (isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_EXTENT) for d in v)
    return None if ok else f"must be [H, W], each null or an integer in [1, {MAX_EXTENT}]"


def _sum_dtype(x: torch.Tensor, window: int) -> torch.dtype:
    return torch.float32 if x.dtype == torch.int8 and window * 128 < 2**24 else torch.float64


def _maxpool_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    a = inst.attrs
    x = tensor_arg(args, 0, rank=(3, 4))
    y = meta_call(
        "max pool",
        F.max_pool2d,
        meta(x.shape, torch.float32),
        a["kernel_size"],
        a["stride"],
        a["padding"],
        a["dilation"],
        bool(a["ceil_mode"]),
    )
    return [meta(y.shape, x.dtype)]


def _divisor_range(name: str, largest: int, smallest: int, table: int) -> None:
    if smallest < 1 or largest > table:
        raise ShapeError(
            f"{name}: window divisors range over [{smallest}, {largest}], the program's multiplier table "
            f"covers [1, {table}]"
        )


def _avgpool_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    a = inst.attrs
    x = tensor_arg(args, 0, rank=(3, 4))
    y = meta_call(
        "average pool",
        F.avg_pool2d,
        meta(x.shape, torch.float32),
        a["kernel_size"],
        a["stride"],
        a["padding"],
        bool(a["ceil_mode"]),
        True,
        1,
    )
    if y.numel():
        (kh, kw), (sh, sw), (ph, pw) = a["kernel_size"], a["stride"], a["padding"]
        ceil = bool(a["ceil_mode"])
        # per axis, non-negative window lengths: the product's extremes are the extremes' products
        hp, hr = _axis_windows(int(x.shape[-2]), kh, sh, ph, ceil)
        wp, wr = _axis_windows(int(x.shape[-1]), kw, sw, pw, ceil)
        hs, ws = (hp, wp) if a["count_include_pad"] else (hr, wr)
        if a.get("divisor_override"):
            big = small = int(a["divisor_override"])
        else:
            big, small = int(hs.max()) * int(ws.max()), int(hs.min()) * int(ws.min())
        _divisor_range("average pool", big, small, consts[inst.consts["multipliers"]].numel())
        if consts[inst.consts["shifts"]].numel() < big:
            raise ShapeError(f"average pool: the shift table has fewer than {big} entries")
    return [code(y.shape, a["out_dtype"])]


def _adaptive_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    a = inst.attrs
    x = tensor_arg(args, 0, rank=(2, 8))
    h, w = int(x.shape[-2]), int(x.shape[-1])
    oh = h if a["output_size"][0] is None else int(a["output_size"][0])
    ow = w if a["output_size"][1] is None else int(a["output_size"][1])
    if h == 0 or w == 0:
        raise ShapeError(f"adaptive average pool of an empty {h}x{w} map")
    if oh > 0 and ow > 0:
        hs, he = adaptive_bounds(h, oh)
        ws, we = adaptive_bounds(w, ow)
        rows, cols = he - hs, we - ws
        big, small = int(rows.max()) * int(cols.max()), int(rows.min()) * int(cols.min())
        _divisor_range("adaptive average pool", big, small, consts[inst.consts["multipliers"]].numel())
        if consts[inst.consts["shifts"]].numel() < big:
            raise ShapeError(f"adaptive average pool: the shift table has fewer than {big} entries")
    return [code((*x.shape[:-2], oh, ow), a["out_dtype"])]


def _reduce_sum_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    a = inst.attrs
    x = tensor_arg(args, 0)
    dims = a.get("dims")
    if dims is None:
        out = meta((), torch.int64)
    else:
        out = meta_call("reduce_sum", torch.sum, meta(x.shape, torch.int64), dim=list(dims), keepdim=bool(a["keepdim"]))
    if a.get("n") is not None and x.numel() // max(out.numel(), 1) != int(a["n"]):
        raise ShapeError(
            f"reduce_sum averages over {a['n']} elements, the input of shape {list(x.shape)} gives "
            f"{x.numel() // max(out.numel(), 1)}"
        )
    return [code(out.shape, a["out_dtype"])]


@register_kernel(
    "maxpool2d",
    schema=KernelSchema(
        attrs={
            "kernel_size": PAIR_POS,
            "stride": optional(PAIR_POS),
            "padding": PAIR_PAD,
            "dilation": PAIR_POS,
            "ceil_mode": boolean(),
        },
        shape=_maxpool_shape,
    ),
)
def maxpool2d(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """Max over each window: one native pass over NHWC codes where the library is built, else in
    float32, which holds every code exactly (torch's integer max pool refuses inputs whose
    depth * height * width exceeds the code dtype's maximum)."""
    a = inst.attrs
    x = args[0]
    y_native = _maxpool_native(x, a)
    if y_native is not None:
        return [y_native]
    y = F.max_pool2d(
        x.to(torch.float32), a["kernel_size"], a["stride"], a["padding"], a["dilation"], bool(a["ceil_mode"])
    )
    return [y.to(x.dtype)]


def _pool_out_len(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """torch's pooling output length (dilation included); a last window that would start in the
    right padding is dropped."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (span + ((s - 1) if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _maxpool_native(x: torch.Tensor, a: Mapping[str, Any]) -> torch.Tensor | None:
    """``qir_maxpool_rows_*`` on int8 / int16 NCHW ``x`` (any memory format), as an NCHW view of NHWC
    codes; None where it does not apply (no library, another dtype or rank, a window that could
    hold padding only, which torch's float path answers with -inf)."""
    lib = native.library()
    if lib is None or x.dtype not in (torch.int8, torch.int16) or x.dim() != 4:
        return None
    (kh, kw), (ph, pw), (dh, dw) = _pair(a["kernel_size"]), _pair(a["padding"]), _pair(a["dilation"])
    sh, sw = _pair(a["stride"] if a["stride"] is not None else a["kernel_size"])
    ceil = bool(a["ceil_mode"])
    # torch's rule (padding at most half the kernel) keeps a real input position in every window
    if 2 * ph > kh or 2 * pw > kw or dh != 1 or dw != 1:
        return None
    nb, c, h, w = (int(d) for d in x.shape)
    oh, ow = _pool_out_len(h, kh, sh, ph, dh, ceil), _pool_out_len(w, kw, sw, pw, dw, ceil)
    if oh < 1 or ow < 1:
        return None
    xh = x.permute(0, 2, 3, 1).contiguous()
    out = torch.empty((nb, oh, ow, c), dtype=x.dtype)
    # the C loop reads x[n][yi][xi][:] only for (yi, xi) it checks against (h, w) and writes rows [r0, r1) of out
    assert xh.numel() == nb * h * w * c and out.is_contiguous()
    name = "qir_maxpool_rows_i8" if x.dtype == torch.int8 else "qir_maxpool_rows_i16"
    p = native.ptr
    args = (p(xh), h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, p(out))
    native.run(name, args, nb * oh, nb * oh * ow * c * kh * kw)
    return out.permute(0, 3, 1, 2)


def _out_len(size: int, k: int, s: int, p: int, ceil: bool) -> int:
    out = (size + 2 * p - (k - 1) - 1 + ((s - 1) if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _axis_windows(size: int, k: int, s: int, p: int, ceil: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output index along one axis: the padded window length and the count of real elements."""
    o = torch.arange(_out_len(size, k, s, p, ceil), dtype=torch.int64)
    start = o * s - p
    end = torch.clamp(start + k, max=size + p)
    padded = end - start
    real = torch.clamp(end, max=size) - torch.clamp(start, min=0)
    return padded, real


def avgpool_divisors(h: int, w: int, a: Mapping[str, Any]) -> torch.Tensor:
    """The divisor of each output position (OH, OW), following torch's avg_pool2d."""
    (kh, kw), (sh, sw), (ph, pw) = a["kernel_size"], a["stride"], a["padding"]
    ceil = bool(a["ceil_mode"])
    ph_, rh = _axis_windows(h, kh, sh, ph, ceil)
    pw_, rw = _axis_windows(w, kw, sw, pw, ceil)
    if a.get("divisor_override"):
        return torch.full((ph_.numel(), pw_.numel()), int(a["divisor_override"]), dtype=torch.int64)
    if a["count_include_pad"]:
        return ph_[:, None] * pw_[None, :]
    return rh[:, None] * rw[None, :]


def _window_factors(
    divisor: torch.Tensor, mult: torch.Tensor, shift: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window: the float64 requantization factors of its divisor's table entry."""
    if int(divisor.max()) > mult.numel() or int(divisor.min()) < 1:
        raise ValueError(
            f"{where}: a window divisor {int(divisor.max())} is outside the program's table "
            f"(1..{mult.numel()}); the input shape differs from the compiled one"
        )
    idx = divisor - 1
    rq = RequantF64(mult[idx].reshape(-1), shift[idx].reshape(-1))
    return rq.scale.reshape(divisor.shape), rq.half.reshape(divisor.shape)


def _requant_windows(sums: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor], out_dtype: str) -> torch.Tensor:
    sc, hf = factors
    lo, hi = qbounds(out_dtype)
    return sat_to(torch.addcmul(hf, sums.to(torch.float64), sc).floor_().clamp_(lo, hi), out_dtype)


def _window_requant(
    sums: torch.Tensor, divisor: torch.Tensor, mult: torch.Tensor, shift: torch.Tensor, out_dtype: str, where: str
) -> torch.Tensor:
    return _requant_windows(sums, _window_factors(divisor, mult, shift, where), out_dtype)


@register_kernel(
    "avgpool2d",
    schema=KernelSchema(
        attrs={
            "kernel_size": ints(1, MAX_EXTENT, 2),
            "stride": ints(1, MAX_EXTENT, 2),
            "padding": ints(0, MAX_EXTENT, 2),
            "ceil_mode": boolean(),
            "count_include_pad": boolean(),
            "divisor_override": optional(integer(1, MAX_COUNT)),
            "out_dtype": OUT_DTYPE,
        },
        consts=_WINDOW_CONSTS,
        shape=_avgpool_shape,
    ),
)
def avgpool2d(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    a = inst.attrs
    x = args[0]
    (kh, kw) = a["kernel_size"]
    ct = _sum_dtype(x, kh * kw)
    sums = F.avg_pool2d(x.to(ct), a["kernel_size"], a["stride"], a["padding"], bool(a["ceil_mode"]), True, 1)
    d = avgpool_divisors(int(x.shape[-2]), int(x.shape[-1]), a)
    return [_window_requant(sums, d, state["multipliers"], state["shifts"], str(a["out_dtype"]), inst.source)]


def adaptive_bounds(size: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(out, dtype=torch.int64)
    return (i * size) // out, -((-(i + 1) * size) // out)


@dataclass
class _AdaptiveState:
    multipliers: torch.Tensor
    shifts: torch.Tensor
    #: (H, W) -> window bounds and requantization factors: built on the first call at an input size
    windows: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)
    #: (H * W, C, out dtype) -> the global pool's native requantization (None: its parameters do not
    #: fit it), built on the first call at an input size
    packed: dict[tuple[int, int, str], FusedRequant | None] = field(default_factory=dict)


def _prepare_adaptive(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> _AdaptiveState:
    return _AdaptiveState(consts[inst.consts["multipliers"]], consts[inst.consts["shifts"]])


def _global_sums_native(x: torch.Tensor) -> torch.Tensor | None:
    """Per (n, c) sums of int8 / int16 NCHW codes (any memory format) over all pixels, int32 (N, C, 1, 1),
    in one native pass over NHWC memory; None where it does not apply (no library, another dtype or
    rank, a map so large that int32 could overflow). Torch's reduction over the two inner dims of a
    channels-last view took milliseconds for mobilenet_v2's 1280 x 7 x 7 at batch 1."""
    lib = native.library()
    if lib is None or x.dtype not in (torch.int8, torch.int16) or x.dim() != 4:
        return None
    nb, c, h, w = (int(d) for d in x.shape)
    if h * w * 32768 >= 2**31 or nb * c == 0:
        return None
    xh = x.permute(0, 2, 3, 1).contiguous()  # free when x already lives in NHWC (a conv's output)
    out = torch.empty((nb, c), dtype=torch.int32)
    # the C loop reads nb * h * w * c codes and writes rows [r0, r1) of the (nb, c) sums
    assert xh.numel() == nb * h * w * c
    name = "qir_sum_pixels_i8" if x.dtype == torch.int8 else "qir_sum_pixels_i16"
    native.run(name, (native.ptr(xh), h * w, c, native.ptr(out)), nb, nb * h * w * c)
    return out.view(nb, c, 1, 1)


def _global_mean_native(
    x: torch.Tensor, sums: torch.Tensor, state: _AdaptiveState, out_dtype: str
) -> torch.Tensor | None:
    """The global average pool's codes (N, C, 1, 1) in two native passes, the sums over the pixels
    and their requantization by the divisor's table entry (``clamp((sum * M + 2**(s-1)) >> s)``, the
    rule the float64 factors compute exactly), from the caller's native int32 ``sums``; None where the
    requantization pass does not apply. At batch 1 the float64 path's six small torch operations
    cost several times the sums."""
    nb, c = int(sums.shape[0]), int(sums.shape[1])
    hw = int(x.shape[-2]) * int(x.shape[-1])
    key = (hw, c, out_dtype)
    if key not in state.packed:  # the caller's window factors checked hw against the table
        m, sh = state.multipliers.reshape(-1)[hw - 1], state.shifts.reshape(-1)[hw - 1]
        zero = torch.zeros(1, dtype=torch.int64)  # no bias; relu6_bound unused without an activation
        state.packed[key] = fused_requant(out_dtype, None, m, sh, zero, zero, c)
    fr = state.packed[key]
    if fr is None:
        return None
    return fused_finish(sums.view(nb, c), None, fr, nb).view(nb, c, 1, 1)


@register_kernel(
    "adaptive_avgpool2d",
    prepare=_prepare_adaptive,
    schema=KernelSchema(
        attrs={"output_size": Attr(_output_size_check, "[H or null, W or null]"), "out_dtype": OUT_DTYPE},
        consts=_WINDOW_CONSTS,
        shape=_adaptive_shape,
    ),
)
def adaptive_avgpool2d(inst: Instruction, args: list[Any], state: _AdaptiveState) -> list[Any]:
    a = inst.attrs
    x = args[0]
    h, w = int(x.shape[-2]), int(x.shape[-1])
    oh = h if a["output_size"][0] is None else int(a["output_size"][0])
    ow = w if a["output_size"][1] is None else int(a["output_size"][1])
    win = state.windows.get((h, w))
    if win is None:
        # a handful of tiny tensor ops, costly next to a batch-1 global pool: once per input size
        hs, he = adaptive_bounds(h, oh)
        ws, we = adaptive_bounds(w, ow)
        count = (he - hs)[:, None] * (we - ws)[None, :]
        factors = _window_factors(count, state.multipliers, state.shifts, inst.source)
        win = state.windows[(h, w)] = (hs, he, ws, we, factors)
    hs, he, ws, we, factors = win
    if oh == 1 and ow == 1:
        sums = _global_sums_native(x)
        codes = None if sums is None else _global_mean_native(x, sums, state, str(a["out_dtype"]))
        if codes is not None:
            return [codes]
        if sums is None:
            sums = x.to(_sum_dtype(x, h * w)).sum(dim=(-2, -1), keepdim=True)
    else:
        # integral image: every window sum from four corner reads (exact in float64)
        cs = F.pad(x.to(torch.float64).cumsum(-2).cumsum(-1), (1, 0, 1, 0))
        sums = (
            cs[..., he[:, None], we[None, :]]
            - cs[..., hs[:, None], we[None, :]]
            - cs[..., he[:, None], ws[None, :]]
            + cs[..., hs[:, None], ws[None, :]]
        )
    return [_requant_windows(sums, factors, str(a["out_dtype"]))]


@register_kernel(
    "reduce_sum",
    schema=KernelSchema(
        attrs={
            "dims": optional(ints(-MAX_INDEX, MAX_INDEX, (1, 8))),
            "keepdim": boolean(),
            "n": optional(integer(1, 2**40), required=False),
            "multiplier": MULT,
            "shift": SHIFT,
            "out_dtype": OUT_DTYPE,
        },
        shape=_reduce_sum_shape,
    ),
)
def reduce_sum(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """Exact int64 sum over ``dims`` (all when None), requantized; ``n`` pins the mean's element count."""
    a = inst.attrs
    x = args[0]
    dims = a.get("dims")
    acc = x.to(torch.int64).sum() if dims is None else x.to(torch.int64).sum(dim=list(dims), keepdim=bool(a["keepdim"]))
    if a.get("n") is not None and x.numel() // max(acc.numel(), 1) != int(a["n"]):
        raise ValueError(
            f"reduce_sum ({inst.source}): the program averages over {a['n']} elements, the input has "
            f"{x.numel() // max(acc.numel(), 1)}; the input shape differs from the compiled one"
        )
    rq = RequantF64(torch.tensor(int(a["multiplier"])), torch.tensor(int(a["shift"])))
    lo, hi = qbounds(str(a["out_dtype"]))
    return [sat_to(rq.apply(acc.to(torch.float64)).clamp_(lo, hi), str(a["out_dtype"]))]
