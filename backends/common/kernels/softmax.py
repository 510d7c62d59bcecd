"""Softmax on qint8 codes: row maximum, exp table over ``q - max``, exact sum, exact rounded division."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel, sat_to
from backends.common.kernels.infer import ShapeError, code, tensor_arg
from backends.common.kernels.schema import DIM, INT_DTYPES, MULT, OUT_DTYPE, SHIFT, Const, KernelSchema
from backends.common.program import Instruction


def softmax_input(inst: Instruction, x: torch.Tensor, consts: Mapping[str, torch.Tensor], dim: int) -> None:
    """qint8 codes, a non-empty reduced dim, a 256-entry exp table (``masked_softmax`` shares it)."""
    if x.dtype != torch.int8:
        raise ShapeError(f"{inst.op}: the exp table takes qint8 codes, got {x.dtype}")
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ShapeError(f"{inst.op}: dim {dim} is out of range for shape {list(x.shape)}")
    if x.dim() and x.shape[dim] == 0:
        raise ShapeError(f"{inst.op}: dim {dim} of shape {list(x.shape)} is empty")
    table = consts[inst.consts["table"]]
    if table.numel() < 256:
        raise ShapeError(f"{inst.op}: the exp table has {table.numel()} entries, the kernel reads 256")
    # the table's values are what the kernel divides by and shifts: check them as it will use them
    t = table.reshape(-1)[:256].to(torch.int64)
    if int(t.min()) < 0 or int(t[255]) <= 0:
        raise ShapeError(
            f"{inst.op}: the exp table's entries must be >= 0 and its entry 255 (exp(0), the row maximum's) "
            f"> 0, got min {int(t.min())} and entry 255 {int(t[255])}: a row's sum could be 0 or negative"
        )
    n = int(x.shape[dim]) if x.dim() else 1
    top, shift, mult = int(t.max()), int(inst.attrs["shift"]), abs(int(inst.attrs["multiplier"]))
    if (top * n) << shift >= 2**62 or 2 * top * mult >= 2**62:
        raise ShapeError(
            f"{inst.op}: a row sum of up to {n} entries of at most {top}, shifted by {shift}, or an entry times "
            f"the multiplier {mult} overflows int64"
        )


def _softmax_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = tensor_arg(args, 0)
    softmax_input(inst, x, consts, int(inst.attrs["dim"]))
    return [code(x.shape, inst.attrs["out_dtype"])]


@register_kernel(
    "softmax",
    schema=KernelSchema(
        attrs={"dim": DIM, "multiplier": MULT, "shift": SHIFT, "out_dtype": OUT_DTYPE},
        consts={"table": Const(INT_DTYPES, (1, 1))},
        shape=_softmax_shape,
    ),
)
def softmax(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``floor((2 e M + S 2**k) / (2 S 2**k))`` with ``e = table[q - max(q) + 255]``, ``S = sum(e)`` along ``dim``."""
    a = inst.attrs
    x = args[0]
    if x.dtype != torch.int8:
        raise NotImplementedError(f"softmax ({inst.source}): the exp table takes qint8 codes; got {x.dtype}")
    dim = int(a["dim"])
    idx = x.to(torch.int64)
    idx = idx - idx.max(dim=dim, keepdim=True).values + 255
    e = state["table"].to(torch.int64)[idx]
    den = e.sum(dim=dim, keepdim=True) << int(a["shift"])  # the sum is >= 32767 (the row maximum's entry)
    num = e * int(a["multiplier"])
    q = torch.div(2 * num + den, 2 * den, rounding_mode="floor")
    dt = str(a["out_dtype"])
    lo, hi = qbounds(dt)
    return [sat_to(q.clamp_(lo, hi), dt)]
