"""Softmax on qint8 codes: row maximum, exp table over ``q - max``, exact sum, exact rounded division."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel, sat_to
from backends.common.kernels.schema import DIM, INT_DTYPES, MULT, OUT_DTYPE, SHIFT, Const, KernelSchema
from backends.common.program import Instruction


@register_kernel(
    "softmax",
    schema=KernelSchema(
        attrs={"dim": DIM, "multiplier": MULT, "shift": SHIFT, "out_dtype": OUT_DTYPE},
        consts={"table": Const(INT_DTYPES, (1, 1))},
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
