"""QAT training on the integer grid for the FloatFunctional methods, table lookups and bilinear resize.

A bound QAT ``FloatFunctional`` (``prepare_qat_fx`` binds one whose call site's tensor inputs
all carry the scale of a known per-tensor fake quant, as for convs) computes, in its QAT
forward, what the converted ``QFunctional`` computes on the input codes (``x / s_x``):

* ``add`` / ``add_relu`` / ``sub``: ``numerics.add_params`` + ``add_int`` (``sub`` adds ``-y``,
  ``add_relu`` clamps at 0),
* ``mul``: the exact product requantized with ``numerics.conv_requant_params(s_x, s_y, s_out)``,
* ``cat`` / ``concat`` / ``concatenate`` / ``stack``: each input requantized to the output scale
  (``requant_params``; a saturating copy when the scales are equal as float32),
* every other method (``add_scalar``, ``mul_scalar``, ``div``, ``matmul``, ``sum``, ``mean``,
  ``maximum``, ``minimum``, ``exp``, ``ceil``, ``floor``): :mod:`qir.quantization.integer_grid_methods`,

a bound table lookup (``UnaryLUT``: sigmoid, tanh, exp, ...) looks its input codes up in the
table ``convert_fx`` builds from the current scales (256 entries for qint8 input, the segmented
513-knot table for qint16), and a bound bilinear ``Interpolate`` computes the quantized module's fixed-point rule
(``integer_rules.bilinear_taps``, one requantization). Each returns ``codes * s_out``. The
output fake quant observes the float result first, as in the float forward, and the gradient
is the float forward's: that of ``fq(f(x, y))`` (through ``f``, masked where ``f``'s value
rounds outside the output range). So the step's output equals what ``convert_fx`` of the state
after the step's observer updates computes (docs/semantics.md, "Training on the integer grid").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from backends.common import numerics
from backends.common.integer_rules import bilinear_taps, bilinear_weight_bits, resize_out_size
from backends.common.lut_segmented import lut_int16
from backends.common.table16_cache import TABLE16_CACHE
from qir.ir.table16 import LATEST
from qir.ir.types import DType
from qir.quantization import integer_grid_methods as methods
from qir.quantization.fake_quantize import FakeQuantize, float_fake_quant_active
from qir.quantization.integer_grid import _ATTR, GridBinding, _observe, _on, _plain_fq, grid_step

__all__ = ["GRID_METHODS", "functional_forward", "interpolate_forward", "lut_forward", "refusal"]

_BINARY = frozenset({"add", "add_relu", "sub", "mul"})
_JOIN = frozenset({"cat", "concat", "concatenate", "stack"})
#: the FloatFunctional methods that train on the integer grid (every one the QAT class has)
GRID_METHODS = _BINARY | _JOIN | methods.METHODS


class _GridOut(torch.autograd.Function):
    """Forward: the integer result ``codes * s_out``; backward: the float fake quant's gradient of
    ``y`` (the float result), passed where ``round(y / s_out)`` is inside ``[qmin, qmax]``."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int
    ) -> torch.Tensor:
        q = numerics.round_half_up(y.detach() / scale)
        ctx.save_for_backward((q >= qmin) & (q <= qmax))
        return codes.to(torch.float32).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None, None, None


def _codes(t: torch.Tensor, fq: FakeQuantize) -> torch.Tensor:
    """The int64 codes of ``t``, a tensor on ``fq``'s grid (``q * s`` up to float32 rounding).

    Saturated to ``fq``'s code range: in training a dropout between ``fq`` and this op rescales by
    ``1/(1-p)``, so its output can leave the range (a table lookup then indexed past its end); the op
    reads it as ``fq`` would re-quantize it. On the grid (every eval and validation forward) the clamp
    changes nothing."""
    q = (t.detach() * (1.0 / fq.scale.detach()).reshape(())).round_().to(torch.int64)
    return q.clamp_(int(fq.qmin), int(fq.qmax))


def _scale(fq: FakeQuantize) -> float:
    return float(fq.scale.reshape(-1)[0])


def _operands(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], int]:
    """The call's tensor operands and, for cat / stack, the dim."""
    if method in _JOIN:
        xs = args[0] if args else kwargs.get("x", ())
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return list(xs), int(dim)
    return [args[0] if args else kwargs.get("x"), args[1] if len(args) > 1 else kwargs.get("y")], 0


