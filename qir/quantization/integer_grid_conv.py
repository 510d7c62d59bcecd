"""One autograd node for the activation-sized work of a bound conv on the integer grid.

The unfused forward of :func:`qir.quantization.integer_grid.conv_forward` chains four autograd
functions and the convolution (input codes, the convolution, bias codes, requantization), each with
its own Python and dispatch overhead: on the small layers of mobilenet_v2 that fixed cost is most of
the training step's overhead. :class:`ConvRequant` computes the same values in one node:

* forward: the input codes ``round(x · (1/s_in))`` (block by block), the convolution of the codes,
  then ``plan(acc)`` (the caller's: the output observer's update and the requantization constants,
  computed after the accumulator exists because the output scale depends on it), then the
  requantization :func:`requant_blocks`;
* backward: ``g = grad · gain`` (``gain``: the accumulator's gradient factor where the output was not
  clamped), the bias gradient ``sum(g) / (s_acc / s_in)`` and ``aten.convolution_backward`` of ``g``,
  the very calls autograd makes for the unfused chain, so the gradients are equal bit for bit
  (tests/quantization/test_integer_grid_fused.py compares both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from qir.quantization.blockwise import blocks, part
from qir.quantization.integer_grid_native import native_codes, native_fused_add, native_requant

__all__ = [
    "AddConstants",
    "ConvAddRequant",
    "ConvGeometry",
    "ConvRequant",
    "RequantConstants",
    "fused_add_blocks",
    "input_codes",
    "requant_blocks",
]


class RequantConstants(NamedTuple):
    """What :func:`requant_blocks` needs, broadcasting against the accumulator: ``offset`` (float64,
    ``bias_codes · ratio + 1/2``), ``ratio`` (float64, ``M / 2**shift``), the clamp ``lo`` / ``hi``
    (ints or float32 tensors), the output scale and the accumulator's gradient factor (float32)."""

    offset: torch.Tensor
    ratio: torch.Tensor
    lo: Any
    hi: Any
    out_scale: torch.Tensor | float
    acc_grad: torch.Tensor


class ConvGeometry(NamedTuple):
    """A plain (not transposed) convolution's arguments, for ``conv`` and ``aten.convolution_backward``."""

    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int


#: ``grad where lo < x < hi, else 0`` (broadcasting ``grad`` against ``x``) in one pass, written to ``grad_input``
_PASS_INSIDE = torch.ops.aten.hardtanh_backward.grad_input


def input_codes(x: torch.Tensor, inv_scale: torch.Tensor | float) -> torch.Tensor:
    """``round(x · inv_scale)`` of a tensor already on the grid of ``1 / inv_scale``, block by block
    (the product rounded while it is in cache), or in one native pass where that applies."""
    fast = native_codes(x, inv_scale)
    if fast is not None:
        return fast
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    nd = x.dim()
    for idx in blocks(x.shape):
        # x = q * s up to float32 rounding: |x/s - q| < 0.02
        torch.mul(part(x, idx, nd), inv_scale, out=out[idx]).round_()
    return out


