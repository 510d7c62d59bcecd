"""Which fx calls keep their input's scale, and which only query it (shared by convert and hybrid).

A scale-preserving op computes on integer codes exactly as on the values they stand for
(relu, max pool, reshape / view / flatten / permute / getitem, nearest interpolate,
identity, dropout), so its output has its input's scale and needs no quantized module of
its own. ``convert_fx`` passes scales through these ops; hybrid preparation keeps them on
the BPU when their input is quantized.

:data:`CODE_OPS` are the ops that also compute exactly on codes but whose integer form
``convert_fx`` derives per call (:mod:`qir.quantization.code_convert`): abs, clamp, pad,
gather, max / min, top-k, arg-reductions and comparisons. Some keep the input's scale,
some return indices or booleans, which are exact values and carry no scale.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = [
    "same_scales",
    "scales_differ",
    "CODE_OPS",
    "PRESERVING_FUNCTIONS",
    "PRESERVING_METHODS",
    "PRESERVING_MODULES",
    "QUERY_FUNCTIONS",
    "QUERY_METHODS",
    "code_op",
    "is_nearest",
    "is_preserving_call",
    "module_self",
    "pair_item",
]

PRESERVING_FUNCTIONS: set[Any] = {
    operator.getitem,
    torch.flatten,
    torch.reshape,
    torch.permute,
    torch.transpose,
    torch.squeeze,
    torch.unsqueeze,
    torch.split,
    torch.chunk,
    torch.unbind,
    torch.relu,
    F.relu,
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    torch.max_pool2d,
    F.adaptive_max_pool2d,
    F.pixel_shuffle,
    F.pixel_unshuffle,
    F.channel_shuffle,
    torch.flip,
    torch.roll,
    F.dropout,
    F.dropout2d,
    torch.dropout,
    F.interpolate,
    F.relu6,
    F.hardtanh,
}
PRESERVING_METHODS = {
    "view",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "contiguous",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "repeat",
    "split",
    "chunk",
    "unbind",
    "relu",
    "clone",
    "detach",
    "flip",
    "roll",
    "view_as",
    "reshape_as",
    "__getitem__",
    "tile",
}
#: calls whose result is not a tensor (shape queries)
QUERY_METHODS = {"size", "dim", "numel", "nelement", "ndimension"}
#: functions reading a tensor's shape (``x.shape`` is ``getattr``): their results are exact ints, never codes
QUERY_FUNCTIONS: frozenset[object] = frozenset({getattr, len, torch.numel, torch.Tensor.size, torch.Tensor.dim})
PRESERVING_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.Flatten,
    nn.Unflatten,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.ChannelShuffle,
    # padding moves data; a constant pad's value becomes a code at conversion (code_convert)
    nn.ZeroPad1d,
    nn.ZeroPad2d,
    nn.ZeroPad3d,
    nn.ConstantPad1d,
    nn.ConstantPad2d,
    nn.ConstantPad3d,
    nn.ReplicationPad1d,
    nn.ReplicationPad2d,
    nn.ReplicationPad3d,
    nn.ReflectionPad1d,
    nn.ReflectionPad2d,
    nn.ReflectionPad3d,
    nn.CircularPad1d,
    nn.CircularPad2d,
    nn.CircularPad3d,
)

# what a code op returns (CODE_OPS values)
CODES = "codes"  # codes at the input's scale
REDUCE = "reduce"  # max / min: codes (whole tensor), or (values, indices) along a dim
PAIR = "pair"  # (values at the input's scale, indices)
INDEX = "index"  # int64 indices: exact, no scale
BOOL = "bool"  # booleans: exact, no scale

#: IR op name -> what the op returns on codes (every spelling of the op: ``torch.clip``,
#: ``Tensor.greater``, ``operator.gt`` ... resolve to their op through the op registry).
CODE_OPS: dict[str, str] = {
    "abs": CODES,
    "clamp": CODES,
    "pad": CODES,
    "gather": CODES,
    "max": REDUCE,
    "min": REDUCE,
    "topk": PAIR,
    "argmax": INDEX,
    "argmin": INDEX,
    **dict.fromkeys(("eq", "ne", "gt", "ge", "lt", "le"), BOOL),
}


def same_scales(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether two call sites of one module see the same input scales (one quantized module can serve both)."""
    return len(a) == len(b) and all(x.shape == y.shape and bool(torch.equal(x, y)) for x, y in zip(a, b, strict=True))


def scales_differ(sites: Sequence[Sequence[torch.Tensor]]) -> bool:
    """Whether a module's call sites (each its input scales) see different scales: one quantized
    module with fixed input scales cannot serve them all."""
    return any(not same_scales(sites[0], other) for other in sites[1:])


def is_nearest(n: torch.fx.Node) -> bool:
    """Whether an ``F.interpolate`` node resizes with mode ``nearest`` (its default)."""
    mode = n.kwargs.get("mode", n.args[3] if len(n.args) > 3 else "nearest")
    return mode == "nearest"


def is_preserving_call(n: torch.fx.Node) -> bool:
    """A call_function / call_method node that runs exactly on codes (``F.interpolate`` only when nearest,
    ``F.hardtanh`` only as relu6)."""
    if n.op == "call_method":
        return n.target in PRESERVING_METHODS
    if n.op != "call_function" or n.target not in PRESERVING_FUNCTIONS:
        return False
    if n.target is F.interpolate:
        return is_nearest(n)
    if n.target is F.hardtanh:
        return bool(n.kwargs.get("min_val", n.args[1] if len(n.args) > 1 else -1.0) == 0.0)
    return True


def code_op(n: torch.fx.Node) -> str | None:
    """The :data:`CODE_OPS` op a ``call_function`` / ``call_method`` node calls, else None."""
    from qir.frontend.lookup import tables

    if n.op == "call_function":
        cls = tables().for_function(n.target)  # type: ignore[arg-type]
    elif n.op == "call_method":
        cls = tables().by_method.get(str(n.target))
    else:
        return None
    name = cls.name if cls is not None else None
    return name if name in CODE_OPS else None


def pair_item(n: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """``(source, 0 | 1)`` when ``n`` reads the values (0) or indices (1) of a call's result:
    ``r[0]``, ``r[1]`` (or ``r[-2]``, ``r[-1]``), ``r.values``, ``r.indices``. Whether ``source`` returns such a pair is
    for the caller to know."""
    if n.op != "call_function" or len(n.args) != 2 or not isinstance(n.args[0], torch.fx.Node):
        return None
    key = n.args[1]
    if n.target is operator.getitem and isinstance(key, int) and not isinstance(key, bool) and -2 <= key <= 1:
        return n.args[0], key % 2
    if n.target is getattr and key in ("values", "indices"):
        return n.args[0], 0 if key == "values" else 1
    return None


def module_self(gm: torch.fx.GraphModule, n: torch.fx.Node) -> nn.Module | None:
    """The module whose method a ``call_method`` node calls (``self.ff.add(...)``), else None."""
    if n.op != "call_method" or not n.args or not isinstance(n.args[0], torch.fx.Node) or n.args[0].op != "get_attr":
        return None
    try:
        obj = gm.get_submodule(str(n.args[0].target))
    except AttributeError:
        return None
    return obj
