"""Kernel registry and the exact requantization helpers every integer kernel shares.

A kernel is ``run(inst, args, state) -> list of outputs``; ``prepare(inst, consts)``
builds its ``state`` once when a Program is loaded (weights re-laid-out, multipliers
turned into float64 factors). Kernels never look at torch modules.

Exact requantization in float64 (docs/backends.md "Requantization"): ``(acc * M + 2**(s-1)) >> s``
equals ``floor(acc * (M * 2**-s) + 2**(s-1) * 2**-s)`` whenever ``|acc * M| < 2**52``: both
products are integers below 2**53 scaled by a power of two, so every float64 step is exact
and the floor is the arithmetic shift. Lowering checks the accumulator bound; beyond it
kernels use the int64 path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from backends.common.kernels.schema import KernelSchema
from backends.common.program import Instruction

__all__ = [
    "F64_EXACT_ACC",
    "Kernel",
    "RequantF64",
    "get_kernel",
    "kernel_names",
    "qbounds",
    "register_kernel",
    "requant_i64",
    "sat_to",
    "scratch",
]

#: |accumulator| below this keeps the float64 requantization exact (|acc| * 32767 < 2**52).
F64_EXACT_ACC = 2**37

RunFn = Callable[[Instruction, list[Any], Any], list[Any]]
PrepareFn = Callable[[Instruction, Mapping[str, torch.Tensor]], Any]

_DTYPES = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}
_BOUNDS = {"qint8": (-128, 127), "qint16": (-32768, 32767), "qint32": (-(2**31), 2**31 - 1)}


def qbounds(dtype: str) -> tuple[int, int]:
    """Inclusive code range of ``"qint8"`` / ``"qint16"`` / ``"qint32"``."""
    try:
        return _BOUNDS[dtype]
    except KeyError:
        raise ValueError(f"unknown code dtype {dtype!r}; valid: {', '.join(_BOUNDS)}") from None


def sat_to(v: torch.Tensor, dtype: str) -> torch.Tensor:
    """Clamp integer-valued ``v`` into ``dtype``'s range and store it as that dtype's torch type."""
    lo, hi = qbounds(dtype)
    return v.clamp(lo, hi).to(_DTYPES[dtype])


def _default_prepare(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> Any:
    return {role: consts[name] for role, name in inst.consts.items()}


@dataclass(frozen=True)
class Kernel:
    op: str
    run: RunFn
    prepare: PrepareFn
    schema: KernelSchema


_KERNELS: dict[str, Kernel] = {}


def register_kernel(op: str, prepare: PrepareFn | None = None, *, schema: KernelSchema) -> Callable[[RunFn], RunFn]:
    """Decorator: ``fn`` runs instructions whose ``op`` is ``op``; ``schema`` declares what it reads
    (inputs, attributes, constants), checked when a program is lowered and when a file is loaded."""

    def deco(fn: RunFn) -> RunFn:
        if op in _KERNELS:
            raise ValueError(f"kernel '{op}' is registered twice")
        if schema.shape is None:
            # the loader infers every value's shape to bound memory and refuse misfit operands
            raise ValueError(f"kernel '{op}' declares no output shape (KernelSchema(shape=...))")
        _KERNELS[op] = Kernel(op, fn, prepare or _default_prepare, schema)
        return fn

    return deco


# The kernel families build on this module and register on import; the package's
# __init__ (which runs before this module can be imported) imports them all.


def get_kernel(op: str) -> Kernel:
    try:
        return _KERNELS[op]
    except KeyError:
        raise KeyError(f"no kernel for op '{op}'; known: {', '.join(sorted(_KERNELS))}") from None


def kernel_names() -> list[str]:
    return sorted(_KERNELS)


class RequantF64:
    """Per-channel (or scalar) ``(M, shift)`` as float64 factors for the exact float64 path."""

    def __init__(self, multiplier: torch.Tensor, shift: torch.Tensor) -> None:
        m = multiplier.to(torch.int64).reshape(-1)
        s = shift.to(torch.int64).reshape(-1)
        half = torch.where(s > 0, torch.ones_like(s) << (s - 1).clamp(min=0), torch.zeros_like(s))
        self.scale = torch.ldexp(m.to(torch.float64), -s)
        self.half = torch.ldexp(half.to(torch.float64), -s)
        self.multiplier, self.shift = m, s

    def along(self, axis: int, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors shaped to broadcast along ``axis`` of a rank-``ndim`` tensor (scalars stay 0-d)."""
        if self.scale.numel() == 1:
            return self.scale.reshape(()), self.half.reshape(())
        shape = [1] * ndim
        shape[axis % ndim] = -1
        return self.scale.reshape(shape), self.half.reshape(shape)

    def apply(self, acc: torch.Tensor, axis: int = -1) -> torch.Tensor:
        """``floor(acc * M/2**s + half)`` as float64 (``acc``: integer-valued float64, |acc| < F64_EXACT_ACC)."""
        sc, hf = self.along(axis, acc.dim())
        return torch.addcmul(hf, acc, sc).floor_()


def requant_i64(acc: torch.Tensor, multiplier: torch.Tensor, shift: torch.Tensor, axis: int | None) -> torch.Tensor:
    """``(acc * M + 2**(s-1)) >> s`` in int64 (unsaturated); the path for very large accumulators."""
    a = acc.to(torch.int64)
    m, s = multiplier.to(torch.int64).reshape(-1), shift.to(torch.int64).reshape(-1)
    if m.numel() > 1 and axis is not None:
        shape = [1] * a.dim()
        shape[axis % a.dim()] = -1
        m, s = m.reshape(shape), s.reshape(shape)
    else:
        m, s = m.reshape(()), s.reshape(())
    half = torch.where(s > 0, torch.ones_like(s) << (s - 1).clamp(min=0), torch.zeros_like(s))
    return torch.bitwise_right_shift(a * m + half, s)


_SCRATCH = threading.local()


def scratch(tag: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-initialised buffer kept per thread for ``(tag, shape, dtype)`` and handed out again on
    the next request with the same key: for values that live only inside one kernel call (im2col
    columns, accumulators). Fresh large allocations are page-faulted in on every call, which costs
    more than a thin layer's arithmetic. Callers that rely on regions they never write staying zero
    (padding) put what decides those regions into ``tag``."""
    pool: dict[tuple[Any, ...], torch.Tensor] | None = getattr(_SCRATCH, "pool", None)
    if pool is None:
        pool = _SCRATCH.pool = {}
    key = (tag, tuple(shape), dtype)
    buf = pool.get(key)
    if buf is None:
        buf = pool[key] = torch.zeros(shape, dtype=dtype)
    return buf
