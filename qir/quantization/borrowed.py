"""A deep copy of a user's model that borrows its parameters and buffers until they are needed.

``prepare_qat_fx`` (and ``fuse_fx``) deep-copy the user's model so that the model is never
modified, then trace the copy and fold its batch norms into new tensors. Most of a CNN's
weights are folded: copying them first is a copy nobody keeps (on resnet50, 0.05 s of a 0.4 s
prepare, most of it the first write to a fresh 100 MB). :func:`borrowing_copy` deep-copies the
module tree only; the copy holds the user's own parameter and buffer objects, and
:class:`Borrowed` swaps in a copy of a user tensor (``copy.deepcopy`` of it, one memo for
all: the copies share storage exactly as the originals do) wherever one survives, before
anything can write to it:

* the traced graph runs on real tensors (the typing run of a graph the shape formulas do not
  cover): every borrowed tensor of the copy is owned first (:meth:`Borrowed.own_module`);
* a pass of the user's runs on the graph: the same, first;
* after fusion, the graph's constants, the modules it keeps as objects and the modules whose
  wrapped methods it calls own theirs (:meth:`Borrowed.own_graph`); what else of the copy holds a
  user tensor (a conv whose weight was folded into a new constant, a folded batch norm) is never
  installed into a model.

qir's own passes bind new tensors and never write into a constant (passes/constant_guard.py),
and the version counters of the borrowed tensors are checked when fusion is done
(:meth:`Borrowed.check_untouched`), so an in-place write that slipped through fails loudly.
A model that keeps a parameter or buffer in a plain attribute too (where :meth:`own_module`
would not see it), and a GraphModule (whose ``meta`` may hold anything), are deep-copied whole.
"""

from __future__ import annotations

import collections
import copy
import types
from typing import Any

import torch
import torch.fx
from torch import nn

from qir.ir.graph import Graph

__all__ = ["Borrowed", "borrowing_copy", "with_empty_containers"]

#: nn.Module attributes that hold its state and hooks, never aliases of its tensors: the state
#: tables, and whatever else ``nn.Module.__init__`` sets (hook tables, flags), which the walk for
#: tensors in plain attributes need not open (on resnet50 about 3,000 tables)
_MODULE_SLOTS = frozenset({"_parameters", "_buffers", "_modules", *nn.Module().__dict__}) - {"training"}


class Borrowed:
    """The user's tensors a :func:`borrowing_copy` shares, and their copies once owned."""

    def __init__(self, tensors: dict[int, torch.Tensor], names: dict[int, str]) -> None:
        self.tensors = tensors  # id -> the user's parameter / buffer
        self.names = names  # id -> its (first) state-dict key in the user's model
        self.versions = {key: t._version for key, t in tensors.items()}
        self.memo: dict[int, Any] = {}  # deepcopy's memo: one copy per tensor and per storage

    def own(self, t: Any) -> Any:
        """``t``'s copy when ``t`` is a borrowed tensor, else ``t``."""
        if isinstance(t, torch.Tensor) and id(t) in self.tensors:
            return copy.deepcopy(t, self.memo)
        return t

    def own_module(self, module: nn.Module) -> None:
        """Make every parameter and buffer of ``module`` and its submodules its own."""
        for m in module.modules():
            for slots in (m._parameters, m._buffers):
                for name, t in slots.items():
                    if t is not None and id(t) in self.tensors:
                        slots[name] = self.own(t)

    def own_graph(self, graph: Graph) -> None:
        """Make the graph's constants, and the modules it holds as objects, their own: opaque
        modules, and the module a wrapped method runs on (its bound method is the call's target,
        and the method reads whatever of that module it likes, e.g. a float conv inside it)."""
        for key, t in graph.constants.items():
            graph.constants[key] = self.own(t)
        for obj in graph.objects.values():
            owner = obj.__self__ if isinstance(obj, types.MethodType) else obj
            if isinstance(owner, nn.Module):
                self.own_module(owner)

    def check_untouched(self) -> None:
        """Refuse when a borrowed tensor was written in place (the user's model would have changed)."""
        for key, t in self.tensors.items():
            if t._version != self.versions[key]:
                raise RuntimeError(
                    f"preparing wrote into the model's tensor {self.names[key]!r} in place (the input model must "
                    "stay as it was); a pass must bind a new tensor instead (passes/constant_guard.py). Please report "
                    "this with the model"
                )


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors in an attribute value: the value, or the items of a list / tuple / set / dict."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _borrowable(model: nn.Module) -> Borrowed | None:
    """The parameters and buffers of ``model``, or None when the copy must be whole: a
    GraphModule, or a module that holds one of them (or a view of one) in a plain attribute."""
    if isinstance(model, torch.fx.GraphModule):
        return None
    tensors: dict[int, torch.Tensor] = {}
    names: dict[int, str] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for slots in (m._parameters, m._buffers):
            for leaf, t in slots.items():
                if t is not None:
                    tensors[id(t)] = t
                    names.setdefault(id(t), f"{path}.{leaf}" if path else leaf)
    storages = {_storage(t) for t in tensors.values()}
    if None in storages:
        return None
    storages.discard(0)
    for m in model.modules():
        for name, value in m.__dict__.items():
            if name in _MODULE_SLOTS:
                continue
            for t in _tensors_in(value):
                if id(t) in tensors or _storage(t) in storages:
                    return None
    return Borrowed(tensors, names)


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (0: none, a meta tensor), None for a tensor without one (sparse)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


#: container types ``copy.deepcopy`` copies through ``__reduce_ex__``, recomputing the type's slot
#: names every time (a builtin type cannot cache them): about 15 us for each empty hook table
_SLOW_CONTAINERS = (collections.OrderedDict, set)


def with_empty_containers(root: nn.Module, memo: dict[int, Any]) -> dict[int, Any]:
    """``memo`` (for ``copy.deepcopy(root, memo)``) with a new empty container for every empty
    ``OrderedDict`` and ``set`` the modules of ``root`` hold as attributes (their hook tables, the
    non-persistent buffer names): what deepcopy would make of them, without its slow path for them
    (on resnet50 about 3,000 per copy of the model). Modules already in ``memo`` are skipped."""
    for m in root.modules():
        if id(m) in memo:
            continue
        for value in m.__dict__.values():
            if type(value) in _SLOW_CONTAINERS and not value:
                memo.setdefault(id(value), type(value)())
    return memo


def borrowing_copy(model: nn.Module) -> tuple[nn.Module, Borrowed | None]:
    """A deep copy of ``model`` sharing its parameters and buffers, and what it borrows; a whole
    deep copy and None when the model cannot lend them (see the module's docstring)."""
    borrowed = _borrowable(model)
    if borrowed is None:
        return copy.deepcopy(model, with_empty_containers(model, {})), None
    return copy.deepcopy(model, with_empty_containers(model, dict(borrowed.tensors))), borrowed
