"""Elementwise integer kernels: add / sub (the Bayes add rule), mul, rescale, clamp (ReLU / ReLU6),
table lookup, division, maximum / minimum.

Sums and products of int8 / int16 codes are exact in float64 (all below 2**53), so the
requantizations use the exact float64 path of :class:`~backends.common.kernels.base.RequantF64`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import RequantF64, qbounds, register_kernel, sat_to
from backends.common.kernels.infer import ShapeError, broadcast, code, meta, meta_call, same_shape, tensor_arg
from backends.common.kernels.schema import (
    CODE_BOUND,
    CODE_BOUND_OPT,
    INT_DTYPES,
    MULT,
    OUT_DTYPE,
    SHIFT,
    Const,
    KernelSchema,
    SchemaError,
    boolean,
    integer,
    one_of,
    optional,
    text,
)
from backends.common.program import Instruction
from qir.ir.table16 import SHIFT_V1, table16_problem, table16_shape_problem
from qir.ir.table16 import VERSIONS as TABLE16_VERSIONS
from qir.ir.types import DType


def _prep_rq(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> RequantF64:
    a = inst.attrs
    return RequantF64(torch.tensor(int(a["multiplier"])), torch.tensor(int(a["shift"])))


def _binary_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    """Codes of ``out_dtype`` in the broadcast shape of x and y (or x and the ``y_code`` scalar)."""
    x = tensor_arg(args, 0, "x")
    if len(args) == 1:
        if inst.attrs.get("y_code") is None:
            raise ShapeError(f"{inst.op} with one input needs the y_code attribute for y")
        return [code(x.shape, inst.attrs["out_dtype"])]
    return [code(broadcast(x, tensor_arg(args, 1, "y")), inst.attrs["out_dtype"])]


def _clamp_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = tensor_arg(args, 0)
    if x.dtype == torch.bool:
        raise ShapeError("clamp takes codes or floats, got a bool tensor")
    return [x]


def _lut_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = tensor_arg(args, 0)
    table = consts[inst.consts["table"]]
    if x.dtype != torch.int8:
        raise ShapeError(f"lut takes qint8 codes (a 256-entry table), got {x.dtype}")
    if table.numel() < 256:
        raise ShapeError(f"the table has {table.numel()} entries; qint8 codes index 256")
    return [meta(x.shape, table.dtype)]


_LUT16_OUT = ("qint8", "qint16")


def _lut16_version(inst: Instruction) -> int:
    # a file written before the table format had a version holds version 1
    return int(inst.attrs.get("version", 1))


def _lut16_table(inst: Instruction, constants: Mapping[str, Any] | None) -> str | None:
    """The segmented table against its format's rules (:func:`qir.ir.table16.table16_problem`):
    knot order and spacing, values inside the output range, the length its version gives."""
    table = None if constants is None else constants.get(inst.consts.get("table", ""))
    if not isinstance(table, torch.Tensor):
        return None
    problem = table16_problem(table, _lut16_version(inst), DType.parse(str(inst.attrs["out_dtype"])))
    if problem is None and table.numel() == 0:
        problem = "the segmented table is empty: lut16 needs its knots"
    if problem is not None:
        raise SchemaError("consts.table", problem)
    return None


def _lut16_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = tensor_arg(args, 0)
    table = consts[inst.consts["table"]]
    if x.dtype != torch.int16:
        raise ShapeError(f"lut16 takes qint16 codes (a segmented table), got {x.dtype}")
    problem = table16_shape_problem(tuple(table.shape), _lut16_version(inst))
    if problem is not None or table.numel() == 0:
        raise ShapeError(problem or "the segmented table is empty")
    return [code(x.shape, inst.attrs["out_dtype"])]


def _div_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    return [code(broadcast(tensor_arg(args, 0, "x"), tensor_arg(args, 1, "y")), inst.attrs["out_dtype"])]


def _extremum_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x, y = tensor_arg(args, 0, "x"), tensor_arg(args, 1, "y")
    return [meta_call(inst.op, torch.maximum, x, y)]


def _operand(v: Any, like: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float64) if isinstance(v, torch.Tensor) else torch.full_like(like, float(v), dtype=torch.float64)


@register_kernel(
    "add",
    prepare=_prep_rq,
    schema=KernelSchema(
        inputs=(1, 2),
        attrs={
            "swap": boolean(),
            "add_shift": SHIFT,
            "qscale": MULT,
            "multiplier": MULT,
            "shift": SHIFT,
            "out_dtype": OUT_DTYPE,
            "negate_y": boolean(required=False),
            "relu": boolean(required=False),
            "y_code": CODE_BOUND_OPT,
        },
        shape=_binary_shape,
    ),
)
def add(inst: Instruction, args: list[Any], rq: RequantF64) -> list[Any]:
    """``sat(requant((a << k) + b * qscale))``; ``b`` negated for ``sub``; ``y_code`` replaces ``y`` for
    ``add_scalar``; operands exchanged when ``swap`` (the larger-scaled one is shifted)."""
    a = inst.attrs
    x = args[0]
    y: Any = args[1] if len(args) > 1 else int(a["y_code"])
    xf, yf = _operand(x, x), _operand(y, x)
    if a.get("negate_y"):
        yf = yf.neg()
    p, q = (yf, xf) if a["swap"] else (xf, yf)
    acc = torch.add(p * float(2 ** int(a["add_shift"])), q, alpha=int(a["qscale"]))
    lo, hi = qbounds(str(a["out_dtype"]))
    out = rq.apply(acc).clamp_(lo, hi)
    if a.get("relu"):
        out = out.clamp_(min=0)
    return [sat_to(out, str(a["out_dtype"]))]


@register_kernel(
    "mul",
    prepare=_prep_rq,
    schema=KernelSchema(
        inputs=(1, 2),
        attrs={"multiplier": MULT, "shift": SHIFT, "out_dtype": OUT_DTYPE, "y_code": CODE_BOUND_OPT},
        shape=_binary_shape,
    ),
)
def mul(inst: Instruction, args: list[Any], rq: RequantF64) -> list[Any]:
    """``sat(requant(x * y))`` (``y_code`` for a scalar operand); qint32 output keeps the product."""
    a = inst.attrs
    x = args[0]
    acc = x.to(torch.float64) * (args[1].to(torch.float64) if len(args) > 1 else float(int(a["y_code"])))
    dt = str(a["out_dtype"])
    if dt == "qint32":
        return [sat_to(acc, dt)]
    lo, hi = qbounds(dt)
    return [sat_to(rq.apply(acc).clamp_(lo, hi), dt)]


@register_kernel(
    "rescale",
    prepare=_prep_rq,
    schema=KernelSchema(
        attrs={"multiplier": MULT, "shift": SHIFT, "out_dtype": OUT_DTYPE, "copy": boolean(required=False)},
        shape=same_shape("out_dtype"),
    ),
)
def rescale(inst: Instruction, args: list[Any], rq: RequantF64) -> list[Any]:
    """Codes at one scale to another (``copy``: equal scales, saturation only)."""
    a = inst.attrs
    dt = str(a["out_dtype"])
    x = args[0]
    if a.get("copy"):
        return [sat_to(x.to(torch.int64), dt)]
    lo, hi = qbounds(dt)
    return [sat_to(rq.apply(x.to(torch.float64)).clamp_(lo, hi), dt)]


@register_kernel(
    "zeros_like",
    schema=KernelSchema(attrs={"out_dtype": OUT_DTYPE}, shape=same_shape("out_dtype")),
)
def zeros_like(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    return [sat_to(torch.zeros(args[0].shape, dtype=torch.int64), str(inst.attrs["out_dtype"]))]


@register_kernel(
    "clamp",
    schema=KernelSchema(attrs={"min": optional(CODE_BOUND), "max": optional(CODE_BOUND)}, shape=_clamp_shape),
)
def clamp(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``clamp(x, min, max)`` on codes (ReLU: min 0; ReLU6: max round(6 / s)); the dtype is kept."""
    x = args[0]
    lo, hi = inst.attrs.get("min"), inst.attrs.get("max")
    if hi is not None and not x.is_floating_point():
        hi = min(int(hi), int(torch.iinfo(x.dtype).max))
    return [x.clamp(lo, hi)]


