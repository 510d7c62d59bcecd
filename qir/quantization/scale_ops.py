"""Which fx calls keep their input's scale, and which only query it (shared by convert and hybrid).

A scale-preserving op computes on integer codes exactly as on the values they stand for
(relu, max pool, reshape / view / flatten / permute / getitem, nearest interpolate,
identity, dropout), so its output has its input's scale and needs no quantized module of
its own. ``convert_fx`` passes scales through these ops; hybrid preparation keeps them on
the BPU when their input is quantized.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRESERVING_FUNCTIONS",
    "PRESERVING_METHODS",
    "PRESERVING_MODULES",
    "QUERY_METHODS",
    "is_nearest",
    "is_preserving_call",
    "module_self",
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
)


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


def module_self(gm: torch.fx.GraphModule, n: torch.fx.Node) -> nn.Module | None:
    """The module whose method a ``call_method`` node calls (``self.ff.add(...)``), else None."""
    if n.op != "call_method" or not n.args or not isinstance(n.args[0], torch.fx.Node) or n.args[0].op != "get_attr":
        return None
    try:
        obj = gm.get_submodule(str(n.args[0].target))
    except AttributeError:
        return None
    return obj
