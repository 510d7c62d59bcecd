"""LayerNorm on codes: exact int64 moments, integer square root, exact rounded division to a 2**-G
fixed point, then the affine weight and bias as a per-element requantization (docs/semantics.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel, requant_i64, sat_to
from backends.common.kernels.infer import ShapeError, code, tensor_arg
from backends.common.kernels.schema import INT_DTYPES, OUT_DTYPE, Const, KernelSchema, integer
from backends.common.program import Instruction


def _bit_length(t: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative int64 ``t`` from the float64 exponent, corrected where rounding carried."""
    _, e = torch.frexp(t.to(torch.float64))
    b = e.to(torch.int64)
    over = (b > 0) & ((torch.ones_like(b) << (b - 1).clamp(min=0)) > t)
    return torch.where(over, b - 1, b)


def _isqrt(n: torch.Tensor) -> torch.Tensor:
    """``floor(sqrt(n))`` for int64 ``n < 2**62``: the float64 root is within 1; two integer corrections."""
    r = torch.sqrt(n.to(torch.float64)).floor().to(torch.int64)
    for _ in range(2):
        r = torch.where(r * r > n, r - 1, r)
        r = torch.where((r + 1) * (r + 1) <= n, r + 1, r)
    return r


def _layer_norm_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    a = inst.attrs
    nd = int(a["ndims"])
    x = tensor_arg(args, 0)
    if x.dim() < nd:
        raise ShapeError(f"normalizes the last {nd} dims of an input of shape {list(x.shape)}")
    n = 1
    for d in x.shape[x.dim() - nd :]:
        n *= int(d)
    for role in ("multiplier", "shift", "bias"):
        m = consts[inst.consts[role]].numel()
        if m != n and (role == "multiplier" or m != 1):
            raise ShapeError(f"the input has {n} elements to normalize, constant {role} has {m}")
    if n == 0:
        raise ShapeError(f"normalizes over no elements (input shape {list(x.shape)})")
    return [code(x.shape, a["out_dtype"])]


@register_kernel(
    "layer_norm",
    schema=KernelSchema(
        attrs={
            "ndims": integer(1, 8),
            "z_bits": integer(0, 30),
            "extra_bits": integer(1, 30),
            "eps_bits": integer(0, 15),
            "eps_term": integer(0, 2**62),
            "out_dtype": OUT_DTYPE,
        },
        consts={
            "multiplier": Const(INT_DTYPES, (1, 1)),
            "shift": Const(INT_DTYPES, (1, 1)),
            "bias": Const(INT_DTYPES, (1, 1)),
        },
        shape=_layer_norm_shape,
    ),
)
def layer_norm(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    a = inst.attrs
    x = args[0]
    nd, zb, p, f = int(a["ndims"]), int(a["z_bits"]), int(a["extra_bits"]), int(a["eps_bits"])
    shape = x.shape
    n = 1
    for d in shape[x.dim() - nd :]:
        n *= int(d)
    if n != state["multiplier"].numel():
        raise ValueError(
            f"layer_norm ({inst.source}): the program normalizes {state['multiplier'].numel()} "
            f"elements, the input has {n}"
        )
    q = x.to(torch.int64).reshape(-1, n)
    s1 = q.sum(1, keepdim=True)
    t = ((n * (q * q).sum(1, keepdim=True) - s1 * s1) << (2 * f)) + int(a["eps_term"])
    k = (60 - _bit_length(t)).clamp(min=0) // 2
    root = _isqrt(t << (2 * k)).clamp(min=1)
    num = (n * q - s1) << (f + k + zb)
    z = torch.div(2 * num + root, 2 * root, rounding_mode="floor")
    mid = requant_i64(z, state["multiplier"], state["shift"], axis=1)
    mid = mid.clamp(-(2**31), 2**31 - 1) + state["bias"].to(torch.int64)
    out = (mid + (1 << (p - 1))) >> p
    dt = str(a["out_dtype"])
    lo, hi = qbounds(dt)
    return [sat_to(out.clamp_(lo, hi).reshape(shape), dt)]
