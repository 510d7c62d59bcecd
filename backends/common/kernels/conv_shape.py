"""Output shapes and work space of the ``conv2d`` / ``conv_nd`` / ``linear`` kernels (their
declarations; the kernels and schemas are in :mod:`backends.common.kernels.conv`).

The spatial arithmetic is torch's: the declaration calls the convolution the engine calls
(``F.conv2d`` / ``F.conv1d`` / ``F.conv3d`` / ``F.conv_transpose2d``) on meta tensors of the
input's shape and the weight constant's shape, so a forged stride, padding, dilation or group
count that leaves no output, or an input whose channels do not fit the weight, is refused at
load with torch's own words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from backends.common.kernels.infer import ShapeError, code, meta, meta_call, tensor_arg
from backends.common.program import Instruction

__all__ = ["conv2d_shape", "conv_nd_shape", "conv_work", "linear_shape"]

#: engines that read int8 codes only (``torch._int_mm``, the native depthwise loop)
_INT8_ENGINES = ("int_mm", "int_mm_t", "dw")


def _weight(inst: Instruction, consts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    w = consts[inst.consts["weight"]]
    return meta(w.shape, torch.float64)


def _input(inst: Instruction, args: list[Any], rank: int, kind: str) -> torch.Tensor:
    if inst.op != "conv_nd" and inst.attrs["kind"] != kind:
        raise ShapeError(f"kind {inst.attrs['kind']!r} does not run on the {inst.op} kernel")
    x = tensor_arg(args, 0, "x", rank=(rank, rank) if rank else (1, 8))
    if x.is_floating_point() or x.dtype == torch.bool:
        raise ShapeError(f"{inst.op} takes integer codes, got {x.dtype}")
    if inst.attrs["engine"] in _INT8_ENGINES and x.dtype != torch.int8:
        raise ShapeError(f"the {inst.attrs['engine']} engine takes qint8 codes, got {x.dtype}")
    return x


def _with_addend(inst: Instruction, args: list[Any], out: torch.Size) -> list[Any]:
    if len(args) > 1:
        addend = tensor_arg(args, 1, "addend")
        if addend.shape != out:
            raise ShapeError(f"the addend has shape {list(addend.shape)}, the output {list(out)}")
        if addend.is_floating_point() or addend.dtype == torch.bool:
            raise ShapeError(f"the addend must be integer codes, got {addend.dtype}")
        if inst.attrs["engine"] in _INT8_ENGINES and addend.dtype not in (torch.int8, torch.int16):
            # the native fused add reads qint8 or qint16 codes
            raise ShapeError(f"the {inst.attrs['engine']} engine adds qint8 or qint16 codes, got {addend.dtype}")
    return [code(out, inst.attrs["out_dtype"])]


def _padded(x: torch.Tensor, a: Mapping[str, Any]) -> tuple[torch.Tensor, Any]:
    """The input as the kernel convolves it: padded first for a non-zeros padding mode."""
    xf = meta(x.shape, torch.float64)
    if a.get("padding_mode", "zeros") != "zeros":
        xf = meta_call("padding", F.pad, xf, list(a["reversed_padding"]), mode=str(a["padding_mode"]))
        return xf, 0
    return xf, a["padding"]


def conv2d_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    a = inst.attrs
    x = _input(inst, args, 4, "conv2d")
    w = _weight(inst, consts)
    xf, padding = _padded(x, a)
    if a["engine"] == "f32_chunked":
        stop = max(int(c1) for _, c1 in a["chunks"])
        if stop > w.shape[1] or int(a["groups"]) != 1:
            raise ShapeError(f"chunks reach input channel {stop} of a weight with {w.shape[1]} (groups must be 1)")
    y = meta_call("conv2d", F.conv2d, xf, w, None, a["stride"], padding, a["dilation"], int(a["groups"]))
    return _with_addend(inst, args, y.shape)


_ND = ("conv1d", "conv3d", "conv_transpose2d")


def conv_nd_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    a = inst.attrs
    kind = str(a["kind"])
    if kind not in _ND:
        raise ShapeError(f"kind {kind!r} does not run on the conv_nd kernel (conv1d, conv3d, conv_transpose2d)")
    x = _input(inst, args, {"conv1d": 3, "conv3d": 5, "conv_transpose2d": 4}[kind], kind)
    w = _weight(inst, consts)
    if kind == "conv_transpose2d":
        if "output_padding" not in a:
            raise ShapeError("conv_transpose2d needs the output_padding attribute")
        y = meta_call(
            kind,
            F.conv_transpose2d,
            meta(x.shape, torch.float64),
            w,
            None,
            a["stride"],
            a["padding"],
            a["output_padding"],
            int(a["groups"]),
            a["dilation"],
        )
        if y.shape[1] != consts[inst.consts["bias"]].numel():
            raise ShapeError(f"{y.shape[1]} output channels, the bias has {consts[inst.consts['bias']].numel()}")
    else:
        xf, padding = _padded(x, a)
        fn = F.conv1d if kind == "conv1d" else F.conv3d
        y = meta_call(kind, fn, xf, w, None, a["stride"], padding, a["dilation"], int(a["groups"]))
    return _with_addend(inst, args, y.shape)


def linear_shape(inst: Instruction, args: list[Any], consts: Mapping[str, torch.Tensor]) -> list[Any]:
    x = _input(inst, args, 0, "linear")
    w = consts[inst.consts["weight"]]
    if x.shape[-1] != w.shape[1]:
        raise ShapeError(f"the input has {x.shape[-1]} features (shape {list(x.shape)}), the weight {w.shape[1]}")
    return _with_addend(inst, args, torch.Size((*x.shape[:-1], w.shape[0])))


def conv_work(inst: Instruction, args: list[Any], outs: list[Any]) -> int:
    """Columns (im2col: one row of ``C_in/groups * prod(kernel)`` entries per output position,
    float64 on the float engines), a float64 copy of the input, and a float64 accumulator and
    requantization buffer per output element."""
    x, y = args[0], outs[0]
    if inst.op == "linear":
        rows, k = y.numel() // max(1, y.shape[-1]), x.shape[-1]
    else:
        rows = y.numel() // max(1, y.shape[1])
        k = x.shape[1] // max(1, int(inst.attrs.get("groups", 1)))
        for d in inst.attrs.get("kernel_size") or []:
            k *= int(d)
    return int(8 * rows * k + 16 * y.numel() + 8 * x.numel())
