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
from backends.common.kernels.data_checks import check_index
from backends.common.kernels.infer import ShapeError, meta, meta_call, tensor_arg
from backends.common.kernels.schema import DIM, MAX_COUNT, Const, KernelSchema, boolean, integer, one_of, optional
from backends.common.program import Instruction


def _index_given(inst: Instruction, consts: Mapping[str, torch.Tensor] | None) -> str | None:
    if (len(inst.inputs) == 2) == ("index" in inst.consts):
        return "the index is either the second input or the constant 'index', exactly one of them"
    return None


def _dim(a: Mapping[str, Any]) -> int | None:
    d = a.get("dim")
    return None if d is None else int(d)


def _reduced(inst: Instruction, args: list[Any]) -> torch.Tensor:
    """The input of a reduction, which must have something to reduce along ``dim``."""
    x = tensor_arg(args, 0)
    d = _dim(inst.attrs)
    if d is None and x.numel() == 0:
        raise ShapeError(f"{inst.op} of an empty tensor (shape {list(x.shape)})")
    if d is not None and x.dim() and -x.dim() <= d < x.dim() and x.shape[d] == 0:
        raise ShapeError(f"{inst.op} along dim {d}, which is empty in shape {list(x.shape)}")
    return x


def _reduce_max_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    x = _reduced(inst, args)
    d = _dim(inst.attrs)
    if d is None:
        return [meta((), x.dtype)]
    r = meta_call(inst.op, torch.max, x, d, keepdim=bool(inst.attrs["keepdim"]))
    return [(r.values, r.indices)]


def _arg_reduce_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    x = _reduced(inst, args)
    return [meta_call(inst.op, torch.argmax, x, dim=_dim(inst.attrs), keepdim=bool(inst.attrs["keepdim"]))]


def _topk_shape(inst: Instruction, args: list[Any], consts: Any) -> list[Any]:
    a = inst.attrs
    x = tensor_arg(args, 0)
    r = meta_call("topk", torch.topk, x, int(a["k"]), dim=int(a["dim"]), largest=True, sorted=True)
    return [(r.values, r.indices)]


def _gather_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = tensor_arg(args, 0, "x")
    dim = int(inst.attrs["dim"])
    if len(args) > 1:
        index = tensor_arg(args, 1, "index")
    else:
        index = consts[inst.consts["index"]]
        if index.numel() and -x.dim() <= dim < max(x.dim(), 1):
            size = int(x.shape[dim]) if x.dim() else 1
            lo, hi = int(index.min()), int(index.max())
            if lo < 0 or hi >= size:
                raise ShapeError(f"the index constant holds {lo if lo < 0 else hi}, outside [0, {size}) of dim {dim}")
    if index.dtype != torch.int64:
        raise ShapeError(f"the gather index must be int64, got {index.dtype}")
    return [meta_call("gather", torch.gather, x, dim, meta(index.shape, torch.int64))]


@register_kernel(
    "reduce_max",
    schema=KernelSchema(
        attrs={"which": one_of("max", "min"), "dim": optional(DIM), "keepdim": boolean()}, shape=_reduce_max_shape
    ),
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
    schema=KernelSchema(
        attrs={"which": one_of("argmax", "argmin"), "dim": optional(DIM), "keepdim": boolean()},
        shape=_arg_reduce_shape,
    ),
)
def arg_reduce(inst: Instruction, args: list[Any], state: Any) -> list[Any]:
    """``which`` (argmax / argmin) of the codes along ``dim`` (None: of the flattened tensor)."""
    a = inst.attrs
    fn = torch.argmax if a["which"] == "argmax" else torch.argmin
    return [fn(args[0], dim=_dim(a), keepdim=bool(a["keepdim"]))]


@register_kernel(
    "topk",
    schema=KernelSchema(
        attrs={"k": integer(0, MAX_COUNT), "dim": DIM, "largest": boolean(), "sorted": boolean()},
        shape=_topk_shape,
    ),
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
        shape=_gather_shape,
    ),
)
def gather(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``torch.gather(x, dim, index)``; the index is the second input or the constant ``index``."""
    x, dim = args[0], int(inst.attrs["dim"])
    if len(args) > 1:  # an index from the data (a constant one was checked at load)
        index = args[1]
        check_index("gather", "the index input", index, int(x.shape[dim]) if x.dim() else 1)
    else:
        index = state["index"]
    return [torch.gather(x, dim, index)]
