"""Integer forms of the ops ``convert_fx`` runs on codes, and the rules for their integer constants.

A converted graph calls these functions where the float op would not be exact on codes as
written (docs/semantics.md, "Ops on codes"):

* :func:`abs_codes`: ``|q|`` saturated to the code dtype (``|-128|`` is 127 for qint8);
* :func:`clamp_codes`: ``clamp`` with bounds that are already codes (:func:`constant_code`);
* :func:`compare_codes`: a comparison with a number, as a range test on codes whose bounds
  :func:`compare_range` derives so that it equals the float comparison of the dequantized
  values for every code.

The rules are stated once here; the backend kernels (``backends/common/kernels/codes.py``)
are a second implementation that reads the same integer constants from the graph.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from backends.common import numerics
from backends.common.comparisons import COMPARISONS
from qir.ir.types import DType

__all__ = [
    "COMPARISONS",
    "abs_codes",
    "clamp_codes",
    "compare_codes",
    "compare_range",
    "constant_code",
    "flipped",
    "rounded_code",
]

#: ``c op x`` == ``x flipped[op] c``
_FLIPPED = {"eq": "eq", "ne": "ne", "gt": "lt", "ge": "le", "lt": "gt", "le": "ge"}
#: codes are searched over the widest code dtype: a code's dequantized value does not depend
#: on the dtype that stores it, so bounds found here hold for qint8, qint16 and qint32 alike
_SEARCH_LO, _SEARCH_HI = numerics.qrange("qint32")


def flipped(op: str) -> str:
    """The comparison ``x <flipped> c`` that equals ``c <op> x``."""
    return _FLIPPED[op]


def _codes_only(x: torch.Tensor, what: str) -> None:
    if x.is_floating_point():
        raise TypeError(f"{what} takes integer codes, got a {x.dtype} tensor")


def abs_codes(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` on codes, saturated to the code dtype's maximum (the scale is unchanged)."""
    _codes_only(x, "abs_codes")
    hi = torch.iinfo(x.dtype).max
    return x.to(torch.int64).abs().clamp_(max=hi).to(x.dtype)  # int64: |-2**31| overflows int32


def clamp_codes(x: torch.Tensor, lo: int | None, hi: int | None) -> torch.Tensor:
    """``clamp(x, lo, hi)`` on codes; ``lo`` / ``hi`` are codes within the dtype's range (None: no bound)."""
    _codes_only(x, "clamp_codes")
    return x.clamp(lo, hi)


def compare_codes(x: torch.Tensor, op: str, value: float, lo: int | None, hi: int | None) -> torch.Tensor:
    """``x <op> value`` on codes: ``lo <= x <= hi`` (None: unbounded), negated for ``ne``.

    ``value`` is the float the model compared with, kept for reading; ``lo`` / ``hi`` come
    from :func:`compare_range` and may lie outside the dtype's range (an empty or full test),
    so the test runs on int64."""
    _codes_only(x, "compare_codes")
    w = x.to(torch.int64)
    inside = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    if lo is not None:
        inside &= w >= lo
    if hi is not None:
        inside &= w <= hi
    return ~inside if op == "ne" else inside


# ---------------------------------------------------------------------------------------------
# rules


def _scale32(scale: float | torch.Tensor) -> torch.Tensor:
    t = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    if t.numel() != 1:
        raise ValueError(f"a per-tensor scale is needed, got {t.numel()} scales")
    return t.detach().reshape(()).to(torch.float32)


def rounded_code(value: float, scale: float | torch.Tensor) -> float:
    """``round_half_up(float32(value) / s)`` with one float32 division, before saturation.

    This is what fake quantization computes for the float32 value ``value`` at scale ``s``
    (``numerics.quantize`` for qint8 / qint16); infinite when the quotient overflows."""
    if math.isnan(value):
        raise ValueError("NaN has no code")
    s = np.float32(float(_scale32(scale))) if isinstance(scale, torch.Tensor) else np.float32(scale)
    # numpy float32 scalars: the same IEEE division and exact half-up tie test as
    # numerics.round_half_up, without torch's per-op cost (the integer-grid conv asks per step)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        v = np.float32(value) / s
        f = np.floor(v)
        return float(f) + (1.0 if v - f >= 0.5 else 0.0)  # v - floor(v) is exact: the tie test too