def _float_result(method: str, ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """What the float forward computes before its output fake quant (FunctionalBase)."""
    if method == "add":
        return torch.add(ts[0], ts[1])
    if method == "add_relu":
        return torch.relu(torch.add(ts[0], ts[1]))
    if method == "sub":
        return torch.sub(ts[0], ts[1])
    if method == "mul":
        return torch.mul(ts[0], ts[1])
    if method == "stack":
        return torch.stack(ts, dim=dim)
    return torch.cat(ts, dim=dim)


def _integer_result(
    method: str, qs: list[torch.Tensor], scales: list[float], s_out: float, march: str, dt: DType, dim: int
) -> torch.Tensor:
    """The converted QFunctional's rule on the input codes (qir.nn.quantized.functional)."""
    if method in ("add", "add_relu", "sub"):
        p = numerics.add_params(scales[0], scales[1], s_out, march, dt)
        out = numerics.add_int(qs[0], qs[1].neg() if method == "sub" else qs[1], p, dt)
        return out.clamp(min=0) if method == "add_relu" else out
    if method == "mul":
        m, s = numerics.conv_requant_params(scales[0], scales[1], s_out, march, dt)
        return numerics.requantize(qs[0] * qs[1], m.reshape(()), s.reshape(()), dt)
    moved = [methods.to_out(q, s_in, s_out, march, dt) for q, s_in in zip(qs, scales, strict=True)]
    return torch.stack(moved, dim=dim) if method == "stack" else torch.cat(moved, dim=dim)


@grid_step
def functional_forward(m: Any, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The integer-grid QAT forward of a bound FloatFunctional's ``method`` call, or None when it does
    not apply (not bound, a method off the grid, a fake quant disabled or in validation, not float32
    operands, inside :func:`~qir.quantization.fake_quantize.float_fake_quant`)."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or method not in GRID_METHODS or float_fake_quant_active():
        return None
    ofq = _plain_fq(m.activation_post_process)
    if ofq is None and not (method == "matmul" and m.activation_post_process is None):
        return None  # only a high-precision matmul has no output fake quant
    if not _on([*binding.inputs] + ([ofq] if ofq is not None else [])):
        return None
    if method in methods.METHODS:
        ts, opts = methods.operands(method, args, kwargs)
    else:
        ts, dim = _operands(method, args, kwargs)
        opts = {"dim": dim}
    if len(ts) != len(binding.inputs) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in ts):
        return None
    in_dts = [DType(fq.dtype) for fq in binding.inputs]
    if method in methods.METHODS and methods.refusal(method, in_dts) is not None:
        return None
    if method in methods.SCALAR_METHODS and not _finite_number(opts["y"]):
        return None  # the float forward runs; convert names the operand
    y = methods.float_result(method, ts, opts) if method in methods.METHODS else _float_result(method, ts, opts["dim"])
    scales = [_scale(fq) for fq in binding.inputs]
    if ofq is None:  # high-precision matmul: the int32 product at s_x * s_y (DeQuantStub's float32 product)
        acc_scale = numerics.accumulator_scale(scales[0], scales[1]).to(torch.float32).reshape(())
        with torch.no_grad():
            qs = [_codes(t, fq) for t, fq in zip(ts, binding.inputs, strict=True)]
            codes = methods.integer_result(method, qs, scales, in_dts, None, binding.march, DType.qint32, opts)
        assert codes is not None
        lo, hi = DType.qint32.qrange
        hp: torch.Tensor = _GridOut.apply(y, codes, acc_scale, lo, hi)
        return hp
    _observe(ofq, y)
    s_out = _scale(ofq)
    dt = DType(ofq.dtype)
    with torch.no_grad():
        qs = [_codes(t, fq) for t, fq in zip(ts, binding.inputs, strict=True)]
        if method in methods.METHODS:
            codes = methods.integer_result(method, qs, scales, in_dts, s_out, binding.march, dt, opts)
        else:
            codes = _integer_result(method, qs, scales, s_out, binding.march, dt, opts["dim"])
    if codes is None:
        return None
    out: torch.Tensor = _GridOut.apply(y, codes, ofq.scale.detach().reshape(()), ofq.qmin, ofq.qmax)
    return out


def _finite_number(y: Any) -> bool:
    return isinstance(y, (int, float)) and not isinstance(y, bool) and math.isfinite(float(y))


def refusal(m: Any, called: set[str], inputs: Sequence[FakeQuantize]) -> str | None:
    """Why FloatFunctional ``m``, whose call site calls ``called`` on inputs from the fake quants
    ``inputs``, cannot train on the grid, or None (the binding hook of qir.quantization.integer_grid)."""
    in_dts = [DType(fq.dtype) for fq in inputs]
    for method in sorted(called):
        why = methods.refusal(method, in_dts)
        if why is not None:
            return why
    if m.activation_post_process is not None and _plain_fq(m.activation_post_process) is None:
        return "its output fake quant is not a plain per-tensor FakeQuantize"
    return None


@grid_step
def interpolate_forward(m: Any, x: torch.Tensor, size: Any = None) -> torch.Tensor | None:
    """The integer-grid QAT forward of a bound bilinear ``Interpolate`` (qir.nn.qat), or None when it
    does not apply (nearest copies codes and is exact anyway; not bound; a fake quant off)."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or m.mode != "bilinear" or float_fake_quant_active():
        return None
    ofq = _plain_fq(m.activation_post_process)
    in_fq = binding.inputs[0]
    if ofq is None or not _on([in_fq, ofq]) or x.dtype != torch.float32 or x.dim() != 4:
        return None
    y = m.float_forward(x, size)
    _observe(ofq, y)
    s_in, s_out = _scale(in_fq), _scale(ofq)
    dt = DType(ofq.dtype)
    with torch.no_grad():
        q = _codes(x, in_fq)
        h, w = int(x.shape[-2]), int(x.shape[-1])
        oh, ow, fh, fw = resize_out_size(
            h, w, m.size if size is None else size, m.scale_factor, m.recompute_scale_factor
        )
        bits = bilinear_weight_bits(DType(in_fq.dtype).to_torch())
        ac = bool(m.align_corners)
        hi0, hi1, hw0, hw1 = bilinear_taps(h, oh, fh, ac, bits)
        wi0, wi1, ww0, ww1 = bilinear_taps(w, ow, fw, ac, bits)
        rows = q[..., hi0, :] * hw0[:, None] + q[..., hi1, :] * hw1[:, None]
        acc = rows[..., wi0] * ww0 + rows[..., wi1] * ww1
        mult, sh = numerics.requant_params(s_in, s_out, binding.march, dt)
        codes = numerics.requantize(acc, int(mult), int(sh) + 2 * bits, dt)
    if codes.shape != y.shape:
        return None  # torch chose another output size than the integer rule: the float forward decides
    out: torch.Tensor = _GridOut.apply(y, codes, ofq.scale.detach().reshape(()), ofq.qmin, ofq.qmax)
    return out


#: the attributes every nn.Module has (hooks, parameters, training): not what a function module's table depends on
_MODULE_STATE = frozenset(vars(nn.Module()))


def table_key(fm: nn.Module, s_in: float, s_out: float, dt: DType) -> tuple[Any, ...] | None:
    """The cache key of the qint16 table of the function module ``fm`` (``UnaryLUT.function_module``:
    no parameters) at these scales: its class and its other attributes (a slope, an exponent, an
    ``approximate`` flag), each by type and repr (-0.0 is not 0.0). None when an attribute is not a
    plain value the key can hold: that table is built on every call."""
    attrs: list[tuple[str, str, str]] = []
    for name, v in sorted(vars(fm).items()):
        if name in _MODULE_STATE:
            continue
        if v is not None and not isinstance(v, (bool, int, float, str)):
            return None
        attrs.append((name, type(v).__name__, repr(v)))
    return (type(fm), tuple(attrs), s_in, s_out, dt, LATEST)


@grid_step
def lut_forward(m: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The integer-grid QAT forward of a bound ``UnaryLUT`` (qir.nn.qat): the converted module's table
    at the current scales, or None when it does not apply (or ``f`` is NaN on the input range: the
    float forward runs and convert names the problem)."""
    binding: GridBinding | None = m.__dict__.get(_ATTR)
    if binding is None or float_fake_quant_active():
        return None
    ofq = _plain_fq(m.activation_post_process)
    in_fq = binding.inputs[0]
    if ofq is None or not _on([in_fq, ofq]) or x.dtype != torch.float32:
        return None
    fn = m.function()
    y = fn(x)
    _observe(ofq, y)
    s_in, s_out = _scale(in_fq), _scale(ofq)
    dt, in_dt = DType(ofq.dtype), DType(in_fq.dtype)
    with torch.no_grad():
        q = _codes(x, in_fq)
        codes: torch.Tensor | None
        try:
            if in_dt is DType.qint8:
                codes = numerics.lut_apply(numerics.lut_int8(fn, s_in, s_out, dt), q)
            elif in_dt is DType.qint16:
                key = table_key(m.function_module, s_in, s_out, dt)
                codes = TABLE16_CACHE.lookup(
                    key, lambda: lut_int16(fn, s_in, s_out, dt, measure=False).entries, q, dt, LATEST
                )
            else:
                return None
        except ValueError:
            return None
        assert codes is not None  # lut_int16 builds a table or raises
    out: torch.Tensor = _GridOut.apply(y, codes, ofq.scale.detach().reshape(()), ofq.qmin, ofq.qmax)
    return out
