"""QAT training on the integer grid: conv / linear forwards compute what the converted model computes.

Float fake quantization is exact at every quantize point but not between them: a conv's
float bias and float accumulator, and float rescaling instead of the integer multiplier and
shift, leave up to one LSB per layer that compounds with depth. On the integer grid a
bound conv / linear module (``prepare_qat_fx`` binds every one whose inputs' scales it can
trace to a fake quant) computes, in its QAT forward:

* input codes ``x / s_in`` (the producer's fake quant put ``x`` on that grid) and weight codes
  ``saturate(floor(w / s_w + 1/2))`` at the weight fake quant's per-channel scale,
* the accumulator ``conv(codes, weight codes)`` exactly (float32 while every partial sum
  stays below ``2**24``, else summed over input-channel chunks that do, or float64),
* the bias as int32 at ``s_in * s_w`` (``numerics.quantize_bias``),
* the requantization with the converted module's multiplier and shift
  (``numerics.conv_requant_params`` / ``integer_rules.fused_add_params``) and half-up
  rounding, ReLU / ReLU6 folded into the clamp,

and returns ``codes * s_out``, with straight-through gradients (the gradient of the float
forward: the accumulator's gradient is scaled by ``s_in * s_w``, masked where the output
saturated or ReLU cut it). The observers update first, as in the float forward, so the
output of each step equals what ``convert_fx`` of the model's state after that step's
observer updates computes (docs/semantics.md, "Training on the integer grid").

    set_integer_grid(qat_model, False)   # opt out: float fake quantization in training
    integer_grid_report(qat_model)       # which modules train on the grid, and why not
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import (
    adaptive_pool_counts,
    avg_pool_divisor,
    avg_pool_params,
    check_out_dtype,
    fused_add_params,
    fused_add_params_np,
    fused_add_wide,
)
from qir.ir.types import DType
from qir.quantization.code_ops import constant_code
from qir.quantization.fake_quantize import (
    CalibFakeQuantize,
    FakeQuantize,
    FakeQuantState,
    fake_quantize,
    float_fake_quant_active,
    switch_epoch,
)
from qir.quantization.integer_grid_conv import (
    AddConstants,
    ConvAddRequant,
    ConvGeometry,
    ConvRequant,
    RequantConstants,
    fused_add_blocks,
    input_codes,
    requant_blocks,
)
from qir.quantization.integer_grid_methods import SCALAR_METHODS
from qir.quantization.integer_grid_native import native_abs_row_max, native_weight_codes
from qir.quantization.integer_grid_scales import acc_scales, host, out_scales
from qir.quantization.observer import (
    MinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
)
from qir.quantization.wrapped_modules import wrapped_input_stubs

__all__ = [
    "INTEGER_GRID_KEY",
    "GridBinding",
    "bind_integer_grid",
    "bind_sites",
    "grid_requantize",
    "grid_step",
    "integer_grid_report",
    "set_integer_grid",
    "source_of_module",
    "unbind_all",
]

#: ``GraphModule.meta`` key: False turns training on the integer grid off for that model
INTEGER_GRID_KEY = "qir.integer_grid"
_MARCH_KEY = "qir.integer_grid.march"
#: float32 represents every integer below this exactly
_F32_EXACT = 2**24
#: attribute of a bound module holding its :class:`GridBinding`
_ATTR = "integer_grid"
#: attribute of a bound module holding its :class:`GridTally`
_TALLY = "integer_grid_tally"
#: observers whose update depends on a batch's minimum and maximum only
_MIN_MAX_OBSERVERS = (MinMaxObserver, MovingAveragePerChannelMinMaxObserver, MovingAveragePerTensorMinMaxObserver)
#: FloatFunctional methods whose second operand is a number (not a grid input)
#: the fake quants whose forward the grid reproduces (a learnable-scale subclass is not one of them)
_PLAIN_FQ = (FakeQuantize, CalibFakeQuantize)


@dataclass
class GridBinding:
    """The fake quants that put a module's tensor inputs on their grids, and the march."""

    inputs: tuple[FakeQuantize, ...]
    march: str


# ---------------------------------------------------------------------------------------------
# binding: which fake quant's scale each conv / linear input carries (the scale walk of convert)


def _plain_fq(fq: Any) -> FakeQuantize | None:
    return fq if type(fq) in _PLAIN_FQ and fq.ch_axis is None else None


def source_of_module(m: nn.Module, first: FakeQuantize | None) -> FakeQuantize | None:
    """The per-tensor fake quant whose grid ``m``'s output is on (``first``: its first input's,
    for a scale-preserving module), or None."""
    from qir.quantization.scale_ops import PRESERVING_MODULES

    if callable(getattr(m, "output_fake_quants", None)):
        return None  # several outputs, several scales
    fq = getattr(m, "activation_post_process", None)
    if fq is not None:
        return _plain_fq(fq)
    if getattr(m, "is_scale_preserving", False) or isinstance(m, PRESERVING_MODULES):
        return first
    return None


def _functional_site(gm: torch.fx.GraphModule, n: torch.fx.Node) -> str | None:
    """The module path of a FloatFunctional method call (``self.ff.mul(x, y)`` traces to a
    call_method on the module's get_attr), or None."""
    owner = n.args[0] if n.op == "call_method" and n.args else None
    if not isinstance(owner, torch.fx.Node) or owner.op != "get_attr":
        return None
    try:
        m = gm.get_submodule(str(owner.target))
    except AttributeError:  # a method of a buffer or parameter (``self.grid.repeat(b, 1, 1, 1)``), not of a module
        return None
    return str(owner.target) if getattr(type(m), "grid_inputs", 0) < 0 else None


def _trace_sources(
    gm: torch.fx.GraphModule,
) -> tuple[dict[str, list[list[FakeQuantize | None]]], dict[str, set[str]]]:
    """Per called module path: per call site, the source fake quant of each tensor argument; and per
    FloatFunctional path, the methods called."""
    from qir.quantization.scale_ops import is_preserving_call

    src: dict[str, FakeQuantize | None] = {}
    sites: dict[str, list[list[FakeQuantize | None]]] = {}
    methods: dict[str, set[str]] = {}
    for n in gm.graph.nodes:
        ins = [a for a in n.args if isinstance(a, torch.fx.Node)]
        first = src.get(ins[0].name) if ins else None
        ff = _functional_site(gm, n)
        if n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            if getattr(type(m), "grid_inputs", 0) < 0:  # its tensor arguments, a tuple's flattened (cell(x, (h, c)))
                ins = []
                torch.fx.node.map_arg(n.args, ins.append)
                # a whole multi-output value (cell(x, hx) with hx another cell's (h, c)) is its outputs
                sites.setdefault(str(n.target), []).append([fq for a in ins for fq in _whole_sources(gm, a, src)])
            else:
                sites.setdefault(str(n.target), []).append([src.get(a.name) for a in ins])
            src[n.name] = source_of_module(m, first)
        elif ff is not None:  # its tensor operands, a cat's list flattened
            operands: list[torch.fx.Node] = []
            torch.fx.node.map_arg((n.args[1:], n.kwargs), operands.append)  # in order, repeats kept
            if str(n.target) in SCALAR_METHODS:  # x + w / 4: the number may be a node computed from sizes
                operands = operands[:1]
            sites.setdefault(ff, []).append([src.get(a.name) for a in operands])
            methods.setdefault(ff, set()).add(str(n.target))
            src[n.name] = source_of_module(gm.get_submodule(ff), None)
        elif (out := _output_source(gm, n)) is not None:
            src[n.name] = out
        elif n.op in ("call_function", "call_method") and is_preserving_call(n):
            src[n.name] = first
        else:
            src[n.name] = None
    return sites, methods


