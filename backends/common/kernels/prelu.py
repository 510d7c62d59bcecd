"""PReLU on codes: ``q >= 0`` requantized with one multiplier, ``q < 0`` with a signed one per channel.

Products of int8 / int16 codes and 15-bit multipliers are below 2**31, so both requantizations
use the exact float64 path of :class:`~backends.common.kernels.base.RequantF64`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import RequantF64, qbounds, register_kernel, sat_to
from backends.common.kernels.infer import ShapeError, code, tensor_arg
from backends.common.kernels.schema import INT_DTYPES, MULT, OUT_DTYPE, SHIFT, Const, KernelSchema
from backends.common.program import Instruction


def _prepare(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> tuple[RequantF64, RequantF64]:
    a = inst.attrs
    pos = RequantF64(torch.tensor(int(a["pos_multiplier"])), torch.tensor(int(a["pos_shift"])))
    return pos, RequantF64(consts[inst.consts["neg_multiplier"]], consts[inst.consts["neg_shift"]])


def _prelu_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = tensor_arg(args, 0)
    n = max(consts[inst.consts["neg_multiplier"]].numel(), consts[inst.consts["neg_shift"]].numel())
    if n > 1 and (x.dim() < 2 or x.shape[1] != n):
        raise ShapeError(f"{n} per-channel negative slopes for an input of shape {list(x.shape)} (channels on dim 1)")
    return [code(x.shape, inst.attrs["out_dtype"])]


@register_kernel(
    "prelu",
    prepare=_prepare,
    schema=KernelSchema(
        attrs={"pos_multiplier": MULT, "pos_shift": SHIFT, "out_dtype": OUT_DTYPE},
        consts={"neg_multiplier": Const(INT_DTYPES, (0, 1)), "neg_shift": Const(INT_DTYPES, (0, 1))},
        shape=_prelu_shape,
    ),
)
def prelu(inst: Instruction, args: list[Any], state: tuple[RequantF64, RequantF64]) -> list[Any]:
    """``sat(floor(q * M/2**s + 2**(s-1)/2**s))`` with the positive or the channel's negative ``(M, s)``."""
    pos, neg = state
    x = args[0]
    xf = x.to(torch.float64)
    dt = str(inst.attrs["out_dtype"])
    lo, hi = qbounds(dt)
    out = torch.where(x >= 0, pos.apply(xf), neg.apply(xf, axis=1))
    return [sat_to(out.clamp_(lo, hi), dt)]
