"""Resize kernels on codes with integer tables computed at lowering for the compiled input size:
nearest (source indices per axis) and bilinear (two taps and fixed-point weights per axis)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.common.kernels.base import qbounds, register_kernel, requant_i64, sat_to
from backends.common.kernels.infer import ShapeError, code, meta, tensor_arg
from backends.common.kernels.schema import MAX_COUNT, MULT, OUT_DTYPE, SHIFT, Const, KernelSchema, ints
from backends.common.program import Instruction

_BILINEAR_CONSTS = (
    "hi0",
    "hi1",
    "wi0",
    "wi1",
    *(f"{a}{i}_{b}" for a in ("hw", "ww") for i in (0, 1) for b in (12, 15)),
)


def _check_size(inst: Instruction, args: list[Any]) -> None:
    """The tables were computed for one input size and output size: refuse others. A run-time
    output size (``size=lateral.shape[2:]``) is the kernel's second input."""
    x = args[0]
    h, w = inst.attrs["in_size"]
    if (int(x.shape[-2]), int(x.shape[-1])) != (int(h), int(w)):
        raise ValueError(f"{inst.op} ({inst.source}): compiled for input size {h}x{w}, got {x.shape[-2]}x{x.shape[-1]}")
    if len(args) > 1:
        size = args[1]
        got = (int(size), int(size)) if isinstance(size, int) else tuple(int(s) for s in size)[-2:]
        oh, ow = inst.attrs["out_size"]
        if got != (int(oh), int(ow)):
            raise ValueError(f"{inst.op} ({inst.source}): compiled for output size {oh}x{ow}, asked for {got}")


def _indices_in(name: str, t: torch.Tensor, size: int) -> None:
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= size):
        raise ShapeError(f"index table {name} holds {int(t.min())}..{int(t.max())}, outside [0, {size})")


def _resize_input(inst: Instruction, args: list[Any]) -> torch.Tensor:
    """What ``_check_size`` checks at run, at the declared shapes."""
    x = tensor_arg(args, 0, rank=(2, 8))
    h, w = (int(v) for v in inst.attrs["in_size"])
    if (int(x.shape[-2]), int(x.shape[-1])) != (h, w):
        raise ShapeError(f"compiled for input size {h}x{w}, the input is {list(x.shape)}")
    if len(args) > 1:
        size, out = args[1], inst.attrs.get("out_size")
        ok = isinstance(size, int) or (
            isinstance(size, (tuple, list)) and len(size) >= 1 and all(isinstance(s, int) for s in size)
        )
        if not ok:
            raise ShapeError(f"the output size input must be an int or a sequence of ints, got {size!r:.60}")
        if out is None:
            raise ShapeError("a run-time output size needs the out_size attribute to compare with")
        got = [int(size)] * 2 if isinstance(size, int) else [int(s) for s in size][-2:]
        if got != [int(v) for v in out]:
            raise ShapeError(f"compiled for output size {list(out)}, asked for {got}")
    return x


def _nearest_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = _resize_input(inst, args)
    rows, cols = consts[inst.consts["rows"]], consts[inst.consts["cols"]]
    _indices_in("rows", rows, int(x.shape[-2]))
    _indices_in("cols", cols, int(x.shape[-1]))
    return [meta((*x.shape[:-2], rows.numel(), cols.numel()), x.dtype)]


def _bilinear_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = _resize_input(inst, args)
    c = {role: consts[name] for role, name in inst.consts.items()}
    oh, ow = c["hi0"].numel(), c["wi0"].numel()
    for role, t in c.items():
        want = oh if role[0] == "h" else ow
        if t.numel() != want:
            raise ShapeError(f"table {role} has {t.numel()} entries, {'hi0' if want == oh else 'wi0'} has {want}")
    for role in ("hi0", "hi1"):
        _indices_in(role, c[role], int(x.shape[-2]))
    for role in ("wi0", "wi1"):
        _indices_in(role, c[role], int(x.shape[-1]))
    return [code((*x.shape[:-2], oh, ow), inst.attrs["out_dtype"])]


@register_kernel(
    "resize_nearest",
    schema=KernelSchema(
        inputs=(1, 2),  # the second: a run-time output size, checked against out_size
        attrs={"in_size": ints(1, MAX_COUNT, 2), "out_size": ints(1, MAX_COUNT, 2, required=False)},
        consts={"rows": Const(("int64",), (1, 1)), "cols": Const(("int64",), (1, 1))},
        shape=_nearest_shape,
    ),
)
def resize_nearest(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    x = args[0]
    _check_size(inst, args)
    return [x.index_select(-2, state["rows"]).index_select(-1, state["cols"])]


@register_kernel(
    "resize_bilinear",
    schema=KernelSchema(
        inputs=(1, 2),
        attrs={
            "in_size": ints(1, MAX_COUNT, 2),
            "out_size": ints(1, MAX_COUNT, 2, required=False),
            "multiplier12": MULT,
            "shift12": SHIFT,
            "multiplier15": MULT,
            "shift15": SHIFT,
            "out_dtype": OUT_DTYPE,
        },
        consts={k: Const(("int64",), (1, 1)) for k in _BILINEAR_CONSTS},
        shape=_bilinear_shape,
    ),
)
def resize_bilinear(inst: Instruction, args: list[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
    """``acc = sum w_y * w_x * q`` in int64, then one requantization (int64: with int16 input
    ``|acc * M|`` reaches 2**60, beyond float64's exact range)."""
    x = args[0]
    _check_size(inst, args)
    a = inst.attrs
    bits = 12 if x.dtype == torch.int8 else 15
    s = state
    q = x.to(torch.int64)
    hw0, hw1 = s[f"hw0_{bits}"].to(torch.int64)[:, None], s[f"hw1_{bits}"].to(torch.int64)[:, None]
    rows = q.index_select(-2, s["hi0"]) * hw0 + q.index_select(-2, s["hi1"]) * hw1
    ww0, ww1 = s[f"ww0_{bits}"].to(torch.int64), s[f"ww1_{bits}"].to(torch.int64)
    acc = rows.index_select(-1, s["wi0"]) * ww0 + rows.index_select(-1, s["wi1"]) * ww1
    out = requant_i64(acc, torch.tensor(int(a[f"multiplier{bits}"])), torch.tensor(int(a[f"shift{bits}"])), None)
    dt = str(a["out_dtype"])
    lo, hi = qbounds(dt)
    return [sat_to(out.clamp_(lo, hi), dt)]
