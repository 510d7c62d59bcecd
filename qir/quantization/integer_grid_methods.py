"""The FloatFunctional methods beyond add / sub / mul / cat on the integer grid: their float and integer forms.

:mod:`qir.quantization.integer_grid_functional` runs a bound FloatFunctional's call on the grid;
for the methods here it asks this module for the call's tensor operands, the float result (what
``FunctionalBase`` computes before the output fake quant, with the same torch calls, so the
observer sees the same values) and the converted ``QFunctional``'s rule on the input codes:

* ``add_scalar`` / ``mul_scalar``: ``integer_rules.add_scalar_int`` / ``mul_scalar_int`` (the number
  coded as ``±127`` at ``|c| / 127``),
* ``div``: ``integer_rules.div_params`` + ``div_int``,
* ``matmul``: the exact product of the codes (``x_trans`` / ``y_trans`` transpose them first)
  requantized with ``numerics.conv_requant_params``; without an output fake quant (high-precision
  matmul) the int32 product at ``s_x * s_y``,
* ``sum`` / ``mean``: the exact int64 sum requantized (``mean`` folds ``1 / n`` into the ratio),
* ``maximum`` / ``minimum``: both inputs requantized to the output scale first,
* ``exp`` / ``ceil`` / ``floor``: the 256-entry table of qint8 input, the segmented table of qint16
  input (``lut_segmented.method_table16``: ceil / floor exact, every jump its own interval).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from backends.common import numerics
from backends.common.integer_rules import (
    add_scalar_int,
    div_int,
    div_params,
    f32,
    mul_scalar_int,
    ratio_params,
)
from backends.common.lut_segmented import method_table16
from backends.common.table16_cache import TABLE16_CACHE
from qir.ir.table16 import LATEST
from qir.ir.types import DType

__all__ = ["METHODS", "float_result", "integer_result", "operands", "refusal"]

_SCALAR = frozenset({"add_scalar", "mul_scalar"})
_PAIR = frozenset({"div", "maximum", "minimum"})
_REDUCE = frozenset({"sum", "mean"})
_TABLES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp": torch.exp,
    "ceil": torch.ceil,
    "floor": torch.floor,
}
#: the methods this module computes on the grid
METHODS = _SCALAR | _PAIR | _REDUCE | frozenset({"matmul"}) | frozenset(_TABLES)
#: the methods whose second operand is a number, never a tensor (its fx node is not a grid input)
SCALAR_METHODS = _SCALAR


def _arg(args: Sequence[Any], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def operands(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The call's tensor operands (in the order of the call site's grid inputs) and its other arguments."""
    x = _arg(args, kwargs, 0, "x", None)
    if method in _SCALAR:
        return [x], {"y": _arg(args, kwargs, 1, "y", None)}
    if method in _PAIR:
        return [x, _arg(args, kwargs, 1, "y", None)], {}
    if method == "matmul":
        y = _arg(args, kwargs, 1, "y", None)
        xt, yt = bool(_arg(args, kwargs, 2, "x_trans", False)), bool(_arg(args, kwargs, 3, "y_trans", False))
        return [x, y], {"x_trans": xt, "y_trans": yt}
    if method in _REDUCE:
        dim = _arg(args, kwargs, 1, "dim", None)
        dims = None if dim is None else ([int(dim)] if isinstance(dim, int) else [int(d) for d in dim])
        return [x], {"dim": dims, "keepdim": bool(_arg(args, kwargs, 2, "keepdim", False))}
    return [x], {}


