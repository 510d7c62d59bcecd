"""Torch modules rebuilt around given tensors, without building their placeholder state each time.

An op's ``to_module`` builds its torch module on the meta device (no memory, no random draws) and
installs the op's own tensors in it. Constructing ``nn.Conv2d(..., device="meta")`` still runs
torch's whole ``__init__`` and ``reset_parameters`` on the placeholders (about 0.25 ms, most of it
the initialization's Python); ``prepare_qat_fx`` rebuilds every conv of a model twice (the fused
float model, then each layer's QAT conversion). :func:`meta_module` builds one prototype per class
and constructor arguments, and gives each caller a copy of it: the same attributes, its own
containers (parameters, buffers, submodules, hooks), the caller's tensors installed
(:func:`load_tensors`), and fresh meta placeholders only in the parameter or buffer slots they do not fill.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["load_tensors", "meta_module"]

#: module attributes that are containers: each copy gets its own
_CONTAINERS = (dict, set, list)
#: prototypes kept at most (distinct layer shapes of the models a process prepares)
_MAX_PROTOTYPES = 512
_prototypes: dict[tuple[Any, ...], nn.Module] = {}


def _prototype(cls: type[nn.Module], args: tuple[Hashable, ...], kwargs: dict[str, Hashable]) -> nn.Module:
    # the key holds each argument's type (True == 1 to a dict) and the default dtype the placeholders take
    key = (
        cls,
        torch.get_default_dtype(),
        tuple((type(a), a) for a in args),
        tuple((k, type(v), v) for k, v in sorted(kwargs.items())),
    )
    proto = _prototypes.get(key)
    if proto is None:
        if len(_prototypes) >= _MAX_PROTOTYPES:
            _prototypes.clear()
        proto = _prototypes[key] = cls(*args, **kwargs, device="meta")
    return proto


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    fresh = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fresh


def load_tensors(m: nn.Module, tensors: Mapping[str, torch.Tensor | None]) -> None:
    """Install ``tensors`` (by role; None entries skipped) as ``m``'s parameters / buffers, sharing
    storage: a role naming a parameter slot becomes a Parameter (a plain tensor is wrapped, trainable
    if it is floating point or already requires grad), any other role a buffer."""
    for role, t in tensors.items():
        if t is None:
            continue
        if role in m._parameters:
            grad = t.requires_grad or t.is_floating_point()
            m._parameters[role] = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=grad)
        else:
            m._buffers[role] = t


def meta_module(
    cls: type[nn.Module],
    *args: Hashable,
    tensors: Mapping[str, torch.Tensor | None] | None = None,
    instance_of: type[nn.Module] | None = None,
    **kwargs: Hashable,
) -> nn.Module:
    """What ``cls(*args, **kwargs, device="meta")`` builds, for a module class whose constructor
    keeps no reference to itself in its state (torch's conv and linear layers), with ``tensors``
    installed by :func:`load_tensors`. The constructor arguments must be hashable (ints, tuples,
    strings, bools). ``instance_of``: a subclass of ``cls`` to make the module an instance of, its
    own constructor's part left to the caller (a QAT conv's fake quants)."""
    if instance_of is not None and not issubclass(instance_of, cls):
        raise TypeError(f"meta_module: {instance_of.__name__} is not a subclass of {cls.__name__}")
    proto = _prototype(cls, args, kwargs)
    given = tensors or {}
    made = cls if instance_of is None else instance_of
    m = made.__new__(made)
    state = m.__dict__
    for key, value in proto.__dict__.items():
        state[key] = value.copy() if isinstance(value, _CONTAINERS) else value
    for slots in (m._parameters, m._buffers):
        table: dict[str, Any] = slots  # type: ignore[assignment]
        for name, t in table.items():
            if t is not None and given.get(name) is None:  # a slot the caller fills needs no placeholder
                table[name] = _placeholder(t)
    load_tensors(m, given)
    return m
