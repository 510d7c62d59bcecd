"""Example inputs from a prepared model's first forward, for a model prepared without them.

``convert_fx`` converts by the ``quantize`` pass when it can type the QAT model's IR, which needs
example inputs; most training scripts call ``prepare_qat_fx(model, qconfig_dict)`` without any.
Such a prepared model records detached copies of the arguments of its first call (the first
calibration or training batch) in its :class:`~qir.quantization.prepare.PrepareRecord`, the same
place ``example_inputs=`` goes: the IR is typed from real inputs, never from guessed shapes.

The hook records once (a filled record is left alone) and skips calls that do not carry concrete
CPU-or-device tensors: scripting, ``torch.jit.trace``, fx proxies, meta / fake tensors. fx's deep
copy drops forward hooks, so a deep-copy hook installs it again on every copy (the copy's record
is the copy's own, from its ``meta``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["record_first_inputs"]

#: ``GraphModule.meta`` key of the PrepareRecord (qir.quantization.prepare.PREPARE_RECORD_KEY)
_RECORD_KEY = "qir.prepare_record"


def _concrete(leaves: list[Any]) -> bool:
    """No fx proxy, no meta tensor, no tensor subclass (fake tensors of export / compile)."""
    for v in leaves:
        if isinstance(v, torch.fx.Proxy):
            return False
        if isinstance(v, torch.Tensor) and (v.is_meta or type(v) not in (torch.Tensor, torch.nn.Parameter)):
            return False
    return True


def _record(gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    record = gm.meta.get(_RECORD_KEY)
    if record is None or record.example_inputs is not None:
        return
    if torch.jit.is_scripting() or torch.jit.is_tracing():
        return
    if kwargs:  # the graph's placeholders in order, as example_inputs gives them
        try:
            bound = inspect.signature(gm.forward).bind(*args, **kwargs)
        except TypeError:
            return  # the call itself fails with the reason
        bound.apply_defaults()
        args = tuple(bound.args)
        if bound.kwargs:
            return
    leaves, _ = pytree.tree_flatten(args)
    if not _concrete(leaves):
        return
    record.example_inputs = pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, args)


def _hook(gm: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if isinstance(gm, torch.fx.GraphModule):
        _record(gm, args, kwargs)


def _install(gm: torch.fx.GraphModule) -> None:
    if _hook not in gm._forward_pre_hooks.values():
        gm.register_forward_pre_hook(_hook, with_kwargs=True)


def record_first_inputs(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Make ``gm`` (a prepared model whose record has no example inputs) record its first call's
    arguments as them, and every deep copy of it too."""
    _install(gm)
    register = getattr(gm, "_register_deepcopy_hook", None)
    if register is not None and _install not in gm.__dict__.get("_deepcopy_hooks", []):
        register(_install)
    return gm
