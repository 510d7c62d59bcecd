"""Selection kernels on codes: max / min (whole tensor or along a dim, with indices), argmax /
argmin, top-k, gather. They pick codes, never compute new ones, so the output keeps the
input's scale; indices are int64.

Ties: a code's dequantized value ``float32(q) · s`` is strictly increasing in ``q`` for
qint8 / qint16 codes, so the codes tie exactly where the QAT values do and torch's
tie-breaking (the first maximum for max / argmax) picks the same index on both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import register_kernel
from backends.common.kernels.schema import DIM, MAX_COUNT, Const, KernelSchema, boolean, integer, one_of, optional
from backends.common.program import Instruction


def _index_given(inst: Instruction, consts: Mapping[str, torch.Tensor] | None) -> str | None:
    if (len(inst.inputs) == 2) == ("index" in inst.consts):
        return "the index is either the second input or the constant 'index', exactly one of them"
    return None


def _dim(a: Mapping[str, Any]) -> int | None:
    d = a.get("dim")
    return None if d is None else int(d)


@register_kernel(
    "reduce_max",
    schema=KernelSchema(attrs={"which": one_of("max", "min"), "dim": optional(DIM), "keepdim": boolean()}),
)
def reduce_max(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``which`` (max / min) of the codes: the whole tensor (``dim`` None), else ``(values, indices)`` along ``dim``."""
    a = inst.attrs
    fn = torch.max if a["which"] == "max" else torch.min
    d = _dim(a)
    if d is None:
        return [fn(args[0])]
    r = fn(args[0], d, keepdim=bool(a["keepdim"]))
    return [(r.values, r.indices)]


@register_kernel(
    "arg_reduce",
    schema=KernelSchema(attrs={"which": one_of("argmax", "argmin"), "dim": optional(DIM), "keepdim": boolean()}),
)
def arg_reduce(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``which`` (argmax / argmin) of the codes along ``dim`` (None: of the flattened tensor)."""
    a = inst.attrs
    fn = torch.argmax if a["which"] == "argmax" else torch.argmin
    return [fn(args[0], dim=_dim(a), keepdim=bool(a["keepdim"]))]


@register_kernel(
    "topk",
    schema=KernelSchema(attrs={"k": integer(0, MAX_COUNT), "dim": DIM, "largest": boolean(), "sorted": boolean()}),
)
def topk(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``(values, indices)`` of the ``k`` largest (``largest``) or smallest codes along ``dim``."""
    a = inst.attrs
    r = torch.topk(args[0], int(a["k"]), dim=int(a["dim"]), largest=bool(a["largest"]), sorted=bool(a["sorted"]))
    return [(r.values, r.indices)]


@register_kernel(
    "gather",
    schema=KernelSchema(
        inputs=(1, 2),
        attrs={"dim": DIM},
        consts={"index": Const(("int64",), (0, 8), required=False)},
        extra=_index_given,
    ),
)
def gather(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``torch.gather(x, dim, index)``; the index is the second input or the constant ``index``."""
    index = args[1] if len(args) > 1 else state["index"]
    return [torch.gather(args[0], int(inst.attrs["dim"]), index)]
