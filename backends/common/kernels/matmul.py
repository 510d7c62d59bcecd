"""Integer matmul of two code tensors: exact in float32 while ``K * max|x| * max|y| < 2**24``,
else float64; then requantization (or the qint32 product)."""

from __future__ import annotations

from typing import Any

import torch

from backends.common.kernels.base import RequantF64, qbounds, register_kernel, sat_to
from backends.common.kernels.infer import ShapeError, code, meta_call, tensor_arg
from backends.common.kernels.schema import MULT_OPT, OUT_DTYPE, SHIFT_OPT, KernelSchema
from backends.common.program import Instruction


def _amax(t: torch.Tensor) -> int:
    return 128 if t.dtype == torch.int8 else 32768


def _matmul_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    a = inst.attrs
    x, y = tensor_arg(args, 0, "x"), tensor_arg(args, 1, "y")
    if a["out_dtype"] != "qint32" and (a.get("multiplier") is None or a.get("shift") is None):
        raise ShapeError(f"a {a['out_dtype']} matmul needs multiplier and shift")
    out = meta_call("matmul", torch.matmul, x.to(torch.float64), y.to(torch.float64))
    return [code(out.shape, a["out_dtype"])]


@register_kernel(
    "matmul",
    schema=KernelSchema(
        inputs=(2, 2),
        attrs={"multiplier": MULT_OPT, "shift": SHIFT_OPT, "out_dtype": OUT_DTYPE},
        shape=_matmul_shape,
    ),
)
def matmul(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    a = inst.attrs
    x, y = args
    k = int(x.shape[-1])
    ct = torch.float32 if k * _amax(x) * _amax(y) < 2**24 else torch.float64
    acc = torch.matmul(x.to(ct), y.to(ct)).to(torch.float64)
    dt = str(a["out_dtype"])
    if dt == "qint32":
        return [sat_to(acc, dt)]
    rq = RequantF64(torch.tensor(int(a["multiplier"])), torch.tensor(int(a["shift"])))
    lo, hi = qbounds(dt)
    return [sat_to(rq.apply(acc).clamp_(lo, hi), dt)]