def float_result(method: str, ts: list[torch.Tensor], opts: dict[str, Any]) -> torch.Tensor:
    """What ``FunctionalBase.<method>`` computes before its output fake quant (the same torch calls)."""
    x = ts[0]
    if method == "add_scalar":
        return torch.add(x, opts["y"])
    if method == "mul_scalar":
        return torch.mul(x, opts["y"])
    if method == "div":
        return torch.div(x, ts[1])
    if method == "maximum":
        return torch.maximum(x, ts[1])
    if method == "minimum":
        return torch.minimum(x, ts[1])
    if method == "matmul":
        y = ts[1]
        return torch.matmul(
            x.transpose(-2, -1) if opts["x_trans"] else x, y.transpose(-2, -1) if opts["y_trans"] else y
        )
    if method in _REDUCE:
        d = opts["dim"]
        if method == "mean":
            return x.mean() if d is None else x.mean(dim=d, keepdim=opts["keepdim"])
        return x.sum() if d is None else x.sum(dim=d, keepdim=opts["keepdim"])
    return _TABLES[method](x)


def refusal(method: str, in_dtypes: Sequence[DType]) -> str | None:
    """Why a call of ``method`` on inputs of ``in_dtypes`` has no integer form, or None."""
    if method in ("ceil", "floor") and in_dtypes and in_dtypes[0] not in (DType.qint8, DType.qint16):
        return f"FloatFunctional.{method} of {in_dtypes[0].name} codes has no table; it trains with float fake quant"
    return None


def to_out(q: torch.Tensor, s_in: float, s_out: float, march: str, dt: DType) -> torch.Tensor:
    """``QFunctional._to_out``: codes requantized to the output scale (a saturating copy when equal)."""
    if f32(s_in) == f32(s_out):
        return numerics.saturate(q, dt)
    m, s = numerics.requant_params(s_in, s_out, march, dt)
    return numerics.requantize(q, m, s, dt)


def integer_result(
    method: str,
    qs: list[torch.Tensor],
    scales: list[float],
    in_dtypes: list[DType],
    s_out: float | None,
    march: str,
    dt: DType,
    opts: dict[str, Any],
) -> torch.Tensor | None:
    """The converted ``QFunctional.<method>`` on the int64 input codes ``qs`` of ``in_dtypes`` grids
    (qir.nn.quantized.functional), or None when it has none. ``s_out``
    None: a high-precision matmul (int32 output)."""
    x = qs[0]
    if method == "matmul":
        xs = x.transpose(-2, -1) if opts["x_trans"] else x
        ys = qs[1].transpose(-2, -1) if opts["y_trans"] else qs[1]
        acc = torch.matmul(xs.to(torch.float64), ys.to(torch.float64)).to(torch.int64)  # exact below 2**53
        if s_out is None:
            return numerics.saturate(acc, DType.qint32)
        m, s = numerics.conv_requant_params(scales[0], scales[1], s_out, march, dt)
        return numerics.requantize(acc, m.reshape(()), s.reshape(()), dt)
    assert s_out is not None
    if method == "add_scalar":
        return add_scalar_int(x, opts["y"], scales[0], s_out, march, dt)
    if method == "mul_scalar":
        return mul_scalar_int(x, opts["y"], scales[0], s_out, march, dt)
    if method == "div":
        m_div, s_div = div_params(scales[0], scales[1], s_out, march)
        return div_int(x, qs[1], m_div, s_div, dt)
    if method in ("maximum", "minimum"):
        a, b = (to_out(q, s, s_out, march, dt) for q, s in zip(qs, scales, strict=True))
        return torch.maximum(a, b) if method == "maximum" else torch.minimum(a, b)
    if method in _REDUCE:
        d = opts["dim"]
        acc = x.sum() if d is None else x.sum(dim=d, keepdim=opts["keepdim"])
        if method == "sum":
            m, s = numerics.requant_params(scales[0], s_out, march, dt)
        else:
            n = x.numel() // max(acc.numel(), 1)
            m, s = ratio_params(f32(scales[0]) / (n * f32(s_out)), march)
        return numerics.requantize(acc, m, s, dt)
    fn = _TABLES[method]
    if in_dtypes[0] is DType.qint8:
        return numerics.lut_apply(numerics.lut_int8(fn, scales[0], s_out, dt), x)
    key = ("FloatFunctional", method, f32(scales[0]), f32(s_out), dt, LATEST)
    return TABLE16_CACHE.lookup(key, lambda: method_table16(method, fn, scales[0], s_out, dt, LATEST), x, dt, LATEST)