@register_kernel(
    "lut",
    schema=KernelSchema(
        attrs={"what": text(64, required=False)}, consts={"table": Const(INT_DTYPES, (1, 1))}, shape=_lut_shape
    ),
)
def lut(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``table[q + 128]`` for qint8 ``q`` (a 256-entry table)."""
    x = args[0]
    if x.dtype != torch.int8:
        raise NotImplementedError(f"lut ({inst.source}): only qint8 input has a table; got {x.dtype}")
    table = state["table"]
    return [table[x.to(torch.int64) + 128]]


class Table16Knots:
    """A segmented table's interpolation, per interval, derived once from its knots at load.

    For a code ``q`` in interval ``j`` (knots ``k[j] <= q < k[j+1]``, width ``w = 2**s``, values
    ``t[j]``, ``t[j+1]``) the rule ``t[j] + floor(((t[j+1] - t[j]) (q - k[j]) + w // 2) / w)`` is
    ``floor((d[j] q + c[j]) / 2**s)`` with ``d[j] = t[j+1] - t[j]`` and
    ``c[j] = t[j] 2**s + w // 2 - d[j] k[j]`` (``t[j] 2**s`` is a multiple of ``2**s``, so it passes
    through the floor exactly). The intervals are aligned powers of two, so with ``2**m`` the
    narrowest width every run of ``2**m`` codes lies in one interval: ``j = index[(q + 32768) >> m]``
    (version 1: ``m = 7`` and ``j`` the run itself). A call gathers ``j`` and three per-interval
    integers; no search. Every term stays below 2**48 (values within 2**24, codes within 2**16):
    exact in int64. This is the interpolation itself, not the converted module's table of every code
    (``full_table16``), so the artifact checks that table independently."""

    def __init__(self, table: torch.Tensor, version: int, out_dtype: str) -> None:
        t = table.to(torch.int64)
        if version == 1:
            values = t
            starts = -32768 + (torch.arange(values.numel() - 1, dtype=torch.int64) << SHIFT_V1)
            shifts = torch.full_like(starts, SHIFT_V1)
            self.run_shift = SHIFT_V1
            self.index: torch.Tensor | None = None
        else:
            knots, values = t[0], t[1]
            starts = knots[:-1]
            # the widths are powers of two (the loader checked): frexp's exponent of 2**s is s + 1
            shifts = torch.frexp((knots[1:] - starts).to(torch.float64)).exponent.to(torch.int64) - 1
            self.run_shift = int(shifts.min())
            runs = torch.ones_like(shifts) << (shifts - self.run_shift)  # runs of 2**m codes per interval
            self.index = torch.repeat_interleave(torch.arange(shifts.numel()), runs)
        widths = torch.ones_like(shifts) << shifts
        steps = values[1:] - values[:-1]
        self.slope = steps
        self.offset = values[:-1] * widths + (widths >> 1) - steps * starts
        self.shift = shifts
        self.out_dtype = out_dtype

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        q64 = q.to(torch.int64)
        j = (q64 + 32768) >> self.run_shift
        if self.index is not None:
            j = self.index[j]
        y = (self.slope[j] * q64 + self.offset[j]) >> self.shift[j]
        return sat_to(y, self.out_dtype)


def _prepare_lut16(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> Table16Knots:
    return Table16Knots(consts[inst.consts["table"]], _lut16_version(inst), str(inst.attrs["out_dtype"]))


@register_kernel(
    "lut16",
    prepare=_prepare_lut16,
    schema=KernelSchema(
        attrs={
            "what": text(64, required=False),
            "out_dtype": one_of(*_LUT16_OUT),
            "version": integer(min(TABLE16_VERSIONS), max(TABLE16_VERSIONS), required=False),
        },
        consts={"table": Const(("int32",), (1, 2))},
        extra=_lut16_table,
        shape=_lut16_shape,
    ),
)
def lut16(inst: Instruction, args: list[Any], table: Table16Knots) -> list[Any]:
    """A qint16 segmented table (docs/semantics.md "Table lookup"), in format ``version`` (absent: 1).

    Version 1: the offset code ``u = q + 32768`` falls in interval ``j = u // 128`` at
    ``r = u - 128 j``; the result interpolates the int32 knots ``t[j]``, ``t[j + 1]`` as
    ``t[j] + floor(((t[j+1] - t[j]) r + 64) / 128)``, saturated. Version 2: row 0 holds the knot
    codes ``k``, row 1 their values ``t``; ``q`` falls in interval ``j`` with
    ``k[j] <= q < k[j+1]``, of width ``w``, at ``r = q - k[j]``; the result is
    ``t[j] + floor(((t[j+1] - t[j]) r + w // 2) / w)``, saturated.

    The loader checked the knots (:func:`qir.ir.table16.table16_problem`): values within 2**24
    (version 1) or the output range (version 2). :class:`Table16Knots` (built at load) holds the
    per-interval integers a call gathers."""
    return [table(args[0])]


@register_kernel(
    "div",
    schema=KernelSchema(
        inputs=(2, 2), attrs={"multiplier": MULT, "shift": integer(0, 31), "out_dtype": OUT_DTYPE}, shape=_div_shape
    ),
)
def div(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``sat(floor(x*M / (y << s) + 1/2))`` exactly in int64; ``y == 0`` saturates to the sign of x."""
    a = inst.attrs
    dt = str(a["out_dtype"])
    lo, hi = qbounds(dt)
    num = args[0].to(torch.int64) * int(a["multiplier"])
    den = args[1].to(torch.int64) * (1 << int(a["shift"]))
    neg = den < 0
    num, den = torch.where(neg, -num, num), torch.where(neg, -den, den)
    zero = den == 0
    d = torch.where(zero, 1, den)
    q = torch.div(2 * num + d, 2 * d, rounding_mode="floor")
    sign = torch.sign(num) * torch.tensor(hi, dtype=torch.int64)
    sign = torch.where(num < 0, torch.tensor(lo, dtype=torch.int64), sign)
    return [sat_to(torch.where(zero, sign, q), dt)]


@register_kernel(
    "maximum",
    schema=KernelSchema(inputs=(2, 2), shape=_extremum_shape),
)
def maximum(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    return [torch.maximum(args[0], args[1])]


@register_kernel(
    "minimum",
    schema=KernelSchema(inputs=(2, 2), shape=_extremum_shape),
)
def minimum(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    return [torch.minimum(args[0], args[1])]