def constant_code(value: float, scale: float | torch.Tensor, dtype: DType) -> int:
    """``sat_T(round_half_up(float32(value) / s))``: the code fake quantization gives ``value``.

    Clamp bounds use this rule, so ``dequantize(clamp_codes(q, lo, hi)) == fake_quant(clamp(q·s,
    min, max))`` for every code ``q`` (docs/semantics.md has the argument)."""
    lo, hi = dtype.qrange
    return int(min(max(rounded_code(value, scale), lo), hi))


def compare_range(op: str, value: float, scale: float | torch.Tensor) -> tuple[int | None, int | None]:
    """``(lo, hi)`` with ``(dequantize(q, s) <op> value) == (lo <= q <= hi)`` for every code ``q``
    (``ne``: the negation of that test; None: unbounded).

    ``dequantize(q, s) = float32(q) · s`` does not decrease with ``q`` (``s > 0``, rounding is
    monotone), so ``{q : D(q) > c}`` and ``{q : D(q) >= c}`` are up-sets of the codes: each is
    ``q >= T`` for its first member ``T``, found by bisection with the very float32 comparison
    QAT evaluates. ``lt`` / ``le`` are their complements and ``eq`` their difference, which
    holds for NaN-free ``value`` only (NaN is refused)."""
    if op not in COMPARISONS:
        raise ValueError(f"unknown comparison {op!r}; valid: {', '.join(COMPARISONS)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the comparison constant must be a Python number, got {type(value).__name__}")
    if math.isnan(value):
        raise ValueError("a comparison with NaN is always False (ne: True); compare with a number")
    s = _scale32(scale)

    def first(cmp: Callable[[Any, Any], Any]) -> int:
        lo, hi = _SEARCH_LO, _SEARCH_HI + 1  # answer in [lo, hi]; hi: no code satisfies cmp
        while lo < hi:
            mid = (lo + hi) // 2
            d = numerics.dequantize(torch.tensor([mid], dtype=torch.int64), s)
            if bool(cmp(d, value)[0]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    t_gt, t_ge = first(operator.gt), first(operator.ge)
    ranges: dict[str, tuple[int | None, int | None]] = {
        "gt": (t_gt, None),
        "ge": (t_ge, None),
        "lt": (None, t_ge - 1),
        "le": (None, t_gt - 1),
        "eq": (t_ge, t_gt - 1),
        "ne": (t_ge, t_gt - 1),
    }
    return ranges[op]


# ---------------------------------------------------------------------------------------------
# legality: a converted model's integer forms are checked as the ops they compute


def _register_legality_views() -> None:
    from passes.legality_facts import register_function_view
    from qir.frontend.lookup import qualified_name
    from qir.ir.op import OP_REGISTRY

    ops: dict[str, Any] = dict(OP_REGISTRY)  # the op classes take their own attributes as keywords

    def arg(args: Sequence[Any], kwargs: dict[str, Any], i: int, name: str) -> Any:
        return args[i] if len(args) > i else kwargs.get(name)

    register_function_view(qualified_name(abs_codes), lambda args, kwargs: ops["abs"]())
    register_function_view(
        qualified_name(clamp_codes),
        lambda args, kwargs: ops["clamp"](min=arg(args, kwargs, 1, "lo"), max=arg(args, kwargs, 2, "hi")),
    )
    register_function_view(
        qualified_name(compare_codes),
        lambda args, kwargs: ops[str(arg(args, kwargs, 1, "op"))](other=arg(args, kwargs, 2, "value")),
    )


_register_legality_views()