def requant_blocks(
    acc: torch.Tensor, c: RequantConstants, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clamp(floor(acc · ratio + offset), lo, hi) · out_scale, gain)`` evaluated exactly in float64
    block by block; ``gain`` is ``acc_grad`` where the result was not clamped, else 0 (a float tensor:
    multiplying by it is vectorized, masking by a bool tensor is not; with number bounds one pass
    computes it). ``out``: the float32 tensor the result is written to, ``acc`` itself when the caller
    has no further use for the accumulator (each block is read before it is written); a new one
    when None. Only the results are allocated at full size. One native pass computes both where it
    applies (:mod:`qir.quantization.integer_grid_native`: int bounds, per-channel constants)."""
    if out is None:
        out = torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
    fast = native_requant(acc, c.ratio, c.offset, c.lo, c.hi, c.out_scale, c.acc_grad, out)
    if fast is not None:
        return out, fast
    gain = torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
    nd = acc.dim()
    q = qc = torch.empty(0)  # scratch blocks, reused: the blocks but the last have one shape
    for idx in blocks(acc.shape):
        a = acc[idx]
        if q.shape != a.shape:
            q = torch.empty(a.shape, dtype=torch.float64, device=acc.device)
        # exact: products and sums below 2**53 (mul_ then add_: addcmul with per-channel operands
        # takes torch's unvectorized loop, 2-3x slower than the two passes)
        q.copy_(a).mul_(part(c.ratio, idx, nd)).add_(part(c.offset, idx, nd))
        o = out[idx]
        o.copy_(q.floor_())  # |q| <= 2**31: float32 keeps lo / hi right
        lo, hi = part(c.lo, idx, nd), part(c.hi, idx, nd)
        if isinstance(lo, int) and isinstance(hi, int):
            # one pass for `acc_grad where lo <= o <= hi, else 0`: o holds integers, so the strict
            # test of hardtanh's gradient against lo - 1/2 and hi + 1/2 is that one (same bits)
            _PASS_INSIDE(part(c.acc_grad, idx, nd), o, lo - 0.5, hi + 0.5, grad_input=gain[idx])
            o.clamp_(lo, hi).mul_(c.out_scale)
            continue
        if qc.shape != a.shape:
            qc = torch.empty(a.shape, dtype=torch.float32, device=acc.device)
        # tensor bounds (ReLU6's per channel; a high-precision output's lower bound is a number): torch's clamp
        # takes two numbers or two tensors, so a number beside a tensor becomes a 0-d float32 tensor (same value)
        lo_t = lo if isinstance(lo, torch.Tensor) else torch.tensor(float(lo), dtype=torch.float32)
        hi_t = hi if isinstance(hi, torch.Tensor) else torch.tensor(float(hi), dtype=torch.float32)
        torch.clamp(o, lo_t, hi_t, out=qc)
        torch.eq(qc, o, out=gain[idx]).mul_(part(c.acc_grad, idx, nd))
        torch.mul(qc, c.out_scale, out=o)
    return out, gain


class ConvRequant(torch.autograd.Function):
    """``requant(conv(round(x / s_in), wq) + bias codes) · s_out`` with the straight-through gradient,
    as one autograd node (see the module docstring).

    ``x``: the input, on the grid of ``s_in``; ``wq``: the weight codes (their own autograd node
    scales the gradient by ``s_in / s_w``); ``bias``: the float bias or None (only its gradient is
    computed here: ``plan`` quantizes it); ``bias_div``: ``s_acc / s_in`` per output channel (float64),
    the divisor of the bias gradient; ``plan(acc)``: the output observer's update and the
    :class:`RequantConstants` (called once, after the convolution).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        wq: torch.Tensor,
        bias: torch.Tensor | None,
        inv_scale: float,
        geometry: ConvGeometry,
        bias_div: torch.Tensor,
        out_axis: int,
        plan: Callable[[torch.Tensor], RequantConstants],
    ) -> torch.Tensor:
        xq, acc = _codes_conv(x, wq, inv_scale, geometry)
        out, gain = requant_blocks(acc, plan(acc), out=acc)  # the accumulator is not needed afterwards
        ctx.save_for_backward(xq, wq, gain, bias_div)
        _keep_geometry(ctx, geometry, acc, out_axis)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xq, wq, gain, bias_div = ctx.saved_tensors
        gx, gw, gb = _conv_backward(ctx, grad * gain, xq, wq, bias_div)
        return gx, gw, gb, None, None, None, None, None


class AddConstants(NamedTuple):
    """What :func:`fused_add_blocks` needs, broadcasting against the accumulator: the clamp of the
    accumulator ``acc_lo`` / ``acc_hi`` (``∓T - bias codes``, in the accumulator's dtype), ``r1``
    (float64, ``M1 / 2**s1`` per channel), ``off1`` (float64, ``bias codes · r1 + 1/2``), ``r2``
    (float64, ``M2 / 2**s2``, dimensioned so that float32 codes times it promote), the addend's
    ``1 / s_add``, the intermediate's ``extra_bits``, the output clamp ``lo`` / ``hi`` and scale."""

    acc_lo: torch.Tensor
    acc_hi: torch.Tensor
    r1: torch.Tensor
    off1: torch.Tensor
    r2: torch.Tensor
    inv_add: torch.Tensor
    extra_bits: int
    lo: int
    hi: int
    out_scale: torch.Tensor | float


