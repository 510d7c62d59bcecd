"""The scale travels with the codes: one eager ``DeQuantStub`` for outputs of different scales.

The plugin's users call one ``DeQuantStub`` on every head's output. The plugin accepts it because
its quantized tensors (``QTensor``) carry their scale and its converted stub calls
``x.dequantize()``. qir's eager converted modules pass plain integer codes, so a model whose
``DeQuantStub`` has call sites of different input scales gets the same property by tagging:

* every converted module (and every ``QFunctional`` method call) writes ``(scale, axis)`` of the
  codes it returns on the output tensor (:data:`~qir.nn.quantized.stubs.SCALE_TAG`); a module that
  keeps its input's scale and has no ``scale`` of its own passes its input's tag on;
* while the converted model's forward runs, a ``TorchFunctionMode`` passes the tag through the
  torch functions that keep values and scale (view, reshape, flatten, permute, getitem,
  contiguous, ... the list eager recording uses in QAT); a per-channel (high-precision qint32)
  tag only through those that keep the layout (contiguous, clone, detach), since its axis would
  move otherwise. Any other function's result carries no tag;
* the stub (:class:`~qir.nn.quantized.stubs.PerCallDeQuantStub`) dequantizes with its input's tag
  and refuses codes without one, naming itself.

Nothing here depends on the order of the calls. Only models with such a stub are tagged: the
hooks cost a dictionary write per module call, the mode a set lookup per torch call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from qir.frontend.convert import FORWARD_CONTEXT
from qir.nn.quantized._base import QuantizedModule
from qir.nn.quantized.functional import TAG_OUTPUTS, QFunctional
from qir.nn.quantized.stubs import SCALE_TAG, DeQuantStub, PerCallDeQuantStub, scale_tag_of
from qir.quantization.eager_record import KEEPS_LAYOUT, PRESERVING
from qir.quantization.outer_forward import OuterForward

__all__ = ["install_scale_tags", "passing_tags", "tag_of_module"]


class _PassTags(TorchFunctionMode):
    """Active during the converted model's forward: tags follow the codes through scale-keeping functions."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root = root

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in PRESERVING and args:
            tag = scale_tag_of(args[0])
            if tag is not None and (tag[1] is None or func in KEEPS_LAYOUT):
                _tag(out, tag)
        elif isinstance(out, torch.Tensor) and SCALE_TAG in out.__dict__:
            del out.__dict__[SCALE_TAG]  # an in-place op that is not scale-keeping changed the codes
        return out


def _tag(out: Any, tag: tuple[torch.Tensor, int | None]) -> None:
    if isinstance(out, torch.Tensor):
        if not out.is_floating_point():
            out.__dict__[SCALE_TAG] = tag
    elif isinstance(out, (list, tuple)):
        for o in out:
            _tag(o, tag)


def tag_of_module(m: nn.Module, args: Sequence[Any]) -> tuple[torch.Tensor, int | None] | None:
    """The tag of converted module ``m``'s output: its ``scale`` (per channel along ``-scale.dim()``),
    or, for a module without one that keeps its input's scale, its input's tag."""
    scale = getattr(m, "scale", None)
    if isinstance(scale, torch.Tensor):
        return scale, (None if scale.numel() == 1 else -scale.dim())
    if getattr(m, "is_scale_preserving", False) and args:
        return scale_tag_of(args[0])
    return None


def _module_hook(m: nn.Module, args: Any, out: Any) -> None:
    if isinstance(out, torch.Tensor):  # several outputs (an LSTM cell's h, c) have several scales: no tag
        tag = tag_of_module(m, args)
        if tag is not None:
            _tag(out, tag)


def passing_tags(root: nn.Module) -> TorchFunctionMode:
    """The context the converted forward of ``root`` runs in (also entered by the front end when it runs
    the traced graph of ``root``: ``FORWARD_CONTEXT``)."""
    return _PassTags(root)


_OUTER = OuterForward(_PassTags)  # a nested call: the outer forward passes the tags


def _root_pre_hook(root: nn.Module, args: Any) -> None:
    _OUTER.enter(root)


def _root_post_hook(root: nn.Module, args: Any, out: Any) -> None:
    _OUTER.leave(root)


def install_scale_tags(root: nn.Module) -> None:
    """Make the converted model ``root`` tag its codes with their scales."""
    for m in root.modules():
        if isinstance(m, (DeQuantStub, PerCallDeQuantStub)):
            continue
        if isinstance(m, QFunctional):
            m.__dict__[TAG_OUTPUTS] = True  # its methods are no module calls: they tag their results
        elif isinstance(m, QuantizedModule):
            m.register_forward_hook(_module_hook)
    root.register_forward_pre_hook(_root_pre_hook)
    root.register_forward_hook(_root_post_hook, always_call=True)
    root.__dict__[FORWARD_CONTEXT] = passing_tags