def _whole_sources(
    gm: torch.fx.GraphModule, n: torch.fx.Node, src: dict[str, FakeQuantize | None]
) -> list[FakeQuantize | None]:
    """The source fake quant of each tensor the value ``n`` holds: one per output of a module with one
    fake quant per output (an LSTM cell's ``(h, c)`` passed whole), else ``n``'s own."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        fqs = getattr(m, "output_fake_quants", None)
        if callable(fqs):
            return [output_fake_quant(m, i) for i in range(len(fqs()))]
    return [src.get(n.name)]


def _output_source(gm: torch.fx.GraphModule, n: torch.fx.Node) -> FakeQuantize | None:
    """``out[i]`` of a module with one fake quant per output (attention's ``(out, weights)``): that
    output's per-tensor fake quant; None for anything else."""
    if n.op != "call_function" or n.target is not operator.getitem or len(n.args) != 2:
        return None
    owner, index = n.args
    if not isinstance(owner, torch.fx.Node) or owner.op != "call_module" or not isinstance(index, int):
        return None
    return output_fake_quant(gm.get_submodule(str(owner.target)), index)


def output_fake_quant(m: nn.Module, index: int) -> FakeQuantize | None:
    """Output ``index``'s per-tensor fake quant of a module with one fake quant per output
    (``output_fake_quants()``: attention's ``(out, weights)``); None for any other module or index."""
    fqs = getattr(m, "output_fake_quants", None)
    outs = fqs() if callable(fqs) else ()
    return _plain_fq(outs[index]) if 0 <= index < len(outs) else None


def bind_integer_grid(gm: torch.fx.GraphModule, march: str) -> dict[str, str]:
    """Bind every grid-capable module of ``gm`` (class attribute ``grid_inputs``) whose tensor
    inputs come from known fake quants; in place. Returns ``{path: reason}`` for those left on
    float fake quantization."""
    sites, methods = _trace_sources(gm)
    for path, stub in wrapped_input_stubs(gm).items():  # a wrapped method's module: on its input stub's grid
        sites[path] = [[_plain_fq(getattr(stub, "activation_post_process", None))]]
    unbound = bind_sites(gm, sites, methods, march)
    gm.meta[INTEGER_GRID_KEY] = True
    gm.meta[_MARCH_KEY] = march
    return unbound


def bind_sites(
    root: nn.Module, sites: dict[str, list[list[FakeQuantize | None]]], methods: dict[str, set[str]], march: str
) -> dict[str, str]:
    """Bind every grid-capable module of ``root`` from ``sites`` (per module path, per call site, the
    source fake quant of each tensor argument; ``methods``: per FloatFunctional path, the methods
    called); in place. ``{path: reason}`` for the modules left on float fake quantization."""
    unbound: dict[str, str] = {}
    for path, m in grid_modules(root):
        want = getattr(type(m), "grid_inputs", 0)
        _set_binding(m, None)
        calls = sites.get(path)
        if not calls:
            unbound[path] = "not called in the graph"
            continue
        if want < 0:  # a FloatFunctional: the operands of its call site, for the methods the grid computes
            off = sorted(methods.get(path, set()) - getattr(type(m), "grid_methods", frozenset()))
            if off:
                unbound[path] = f"FloatFunctional.{off[0]} trains with float fake quantization"
                continue
            want = len(calls[0])
        first = calls[0][:want]
        if any(len(c) < want or any(a is not b for a, b in zip(c[:want], first, strict=True)) for c in calls):
            unbound[path] = "called at several places with inputs of different scales"
            continue
        if len(first) < want or any(s is None for s in first):
            unbound[path] = "an input's scale does not come from a per-tensor fake quant the scale walk can follow"
            continue
        refuse = getattr(type(m), "grid_refusal", None)  # a method without an integer form on these inputs
        why = refuse(m, methods.get(path, set()), first) if refuse is not None else None
        if why is not None:
            unbound[path] = why
            continue
        _set_binding(m, GridBinding(tuple(s for s in first if s is not None), march))
    return unbound


def grid_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The grid-capable modules of ``root`` (class attribute ``grid_inputs``), except those inside another
    one: a composed module (attention's softmax) computes its parts on the grid itself."""
    found: list[tuple[str, nn.Module]] = []
    for path, m in root.named_modules():
        if getattr(type(m), "grid_inputs", 0) and not any(path.startswith(f"{p}.") for p, _ in found if p):
            found.append((path, m))
    return found


def unbind_all(model: nn.Module) -> None:
    """Every module of ``model`` back on float fake quantization."""
    for m in model.modules():
        if getattr(type(m), "grid_inputs", 0):
            _set_binding(m, None)


def _set_binding(m: nn.Module, b: GridBinding | None) -> None:
    # a plain instance attribute: the binding refers to fake quants the model owns elsewhere,
    # so it must not register them as submodules (deepcopy maps the references to the copies)
    m.__dict__[_ATTR] = b
    m.__dict__[_TALLY] = GridTally()


@dataclass
class GridTally:
    """How a bound module's QAT forwards ran since it was bound: on the grid, or fallen back to float
    fake quantization (the float forward) because the grid forward did not apply to that call."""

    on_grid: int = 0
    fell_back: int = 0


class FellBack(Exception):
    """Raised inside a :func:`grid_step` forward that computed its result with float fake quantization
    after all (``result``: a tensor, or a module's tuple of outputs): counted as a fallback, and
    ``result`` is returned."""

    def __init__(self, result: Any) -> None:
        super().__init__("integer grid: float fake quantization for this call")
        self.result = result


_F = TypeVar("_F", bound=Callable[..., Any])


def grid_step(fn: _F) -> _F:
    """Count each call of a module's integer-grid forward ``fn(m, ...)`` in ``m``'s :class:`GridTally`:
    on the grid when it returns a tensor (or True, for the ``applies`` hooks), fallen back when it
    returns None / False (the module's float forward runs) or raises :class:`FellBack`. Only calls
    of a bound module in QAT state count (input fake quants on, not in validation, no
    :func:`~qir.quantization.fake_quantize.float_fake_quant` block): a calibration or validation
    forward is not a training step. :func:`integer_grid_report` reads the tally."""

    @functools.wraps(fn)
    def run(m: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(m, *args, **kwargs)
            ran = out is not None and out is not False
        except FellBack as fb:
            out, ran = fb.result, False
        binding: GridBinding | None = m.__dict__.get(_ATTR)
        if binding is not None and not float_fake_quant_active() and _on(list(binding.inputs)):
            tally: GridTally = m.__dict__.setdefault(_TALLY, GridTally())
            if ran:
                tally.on_grid += 1
            else:
                tally.fell_back += 1
        return out

    return run  # type: ignore[return-value]


def set_integer_grid(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Train ``model`` (a ``prepare_qat_fx`` result) on the integer grid (default) or with float
    fake quantization (``enabled=False``, a little faster), in place. An eager ``prepare_qat``
    model too (its bindings come from its recorded forwards: qir.quantization.eager_grid)."""
    eager = _eager_forward(model)
    if eager is not None:
        eager.set_integer_grid(enabled)
        return model
    if not isinstance(model, torch.fx.GraphModule) or INTEGER_GRID_KEY not in model.meta:
        raise TypeError(
            f"{type(model).__name__} is not a model made by prepare_qat_fx or prepare_qat: training on the "
            "integer grid needs the prepared model"
        )
    if enabled:
        bind_integer_grid(model, model.meta[_MARCH_KEY])
    else:
        unbind_all(model)
        model.meta[INTEGER_GRID_KEY] = False
    return model


def _eager_forward(model: nn.Module) -> Any:
    """An eager QAT model's instance ``forward`` (qir.quantization.eager.ExactForward), or None."""
    fwd = model.__dict__.get("forward")
    return fwd if callable(getattr(fwd, "set_integer_grid", None)) else None


def integer_grid_report(model: nn.Module) -> dict[str, str]:
    """``{path: "grid" | reason}`` for every grid-capable module of a prepared model.

    A bound module is ``"grid"`` while every QAT forward it ran since it was bound computed on the
    grid; once one fell back to float fake quantization (its grid forward did not apply to that
    call: an operand that is not float32, scales the integer rule refuses, a requantization ratio
    the march cannot express that step...) it reads ``"float fake quant in F of N forwards since
    binding"``."""
    eager = _eager_forward(model)
    if eager is not None:
        on = bool(eager.integer_grid)
    elif isinstance(model, torch.fx.GraphModule):
        on = model.meta.get(INTEGER_GRID_KEY) is True
    else:
        raise TypeError(f"integer_grid_report takes a prepare_qat_fx or prepare_qat model, got {type(model).__name__}")
    if not on:
        return {p: "integer grid off" for p, _ in grid_modules(model)}
    out: dict[str, str] = {}
    for path, m in grid_modules(model):
        if m.__dict__.get(_ATTR) is None:
            out[path] = "float fake quant"
            continue
        tally = m.__dict__.get(_TALLY) or GridTally()
        n = tally.on_grid + tally.fell_back
        out[path] = (
            f"float fake quant in {tally.fell_back} of {n} forwards since binding" if tally.fell_back else "grid"
        )
    return out


# ---------------------------------------------------------------------------------------------
# the arithmetic


def _on(fqs: list[FakeQuantize]) -> bool:
    """Fake quantization on, and not in validation state (there the integer twin computes, or the
    float simulation when exact validation is off: qir.quantization.exact_validation)."""
    return all(f.fake_quant_enabled and f.state is not FakeQuantState.VALIDATION for f in fqs)


def _observe(fq: FakeQuantize, x: torch.Tensor) -> None:
    """What :meth:`FakeQuantize.forward` does before quantizing: update the observer and the scale."""
    if fq.observer_enabled and not fq.has_fixed_scale:
        fq.observer(x.detach())
        fq._take_observer_scale()


class _Codes(torch.autograd.Function):
    """``round(x / s)`` of a tensor already on the grid of ``s``; gradient ``grad / s``, or ``grad`` itself
    with ``scaled=False`` when the caller already divided the gradient reaching the codes by ``s`` (the
    conv forward folds ``1 / s_in`` into its requantization's factor: one pass over the input less)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, inv_scale: torch.Tensor, scaled: bool = True) -> torch.Tensor:
        ctx.save_for_backward(inv_scale)
        ctx.scaled = scaled
        return input_codes(x, inv_scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not ctx.scaled:
            return grad, None, None
        (inv,) = ctx.saved_tensors
        return grad * inv, None, None


class _WeightCodes(torch.autograd.Function):
    """``saturate(floor(w / s + 1/2))`` per channel, float; gradient ``grad · s_in / s`` where not saturated
    (``s_in``: the factor the conv forward took out of the accumulator's gradient, see :class:`_Codes`)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int, s_in: float) -> torch.Tensor:
        fast = native_weight_codes(w, scale, qmin, qmax, s_in)  # one pass instead of eight, where it applies
        if fast is not None:
            ctx.save_for_backward(fast[1])
            return fast[0]
        q = numerics.round_half_up(w / scale)  # the same float32 division numerics.quantize makes
        qc = q.clamp(qmin, qmax)
        # computed now: a second call of a shared module updates the fake quant's scale in place
        ctx.save_for_backward(torch.where(qc == q, s_in / scale, 0.0))
        return qc

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (factor,) = ctx.saved_tensors
        return grad * factor, None, None, None, None


class _Requant(torch.autograd.Function):
    """``clamp(floor((acc + bias) * M / 2**shift + 1/2), lo, hi) * s_out``, evaluated exactly in float64.

    ``acc`` holds integers (float32 or float64); ``bias`` (int32 codes) and ``ratio = M / 2**shift``
    are float64 tensors that broadcast against it (per channel, or per position for pools).
    ``(acc + bias) * M + 2**(shift - 1)`` stays below ``2**53`` (``|acc + bias| < 2**31``,
    ``M < 2**16``) and scaling by ``2**-shift`` is exact, so the float64 evaluation equals
    ``numerics.requantize`` (tested bit for bit); ReLU / ReLU6 are ``lo`` / ``hi``. Gradient
    (straight through): ``grad * acc_scale`` where the result was not clamped, to ``acc`` and,
    summed to its shape, to ``bias``. The chain runs block by block (:mod:`qir.quantization.blockwise`): only the
    result and the clamp mask are allocated at full size.
    """

    @staticmethod
    def forward(
        ctx: Any,
        acc: torch.Tensor,
        bias: torch.Tensor,
        ratio: torch.Tensor,
        lo: torch.Tensor | int,
        hi: torch.Tensor | int,
        out_scale: torch.Tensor,
        acc_scale: torch.Tensor,
    ) -> torch.Tensor:
        off = bias.to(torch.float64) * ratio + 0.5
        out, gain = requant_blocks(acc, RequantConstants(off, ratio, lo, hi, out_scale, acc_scale))
        ctx.save_for_backward(gain)
        ctx.bias_shape = bias.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (gain,) = ctx.saved_tensors
        g = grad * gain
        gb = g.sum_to_size(ctx.bias_shape) if ctx.needs_input_grad[1] else None
        return g if ctx.needs_input_grad[0] else None, gb, None, None, None, None, None


class _FusedAdd64(torch.autograd.Function):
    """The fused conv + add rule evaluated exactly in float64 (the caller checked the bounds).

    ``a = clamp(acc + bias, ±T)`` per channel, where ``T`` is so large that every ``|a| >= T``
    saturates the output whatever the addend (so clamping changes no result); then
    ``mid1 = floor(a·M1/2**s1 + 1/2)``, ``mid2 = floor(codes·M2/2**s2 + 1/2)`` and
    ``out = floor((mid1 + mid2)/2**p + 1/2)``, each exact in float64 because ``T·M1 + 2**(s1-1)`` and
    ``max|codes|·M2 + 2**(s2-1)`` stay below ``2**52``. Equal to ``integer_rules.fused_add_int``
    (tested); gradients as :class:`_FusedAdd`.
    """

    @staticmethod
    def forward(
        ctx: Any,
        acc: torch.Tensor,
        bias: torch.Tensor,
        addend: torch.Tensor,
        inv_add_scale: torch.Tensor,
        acc_lo: torch.Tensor,
        acc_hi: torch.Tensor,
        r1: torch.Tensor,
        r2: torch.Tensor,
        extra_bits: int,
        lo: int,
        hi: int,
        out_scale: torch.Tensor,
        acc_scale: torch.Tensor,
    ) -> torch.Tensor:
        off1 = bias * r1 + 0.5
        c = AddConstants(acc_lo, acc_hi, r1, off1, r2, inv_add_scale, extra_bits, lo, hi, out_scale)
        out, keep = fused_add_blocks(acc, addend, c)
        ctx.save_for_backward(keep, acc_scale)
        ctx.bias_shape = bias.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        keep, acc_scale = ctx.saved_tensors
        g = grad * keep
        ga = g * acc_scale
        gb = ga.sum_to_size(ctx.bias_shape) if ctx.needs_input_grad[1] else None
        return (ga, gb, g) + (None,) * 10


class _FusedAdd(torch.autograd.Function):
    """The fused conv + add rule (``integer_rules.fused_add_int``, int64) and the activation's clamp.

    Gradient (straight through, as the float forward ``act(acc * s_acc + addend)``):
    ``grad * acc_scale`` to ``acc`` (and per channel to ``bias``), ``grad`` to ``addend``, where
    the result is inside the output range and the activation passed it.
    """

    @staticmethod
    def forward(
        ctx: Any,
        acc: torch.Tensor,
        bias: torch.Tensor,
        addend: torch.Tensor,
        inv_add_scale: torch.Tensor,
        params: Any,
        dtype: DType,
        lo: int,
        hi: int,
        out_scale: torch.Tensor,
        acc_scale: torch.Tensor,
        axis: int,
    ) -> torch.Tensor:
        out, inside = _fused_add_int64(acc, bias, addend, inv_add_scale, params, dtype, lo, hi, out_scale, axis)
        ctx.save_for_backward(inside, acc_scale)
        ctx.bias_shape = bias.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inside, acc_scale = ctx.saved_tensors
        g = grad * inside
        ga = g * acc_scale
        gb = ga.sum_to_size(ctx.bias_shape) if ctx.needs_input_grad[1] else None
        return ga, gb, g, None, None, None, None, None, None, None, None


def _fused_add_int64(
    acc: torch.Tensor,
    bias: torch.Tensor,
    addend: torch.Tensor,
    inv_add_scale: torch.Tensor,
    params: Any,
    dtype: DType,
    lo: int,
    hi: int,
    out_scale: torch.Tensor,
    axis: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`_FusedAdd`'s forward: ``(codes · out_scale, inside)``, ``inside`` (float32) 1 where the
    rule's value before saturation is inside ``[lo, hi]`` (a subrange of ``dtype``'s: the dtype's
    saturation and the activation's clamp are one clamp), else 0: the straight-through rule of the
    float64 path, which also passes the gradient at a code exactly at the dtype's limit."""
    a = acc.to(torch.int64) + bias.to(torch.int64)
    codes = torch.round(addend * inv_add_scale).to(torch.int64)
    wide = fused_add_wide(
        a, codes, params.acc_multiplier, params.acc_shift, params.add_multiplier, params.add_shift,
        params.extra_bits, axis,
    )  # fmt: skip
    d_lo, d_hi = dtype.qrange
    assert d_lo <= lo and hi <= d_hi, (lo, hi, dtype)
    qc = wide.clamp(lo, hi)
    inside = (qc == wide).to(torch.float32)
    return qc.to(torch.float32).mul_(out_scale), inside


class _BiasCodes(torch.autograd.Function):
    """``numerics.quantize_bias``: int32 codes at the accumulator scale (float64); gradient ``grad / grad_div``
    (``s_acc / s_in``: the conv forward took ``s_in`` out of the accumulator's gradient, see :class:`_Codes`)."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, s_acc: torch.Tensor, grad_div: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad_div)
        axis = 0 if s_acc.dim() and s_acc.numel() > 1 else None
        s = s_acc if axis is not None else s_acc.reshape(())
        return numerics.quantize(bias.detach().to(torch.float64), s, DType.qint32, axis=axis).to(torch.float64)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (div,) = ctx.saved_tensors
        return (grad / div).to(torch.float32), None, None


def grid_requantize(
    acc: torch.Tensor,
    bias: torch.Tensor,
    multiplier: torch.Tensor,
    shift: torch.Tensor,
    lo: int,
    hi: int,
    axis: int,
) -> torch.Tensor:
    """The codes the training forward computes from an accumulator, without autograd:
    ``clamp(requantize(acc + bias, multiplier, shift), lo, hi)`` through the float64 path
    (tests compare it with ``numerics.requantize``)."""
    ratio = torch.ldexp(multiplier.to(torch.float64), -shift.to(torch.int64)).reshape(-1)
    one = torch.ones((), dtype=torch.float32)
    r = numerics.broadcast_along(ratio, axis, acc.dim())
    b = numerics.broadcast_along(bias.reshape(-1).to(torch.float64), axis, acc.dim())
    out: torch.Tensor = _Requant.apply(acc, b, r, lo, hi, one, one)
    return out


# ---------------------------------------------------------------------------------------------
# conv / linear


def _chunks(w_abs_in: torch.Tensor, xmax: int) -> list[tuple[int, int]] | None:
    """Input-channel ranges whose partial sums stay below 2**24 (float32 is exact on them).

    ``w_abs_in``: float64 (out channels, in channels) sums of ``|weight codes|``; every partial
    sum of output channel ``o`` over a range is at most ``xmax * sum(w_abs_in[o, range])``.
    None: the whole reduction fits; ``[]``: a single input channel does not (float64 then).
    """
    budget = (_F32_EXACT - 1) / xmax
    if float(w_abs_in.sum(dim=1).max()) <= budget:
        return None
    n_in = w_abs_in.shape[1]
    cum = torch.cumsum(w_abs_in, dim=1)
    ranges: list[tuple[int, int]] = []
    start = 0
    while start < n_in:
        base = cum[:, start - 1 : start] if start else torch.zeros_like(cum[:, :1])
        fits = ((cum[:, start:] - base) <= budget).all(dim=0)
        k = int(fits.to(torch.int64).cumprod(0).sum())
        if k == 0:
            return []
        ranges.append((start, start + k))
        start += k
    return ranges


def _reduction_split(m: Any, kind: str, wq: torch.Tensor, xmax: int) -> list[tuple[int, int]] | None:
    """How :func:`_accumulate` sums the reduction exactly: None, in float32 in one piece; input-channel
    ranges (:func:`_chunks`), each in float32, added in float64; ``[]``, in float64."""
    groups = int(getattr(m, "groups", 1))
    per_out = wq.numel() // int(m.out_features if kind == "Linear" else m.out_channels)
    if per_out * 128 * xmax < _F32_EXACT:  # |w_codes| <= 128: no partial sum can reach 2**24
        return None
    # the largest output channel's sum of |w_codes| in one native pass: when it fits, the whole reduction
    # does (the torch path below sums the same integers exactly); else the torch path finds the chunks
    top = native_abs_row_max(wq.detach()) if kind != "ConvTranspose2d" else None
    if top is not None:
        if groups != 1:
            return None if top * xmax < _F32_EXACT else []
        if top <= (_F32_EXACT - 1) / xmax:
            return None
    w_abs = wq.detach().abs()
    if kind == "ConvTranspose2d":
        w_abs = w_abs.transpose(0, 1)
    w_abs_in = w_abs.reshape(w_abs.shape[0], w_abs.shape[1], -1).sum(dim=2).to(torch.float64)
    if groups == 1:
        return _chunks(w_abs_in, xmax)
    # grouped: the slices of one group are not contiguous in both tensors; no chunking
    return None if float(w_abs_in.sum(dim=1).max()) * xmax < _F32_EXACT else []


def _accumulate(
    m: Any, kind: str, xq: torch.Tensor, wq: torch.Tensor, split: list[tuple[int, int]] | None
) -> torch.Tensor:
    """The exact integer accumulator (bias excluded) as a float tensor, differentiable in ``xq`` and
    ``wq``, summed as ``split`` (:func:`_reduction_split`) says."""

    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if kind == "Linear":
            return F.linear(x, w)
        if kind == "ConvTranspose2d":
            return F.conv_transpose2d(x, w, None, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
        out: torch.Tensor = m._conv_forward(x, w, None)
        return out

    if split is None:
        return op(xq, wq)
    if not split:
        return op(xq.to(torch.float64), wq.to(torch.float64))
    x_axis = -1 if kind == "Linear" else 1
    w_in_axis = 0 if kind == "ConvTranspose2d" else 1
    sizes = [b - a for a, b in split]
    acc: torch.Tensor | None = None
    # split, not narrow: its backward concatenates the chunks' gradients in one pass
    for xc, wc in zip(xq.split(sizes, x_axis), wq.split(sizes, w_in_axis), strict=True):
        part = op(xc, wc).to(torch.float64)
        acc = part if acc is None else acc.add_(part)
    assert acc is not None
    return acc


def _observe_output(
    fq: FakeQuantize,
    acc: torch.Tensor,
    bias: torch.Tensor,
    acc_scale: torch.Tensor,
    act: str | None,
    addend: torch.Tensor | None,
) -> None:
    """The output fake quant observes the float value ``act((acc + bias) * acc_scale (+ addend))``
    (bias and acc_scale broadcast against acc)."""
    if not fq.observer_enabled or fq.has_fixed_scale:
        return
    with torch.no_grad():
        a = acc.detach()
        s = acc_scale.to(a.dtype)
        if addend is None and isinstance(fq.observer, _MIN_MAX_OBSERVERS) and a.dim() > 1 and a.numel():
            # a min-max observer sees only the extremes: per channel they are those of the
            # accumulator (s > 0), so two reductions replace a float copy of the output
            dims = [d for d in range(a.dim()) if s.shape[d] == 1]
            lo = torch.addcmul(bias * s, a.amin(dim=dims, keepdim=True), s).min()
            hi = torch.addcmul(bias * s, a.amax(dim=dims, keepdim=True), s).max()
            y = torch.stack([lo, hi]).to(torch.float32)
        else:
            y = torch.addcmul((bias * s).to(a.dtype), a, s).to(torch.float32)
        if addend is not None:
            y = y.add_(addend.detach())
        _observe_activated(fq, y, act)


def _observe_activated(fq: FakeQuantize, y: torch.Tensor, act: str | None) -> None:
    """The fake quant observes ``act(y)`` (``y``: the float32 values before the fused activation, or their
    extremes; clamped in place)."""
    if act == "relu":
        y = y.clamp_(min=0.0)
    elif act == "relu6":
        y = y.clamp_(0.0, 6.0)
    _observe(fq, y)


@grid_step
def conv_forward(m: Any, x: torch.Tensor, addend: torch.Tensor | None) -> torch.Tensor | None:
    """The integer-grid QAT forward of a bound conv / linear module ``m`` (a ``QATConvBase``), or
    None when it does not apply (not bound, a fake quant disabled or not a plain one, float64 input,
    inside :func:`~qir.quantization.fake_quantize.float_fake_quant`)."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or float_fake_quant_active() or x.dtype != torch.float32:
        return None
    wfq, ofq = m.weight_fake_quant, m.activation_post_process
    if (m.has_add and addend is None) or (addend is not None and addend.dtype != torch.float32):
        return None
    if not _conv_mode_on(m, binding, wfq, ofq):
        return None
    w = m.weight
    _observe(wfq, w)
    if wfq.scale.numel() == 0:
        return None  # the float forward raises the helpful error
    # the weight: codes at its per-channel scale (numerics.quantize's division, half up)
    s_w = wfq.scale
    w_axis = m.weight_axis if s_w.numel() > 1 else None
    # the input: codes of the producer's grid. Gradients: the accumulator's is the output's times
    # s_w (not s_in · s_w) where not clamped, so the codes pass it to x unscaled and the weight and
    # bias codes multiply theirs by s_in: the float forward's gradients without a pass over x
    in_fq = binding.inputs[0]
    s_in = float(host(in_fq.scale).reshape(-1)[0])
    wq = _WeightCodes.apply(w, numerics.broadcast_along(s_w, w_axis, w.dim()), wfq.qmin, wfq.qmax, s_in)
    kind = m.float_conv.__name__
    split = _reduction_split(m, kind, wq, max(-in_fq.qmin, in_fq.qmax))
    # CPU (numpy reads the scales), and not under torch.jit.trace (it cannot record a Function taking a
    # callable); the whole reduction in float32 in one piece
    if ofq is not None and split is None and FUSED_CONV and x.device.type == "cpu" and not torch.jit.is_tracing():
        geometry = _plain_geometry(m, x)
        if geometry is not None:
            fused: torch.Tensor | None = _fused_conv(m, x, wq, binding, s_in, geometry, addend)
            if fused is not None:
                return fused
    xq = _Codes.apply(x, (1.0 / in_fq.scale.detach()).reshape(()), False)
    acc = _accumulate(m, kind, xq, wq, split)
    # the bias: int32 at s_in * s_w (numerics.quantize_bias)
    c_out = int(m.out_features if m.float_conv is nn.Linear else m.out_channels)
    s_w_c = s_w.detach()
    if s_w_c.numel() > 1 and s_w_c.numel() != c_out:  # grouped conv transpose: axis 1 holds out/groups
        s_w_c = s_w_c.repeat(c_out // s_w_c.numel())
    s_w32 = s_w_c.reshape(-1).expand(c_out)
    s_w64 = s_w32.to(torch.float64)
    # numerics.accumulator_scale: the float64 product of the float32 scales (s_in is one exactly)
    s_acc = (s_w64 * s_in).contiguous()
    bias = m.bias if m.bias is not None else torch.zeros(c_out, device=w.device)
    axis = m.out_axis
    bq = numerics.broadcast_along(_BiasCodes.apply(bias, s_acc, s_w64), axis, acc.dim())
    acc_scale = numerics.broadcast_along(s_acc.to(torch.float32), axis, acc.dim())
    acc_grad = numerics.broadcast_along(s_w32, axis, acc.dim())
    if ofq is None:  # high-precision output: the accumulator at s_acc (DeQuantStub's float32 product)
        six = torch.full((c_out,), 6.0, dtype=torch.float64)
        hp6 = numerics.quantize(six, s_acc, "qint32", axis=0) if m.act == "relu6" else None  # only ReLU6 reads it
        lo, hi = _act_bounds(m.act, DType.qint32, hp6)
        if isinstance(hi, torch.Tensor):
            hi = numerics.broadcast_along(hi, axis, acc.dim())
        ones = torch.ones((), dtype=torch.float64)
        out: torch.Tensor = _Requant.apply(acc, bq, ones, lo, hi, acc_scale, acc_grad)
        return out
    add_fq = binding.inputs[1] if m.has_add else None
    _observe_output(ofq, acc, bq.detach(), acc_scale, m.act, addend)
    s_out = float(ofq.scale.reshape(-1)[0])
    dtype = DType(ofq.dtype)
    lo, hi = _out_bounds(m.act, dtype, s_out)
    out_scale = ofq.scale.detach().reshape(())
    if add_fq is not None:
        assert addend is not None
        s_add = float(add_fq.scale.reshape(-1)[0])
        p, inv_add = _fused_add_rule(s_acc, add_fq, s_out, binding.march, dtype, c_out)
        fast = _fused_add_float64(acc, bq, addend, inv_add, p, dtype, add_fq, s_acc, s_add, s_out, axis)
        if fast is not None:
            out = _FusedAdd64.apply(acc, bq, addend, inv_add, *fast, p.extra_bits, lo, hi, out_scale, acc_grad)
            return out
        out = _FusedAdd.apply(acc, bq, addend, inv_add, p, dtype, lo, hi, out_scale, acc_grad, axis)
        return out
    # numerics.conv_requant_params from the accumulator scale already at hand (s_acc / s_out)
    check_out_dtype(binding.march, dtype, "conv / linear")
    lim = numerics.requant_limits(binding.march)
    mult, sh = numerics.multiplier_shift(s_acc / s_out, lim.max_multiplier, lim.max_shift)
    ratio = torch.ldexp(mult.to(torch.float64), -sh).reshape(-1).expand(c_out).contiguous()
    out = _Requant.apply(acc, bq, numerics.broadcast_along(ratio, axis, acc.dim()), lo, hi, out_scale, acc_grad)
    return out


#: module -> (switch epoch, binding, weight fake quant, output fake quant, whether the grid forward applies)
_CONV_MODES: weakref.WeakKeyDictionary[nn.Module, tuple[int, Any, Any, Any, bool]] = weakref.WeakKeyDictionary()


def _conv_mode_on(m: nn.Module, binding: GridBinding, wfq: Any, ofq: Any) -> bool:
    """Whether ``m``'s fake quants let its grid forward run: plain fake quants, every one on and not in
    validation. Checked once per mode: the answer is kept until a fake quant's switches, state or observer
    are set (``fake_quantize.switch_epoch``), the binding changes or another fake quant takes a slot."""
    epoch = switch_epoch()
    known = _CONV_MODES.get(m)
    if known is not None and known[0] == epoch and known[1] is binding and known[2] is wfq and known[3] is ofq:
        return known[4]
    on = type(wfq) in _PLAIN_FQ and (ofq is None or _plain_fq(ofq) is not None)
    on = on and _on([*binding.inputs, wfq] + ([ofq] if ofq is not None else []))
    _CONV_MODES[m] = (epoch, binding, wfq, ofq, on)
    return on


def _observe_extremes(
    fq: FakeQuantize, acc: torch.Tensor, b_codes: np.ndarray, s64: np.ndarray, axis: int, act: str | None
) -> bool:
    """:func:`_observe_output` without addend for a min-max observer and a contiguous accumulator whose
    channels are its axis 1 (of 3 or more): the per-channel extremes (``amin`` / ``amax``), the rest on
    the host in numpy with the same IEEE operations (``b·s + a·s``
    rounds once in float64 either way: ``a·s`` of two float32 numbers is exact; ``s64``: the float32
    accumulator scale per channel, in float64). False when it does not apply (nothing observed)."""
    if not fq.observer_enabled or fq.has_fixed_scale:
        return True
    a = acc.detach()
    if not isinstance(fq.observer, _MIN_MAX_OBSERVERS) or a.dim() < 3 or axis % a.dim() != 1 or not a.numel():
        return False
    if not a.is_contiguous():
        return False
    if a.numel() >= _TWO_STAGE:
        # per (sample, channel) row first, then over the samples: a contiguous reduction, 1.1-2x faster
        # than over dims (0, 2, ...) at once (and aminmax(dim=) over such rows is many times slower)
        rows = a.view(a.shape[0], a.shape[1], -1)
        mn, mx = rows.amin(dim=2).amin(dim=0), rows.amax(dim=2).amax(dim=0)
    else:  # small: one reduction each, fewer dispatches
        dims = [0, *range(2, a.dim())]
        mn, mx = a.amin(dim=dims), a.amax(dim=dims)
    bs = b_codes * s64
    lo = float((bs + mn.numpy().astype(np.float64) * s64).min())
    hi = float((bs + mx.numpy().astype(np.float64) * s64).max())
    if not _observe_host(fq, lo, hi, act):
        _observe_activated(fq, torch.tensor([lo, hi], dtype=torch.float32), act)
    return True


def _observe_host(fq: FakeQuantize, lo: float, hi: float, act: str | None) -> bool:
    """:func:`_observe_activated` of the float32 tensor ``[lo, hi]`` on the host, where the observer's
    :meth:`~qir.quantization.observer.ObserverBase.observe_extremes` applies: the same float32 rounding and
    clamps (torch's ``max(a, 0)`` / ``min(a, 6)``, unambiguous for values that are not zeros), the same
    buffers. False (nothing changed) otherwise."""
    if not (abs(lo) < 3.4e38 and abs(hi) < 3.4e38):  # NaN, or no float32 value (the tensor path: inf)
        return False
    l32, h32 = float(np.float32(lo)), float(np.float32(hi))  # torch.tensor's float32 rounding
    if l32 == 0.0 or h32 == 0.0:  # which zero a clamp keeps is the kernel's business: the tensor path
        return False
    if act in ("relu", "relu6"):
        l32, h32 = (0.0 if l32 < 0.0 else l32), (0.0 if h32 < 0.0 else h32)
    if act == "relu6":
        l32, h32 = (6.0 if l32 > 6.0 else l32), (6.0 if h32 > 6.0 else h32)
    if not fq.observer.observe_extremes(l32, h32):
        return False
    fq._take_observer_scale()
    return True


#: accumulators of at least this many elements reduce per channel in two stages (:func:`_observe_extremes`)
_TWO_STAGE = 1 << 16


#: the single-node forward (qir.quantization.integer_grid_conv) where it applies; False: the unfused
#: chain everywhere (the reference the tests compare the fused node with)
FUSED_CONV = True


def _plain_geometry(m: Any, x: torch.Tensor) -> ConvGeometry | None:
    """A batched, not transposed convolution with zero padding given in numbers: its geometry, else None."""
    if m.float_conv not in (nn.Conv1d, nn.Conv2d, nn.Conv3d) or m.padding_mode != "zeros" or isinstance(m.padding, str):
        return None
    if x.dim() != len(m.stride) + 2:
        return None
    return ConvGeometry(list(m.stride), list(m.padding), list(m.dilation), int(m.groups))


def _fused_conv(
    m: Any,
    x: torch.Tensor,
    wq: torch.Tensor,
    binding: GridBinding,
    s_in: float,
    geometry: ConvGeometry,
    addend: torch.Tensor | None,
) -> torch.Tensor | None:
    """The requantizing conv (output fake quant) as one autograd node: without fused add
    :class:`~qir.quantization.integer_grid_conv.ConvRequant`, with it
    :class:`~qir.quantization.integer_grid_conv.ConvAddRequant`; the per-channel constants computed
    on the host: numpy's float64 / float32 operations are the IEEE operations the unfused chain makes
    with torch (the tests compare both bit for bit). None when the bias is not finite (the unfused
    chain then computes whatever torch makes of it)."""
    ofq = m.activation_post_process
    march = binding.march
    c_out = int(m.out_channels)
    nd = x.dim()
    shape = [1] * nd
    shape[m.out_axis % nd] = c_out
    sc = acc_scales(m, m.weight_fake_quant.scale, s_in, c_out, tuple(shape))
    s_acc = sc.s_acc  # numerics.accumulator_scale: the float64 product of the float32 scales
    if m.bias is None:
        b_codes = np.zeros(c_out)
    else:
        v = host(m.bias).astype(np.float64) / s_acc  # numerics.quantize_bias
        if not np.isfinite(v).all():
            return None
        f = np.floor(v)
        b_codes = np.clip(f + (v - f >= 0.5), -(2.0**31), 2.0**31 - 1)

    def along(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.reshape(shape))

    dtype = DType(ofq.dtype)
    if addend is not None:
        finish = _fused_add_finish(m, binding, b_codes, s_acc, shape, sc.acc_scale, dtype)
        out: torch.Tensor = ConvAddRequant.apply(
            x, wq, m.bias, addend, sc.inv, geometry, sc.bias_div, sc.acc_grad, m.out_axis, finish
        )
        return out
    check_out_dtype(march, dtype, "conv / linear")

    def plan(acc: torch.Tensor) -> RequantConstants:
        if not _observe_extremes(ofq, acc, b_codes, sc.s_acc32_64, m.out_axis, m.act):
            _observe_output(ofq, acc, along(b_codes), sc.acc_scale, m.act, None)
        s_out = float(host(ofq.scale).reshape(-1)[0])
        lo, hi = _out_bounds(m.act, dtype, s_out)
        ratio = out_scales(m, sc, s_out, march)
        return RequantConstants(along(b_codes * ratio.ratio + 0.5), ratio.ratio_t, lo, hi, s_out, sc.acc_grad)

    out = ConvRequant.apply(x, wq, m.bias, sc.inv, geometry, sc.bias_div, m.out_axis, plan)
    return out


def _fused_add_finish(
    m: Any,
    binding: GridBinding,
    b_codes: np.ndarray,
    s_acc: np.ndarray,
    shape: list[int],
    acc_scale: torch.Tensor,
    dtype: DType,
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``finish(acc, addend)`` of :class:`~qir.quantization.integer_grid_conv.ConvAddRequant`: the
    output observer's update, then the fused-add rule, float64 where its bounds hold
    (:func:`_fused_add_np`: the constants in numpy), else the int64 rule with the unfused chain's
    constants (``b_codes``, ``s_acc``: per channel; ``shape``: theirs broadcast along the output axis).
    """
    ofq, add_fq = m.activation_post_process, binding.inputs[1]
    axis, nd = m.out_axis, len(shape)
    bq = torch.from_numpy(b_codes).view(shape)

    def finish(acc: torch.Tensor, addend: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _observe_output(ofq, acc, bq, acc_scale, m.act, addend)
        s_out = float(ofq.scale.detach().numpy().reshape(-1)[0])
        s_add = float(add_fq.scale.detach().numpy().reshape(-1)[0])
        lo, hi = _out_bounds(m.act, dtype, s_out)
        a_max = max(-add_fq.qmin, add_fq.qmax)
        fast = _fused_add_np(b_codes, s_acc, s_add, s_out, a_max, dtype, binding.march)
        if fast is None:  # the torch rule: its int64 form, or its error naming the scales
            p, inv_add = _fused_add_rule(torch.from_numpy(s_acc), add_fq, s_out, binding.march, dtype, len(s_acc))
            out_scale = ofq.scale.detach().reshape(())
            return _fused_add_int64(acc, bq, addend, inv_add, p, dtype, lo, hi, out_scale, axis)
        acc_lo, acc_hi, r1, off1, r2, extra_bits = fast
        inv_add = torch.tensor(np.float32(1.0) / np.float32(s_add))  # 0-d float32: 1 / s_add as torch divides

        def along(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).view(shape)

        r2_t = torch.full([1] * nd, r2, dtype=torch.float64)  # dimensioned: float32 codes times it promote
        c = AddConstants(along(acc_lo), along(acc_hi), along(r1), along(off1), r2_t, inv_add, extra_bits, lo, hi, s_out)
        return fused_add_blocks(acc, addend, c, out=acc)  # acc is not needed afterwards

    return finish


def _fused_add_np(
    b_codes: np.ndarray, s_acc: np.ndarray, s_add: float, s_out: float, a_max: int, dtype: DType, march: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, int] | None:
    """``(acc_lo, acc_hi, r1, off1, r2, extra_bits)`` of the float64 fused add on the host
    (``integer_rules.fused_add_params_np``, :func:`_float64_add_bounds`), or None when the float64 bounds
    fail or the rule refuses the scales (the caller takes the torch path, which raises the rule's error)."""
    check_out_dtype(march, dtype, "fused conv + add")
    try:
        m1, s1, m2, s2, p = fused_add_params_np(s_acc, s_add, s_out, march, dtype)
    except ValueError:
        return None
    bounds = _float64_add_bounds(b_codes, s_acc, s_add, s_out, a_max, dtype, m1, s1, m2, s2)
    if bounds is None:
        return None
    acc_lo, acc_hi, r1 = bounds
    return acc_lo.astype(np.float32), acc_hi.astype(np.float32), r1, b_codes * r1 + 0.5, math.ldexp(m2, -s2), p


def _float64_add_bounds(
    b_codes: np.ndarray,
    s_acc: np.ndarray,
    s_add: float,
    s_out: float,
    a_max: int,
    dtype: DType,
    m1: np.ndarray,
    s1: np.ndarray,
    m2: int,
    s2: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(acc_lo, acc_hi, r1)`` (float64, per channel) of the float64 fused add, or None when its bounds fail.

    ``T[c] = ceil(((max|q_out| + 3)·s_out + max|q_add|·s_add) / s_acc[c])``: at ``|acc + bias| >= T``
    the real sum is at least ``max|q_out| + 3`` output LSBs from zero whatever the addend, and the
    integer rule is within 2 LSB of it, so the output saturates there and clamping ``acc + bias`` to
    ``±T`` (``acc_lo = -T - bias``, ``acc_hi = T - bias``) changes nothing. ``T·M1 + 2**(s1-1)`` and
    ``max|q_add|·M2 + 2**(s2-1)`` must stay below ``2**52``; ``r1 = M1 / 2**s1``."""
    o_lo, o_hi = dtype.qrange
    t = np.ceil(((max(-o_lo, o_hi) + 3) * s_out + a_max * s_add) / s_acc)
    m1f = m1.astype(np.float64)
    if float((t * m1f + np.exp2(s1.astype(np.float64) - 1)).max()) >= 2.0**52:
        return None
    if a_max * m2 + 2.0 ** (s2 - 1) >= 2.0**52:
        return None
    return -t - b_codes, t - b_codes, np.ldexp(m1f, -s1)


def _fused_add_float64(
    acc: torch.Tensor,
    bias: torch.Tensor,
    addend: torch.Tensor,
    inv_add: torch.Tensor,
    p: Any,
    dtype: DType,
    add_fq: FakeQuantize,
    s_acc: torch.Tensor,
    s_add: float,
    s_out: float,
    axis: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(acc_lo, acc_hi, r1, r2)`` for :class:`_FusedAdd64` (:func:`_float64_add_bounds` of the torch
    rule's parameters ``p``, broadcast along ``axis``), or None when its float64 bounds fail."""

    def host(t: torch.Tensor) -> np.ndarray:
        return np.asarray(t.detach().cpu().reshape(-1).numpy())

    bounds = _float64_add_bounds(
        host(bias).astype(np.float64), host(s_acc).astype(np.float64), s_add, s_out,
        max(-add_fq.qmin, add_fq.qmax), dtype, host(p.acc_multiplier), host(p.acc_shift),
        p.add_multiplier, p.add_shift,
    )  # fmt: skip
    if bounds is None:
        return None
    shape = [1] * acc.dim()
    shape[axis % acc.dim()] = -1

    def along(a: np.ndarray, dt: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=acc.device, dtype=dt).reshape(shape)

    acc_lo, acc_hi, r1 = bounds
    # dimensioned (not 0-d), so that float32 codes times r2 promote to float64
    r2 = torch.full([1] * acc.dim(), math.ldexp(p.add_multiplier, -p.add_shift), dtype=torch.float64, device=acc.device)
    return along(acc_lo, acc.dtype), along(acc_hi, acc.dtype), along(r1, torch.float64), r2


def _out_bounds(act: str | None, dtype: DType, s_out: float) -> tuple[Any, Any]:
    """:func:`_act_bounds` of an output at scale ``s_out`` (ReLU6's bound: the code of 6.0)."""
    return _act_bounds(act, dtype, constant_code(6.0, s_out, dtype) if act == "relu6" else None)


def _fused_add_rule(
    s_acc: Any, add_fq: Any, s_out: float, march: Any, dtype: DType, c_out: int
) -> tuple[Any, torch.Tensor]:
    """The fused conv + add rule's parameters (per output channel) and the addend's ``1 / s_add``."""
    p = fused_add_params(s_acc, float(add_fq.scale.reshape(-1)[0]), s_out, march, dtype)
    p = p._replace(acc_multiplier=p.acc_multiplier.expand(c_out), acc_shift=p.acc_shift.expand(c_out))
    return p, (1.0 / add_fq.scale.detach()).reshape(())


def _act_bounds(act: str | None, dtype: DType, bound6: Any) -> tuple[Any, Any]:
    """The clamp of the requantized codes: the dtype's range, cut at 0 (ReLU) and ``bound6`` (ReLU6)."""
    lo, hi = dtype.qrange
    if act in ("relu", "relu6"):
        lo = max(lo, 0)
    if act == "relu6":
        if isinstance(bound6, torch.Tensor):
            return lo, bound6.clamp(max=hi).to(torch.float32)
        return lo, min(hi, bound6)
    return lo, hi


# ---------------------------------------------------------------------------------------------
# average pools


class _RoundSTE(torch.autograd.Function):
    """``round(x)`` of values within float rounding of an integer; identity gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


@grid_step
def avg_pool_forward(m: Any, x: torch.Tensor, adaptive: bool) -> torch.Tensor | None:
    """The integer-grid QAT forward of a bound (adaptive) average pool: the exact window sum of the
    input codes, requantized with the divisor's multiplier and shift (``integer_rules.avg_pool_params``,
    as the quantized pools), or None when it does not apply."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or float_fake_quant_active() or x.dtype != torch.float32 or x.dim() != 4:
        return None
    ofq = _plain_fq(m.activation_post_process)
    in_fq = binding.inputs[0]
    if ofq is None or not _on([in_fq, ofq]):
        return None
    s_in = float(in_fq.scale.reshape(-1)[0])
    xq = _Codes.apply(x, (1.0 / in_fq.scale.detach()).reshape(()))
    h, w = int(x.shape[-2]), int(x.shape[-1])
    if adaptive:
        o = m.output_size
        oh, ow = (o, o) if isinstance(o, int) else (o[0], o[1])
        oh, ow = (h if oh is None else int(oh)), (w if ow is None else int(ow))
        d = adaptive_pool_counts(h, w, oh, ow, x.device)
        # the mean times the count is the sum up to float rounding (|sum| << 2**22): round it
        sums = _RoundSTE.apply(F.adaptive_avg_pool2d(xq, (oh, ow)) * d.to(torch.float32))
        top = int(d.max())
    else:
        k, pad = _pair(m.kernel_size), _pair(m.padding)
        stride = _pair(m.stride or m.kernel_size)
        sums = F.avg_pool2d(xq, k, stride, pad, m.ceil_mode, True, 1)  # exact: integer sums below 2**24
        d = avg_pool_divisor(h, w, k, stride, pad, m.ceil_mode, m.count_include_pad, m.divisor_override, x.device)
        top = int(m.divisor_override) if m.divisor_override else k[0] * k[1]
    acc_scale = (s_in / d).to(torch.float32)  # the float forward's gradient: s_in / d per position
    if ofq.observer_enabled and not ofq.has_fixed_scale:
        with torch.no_grad():
            _observe(ofq, sums.detach() * acc_scale)
    s_out = float(ofq.scale.reshape(-1)[0])
    dtype = DType(ofq.dtype)
    try:
        mult, sh = avg_pool_params(s_in, s_out, top, binding.march)
    except ValueError as err:
        # An output range far narrower than the input's (typical of the first steps, before the
        # observers settle) needs a ratio the march cannot requantize with. Training goes on with
        # the float fake quant of the exact mean for this call; convert_fx refuses the layer if
        # the ranges still disagree then.
        warnings.warn(
            f"integer grid: {type(m).__name__} cannot requantize on {binding.march} this step ({err}); "
            "this call uses float fake quantization",
            RuntimeWarning,
            stacklevel=4,  # above grid_step and the pool module
        )
        raise FellBack(fake_quantize(sums * acc_scale, ofq.scale, ofq.dtype)) from None
    idx = (d - 1).to(torch.int64)
    ratio = torch.ldexp(mult[idx].to(torch.float64), -sh[idx])
    lo, hi = dtype.qrange
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    out: torch.Tensor = _Requant.apply(sums, zero, ratio, lo, hi, ofq.scale.detach().reshape(()), acc_scale)
    return out