def fused_add_blocks(
    acc: torch.Tensor, addend: torch.Tensor, c: AddConstants, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused conv + add rule in float64, block by block: ``(codes · out_scale, keep)`` with
    ``keep`` 1 where the output was not clamped, else 0. ``a = clamp(acc, acc_lo, acc_hi)``, then
    ``mid1 = floor(a·r1 + off1)``, ``mid2 = floor(round(addend / s_add)·r2 + 1/2)`` and
    ``out = clamp(floor((mid1 + mid2)·2**-extra_bits + 1/2), lo, hi)``, each exact in float64 where
    the caller checked the bounds (``integer_grid._fused_add_float64``). ``out``: as for
    :func:`requant_blocks`. One native pass computes both where it applies
    (:mod:`qir.quantization.integer_grid_native`: contiguous float32 tensors, per-channel constants)."""
    if out is None:
        out = torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
    fast = native_fused_add(acc, addend, c, out)
    if fast is not None:
        return out, fast
    keep = torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
    nd = acc.dim()
    one = torch.ones((), dtype=torch.float32, device=acc.device)
    for idx in blocks(acc.shape):
        a = acc[idx].clamp(part(c.acc_lo, idx, nd), part(c.acc_hi, idx, nd)).to(torch.float64)
        a.mul_(part(c.r1, idx, nd)).add_(part(c.off1, idx, nd)).floor_()  # mid1, exact
        codes = torch.mul(part(addend, idx, nd), c.inv_add).round_().to(torch.float64)
        a.add_(codes.mul_(c.r2).add_(0.5).floor_())  # + mid2, exact
        o = out[idx]
        o.copy_(a.mul_(2.0**-c.extra_bits).add_(0.5).floor_())
        # keep: 1 where lo <= o <= hi (o holds integers: hardtanh's strict test at lo - 1/2, hi + 1/2)
        _PASS_INSIDE(one, o, c.lo - 0.5, c.hi + 0.5, grad_input=keep[idx])
        o.clamp_(c.lo, c.hi).mul_(c.out_scale)
    return out, keep


class ConvAddRequant(torch.autograd.Function):
    """The fused conv + add, ``act(conv(x) + addend)`` on the integer grid, as one autograd node: what
    :class:`ConvRequant` is to the plain conv.

    ``x``, ``wq``, ``bias``, ``inv_scale``, ``geometry``, ``bias_div``, ``out_axis``: as for
    :class:`ConvRequant`; ``addend``: the float addend (on its fake quant's grid); ``acc_grad``: the
    accumulator's gradient factor per channel (``s_w``, float32); ``finish(acc, addend)``: the output
    observer's update and the fused-add rule, returning ``(output, keep)`` (``keep``: 1 where the
    output was not clamped). Backward: ``g = grad · keep`` to the addend, ``g · acc_grad`` to the
    accumulator (then to the bias, the input and the weight codes as in :class:`ConvRequant`): the
    calls autograd makes for the unfused chain, so the gradients are equal bit for bit.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        wq: torch.Tensor,
        bias: torch.Tensor | None,
        addend: torch.Tensor,
        inv_scale: float,
        geometry: ConvGeometry,
        bias_div: torch.Tensor,
        acc_grad: torch.Tensor,
        out_axis: int,
        finish: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        xq, acc = _codes_conv(x, wq, inv_scale, geometry)
        out, keep = finish(acc, addend)  # written into acc
        ctx.save_for_backward(xq, wq, keep, acc_grad, bias_div)
        _keep_geometry(ctx, geometry, acc, out_axis)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xq, wq, keep, acc_grad, bias_div = ctx.saved_tensors
        g = grad * keep
        gx, gw, gb = _conv_backward(ctx, g * acc_grad, xq, wq, bias_div)
        return gx, gw, gb, g if ctx.needs_input_grad[3] else None, None, None, None, None, None, None


def _codes_conv(
    x: torch.Tensor, wq: torch.Tensor, inv_scale: float, g: ConvGeometry
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward both nodes share: the input codes and their convolution with the weight codes."""
    xq = input_codes(x, inv_scale)
    acc = torch.convolution(xq, wq, None, g.stride, g.padding, g.dilation, False, [0] * len(g.stride), g.groups)
    return xq, acc


def _keep_geometry(ctx: Any, g: ConvGeometry, acc: torch.Tensor, out_axis: int) -> None:
    """What :func:`_conv_backward` reads besides the saved tensors: the geometry and the broadcast bias
    codes' shape (their gradient is the accumulator's summed to it)."""
    ctx.geometry = g
    shape = [1] * acc.dim()
    ax = out_axis % acc.dim()
    shape[ax] = acc.shape[ax]
    ctx.bias_shape = torch.Size(shape)


def _conv_backward(
    ctx: Any, ga: torch.Tensor, xq: torch.Tensor, wq: torch.Tensor, bias_div: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The input, weight and bias gradients from the accumulator's ``ga``: the bias's summed and divided
    by ``s_acc / s_in``, the others by ``aten.convolution_backward``, as autograd does for the chain."""
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    gx = gw = gb = None
    if need_b:
        gb = (ga.sum_to_size(ctx.bias_shape).reshape(-1) / bias_div).to(torch.float32)
    if need_x or need_w:
        c = ctx.geometry
        out_pad = [0] * len(c.stride)
        gx, gw, _ = torch.ops.aten.convolution_backward(
            ga, xq, wq, None, c.stride, c.padding, c.dilation, False, out_pad, c.groups, [need_x, need_w, False]
        )
    return gx, gw, gb
