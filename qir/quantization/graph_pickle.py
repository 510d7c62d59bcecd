"""``torch.save`` / ``torch.load`` of prepared and converted models keep what fx's pickling drops.

fx pickles a GraphModule as its generated code plus its ``__dict__`` and, on load, re-traces
the code into a fresh ``GraphModule``. For qir's models that loses three things:

* the class: a prepared model is a :class:`~qir.quantization.exact_validation.QATGraphModule`,
  whose validation forward runs the integer twin (QAT validation == converted bit for bit); a
  plain GraphModule runs the float fake-quant simulation instead;
* ``meta`` and the module hooks, which ``GraphModule.__init__`` resets: the prepare record, the
  integer-grid switch, the prepared wrapped modules, the hook that keeps a wrapped method's
  ``self.training`` in step with the model;
* a call of an ``fx_wrap``-ed method is a bound method in the code's globals, which fx writes
  as an import and cannot (``ObjMismatchError``): such a model did not save at all.

:class:`PicklableGraphModule` pickles the wrapped methods as objects (``getattr(owner, name)``;
the owner, its generated stubs and prepared modules are pickled with the model, so the loaded
wrapped code calls the loaded model's modules) and restores class, ``meta`` and hooks on load.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.graph_module import _deserialize_graph_module, _format_import_block, _forward_from_src
from torch.package import sys_importer

from qir.utils.fx_helper import wrapped_original

__all__ = ["PicklableGraphModule", "make_picklable", "reclass", "wrapped_selves"]

#: what ``GraphModule.__init__`` resets and fx's loader therefore drops from the pickled ``__dict__``:
#: ``meta``, the GraphModule's deep-copy hooks, and every hook table (and the backward-hook kind flag)
#: ``nn.Module.__init__`` sets, read from torch so that a table a torch release adds is kept too
_RESTORED = (
    "meta",
    "_deepcopy_hooks",
    *(name for name in nn.Module().__dict__ if "hook" in name),
)


def wrapped_selves(gm: torch.fx.GraphModule) -> list[nn.Module]:
    """The modules ``gm``'s wrapped method calls are bound to (each once)."""
    found: dict[int, nn.Module] = {}
    for n in gm.graph.nodes:
        t = n.target
        if n.op == "call_function" and isinstance(t, types.MethodType) and wrapped_original(t) is not None:
            if isinstance(t.__self__, nn.Module):
                found.setdefault(id(t.__self__), t.__self__)
    return list(found.values())


def _base_class(gm: torch.fx.GraphModule) -> type:
    """The class under fx's per-instance ``GraphModuleImpl`` (QATGraphModule, GraphModule, ...)."""
    for t in type(gm).__mro__:
        if t.__qualname__.split(".")[-1] != "GraphModuleImpl":
            return t
    return torch.fx.GraphModule


class PicklableGraphModule(torch.fx.GraphModule):
    """A GraphModule whose pickle keeps its class, ``meta``, hooks and wrapped-method calls.

    ``train()`` / ``eval()`` also set the mode of the modules its wrapped methods are bound to (not
    submodules; qir.quantization.wrapped_self): convert_fx's typing run calls the wrapped code
    outside the model's forward, where the forward pre-hook that syncs them does not run."""

    def train(self, mode: bool = True) -> PicklableGraphModule:
        super().train(mode)
        for m in wrapped_selves(self):
            m.train(mode)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        body = self.__dict__.copy()
        code = self.recompile()
        wrapped = {
            name: fn
            for name, fn in code.globals.items()
            if isinstance(fn, types.MethodType) and wrapped_original(fn) is not None
        }
        imports = _format_import_block({k: v for k, v in code.globals.items() if k not in wrapped}, sys_importer)
        del body["_graph"]
        return (_rebuild, (_base_class(self), body, imports, wrapped))


def _rebuild(
    base: type, body: dict[str, Any], imports: str, wrapped: dict[str, types.MethodType]
) -> torch.fx.GraphModule:
    kept = {k: body[k] for k in _RESTORED if k in body}
    # the wrapped methods are globals of the re-executed code; re-tracing records them as calls again
    forward = _forward_from_src(imports + body["_code"], dict(wrapped))
    gm = _deserialize_graph_module(forward, body, graph_module_cls=base)
    assert isinstance(gm, torch.fx.GraphModule)
    gm.__dict__.update(kept)
    return gm


def make_picklable(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give ``gm`` (a converted model calling wrapped methods) :class:`PicklableGraphModule`'s
    pickling, in place; deep copies keep it. Prepared models have it through their class."""
    if not isinstance(gm, PicklableGraphModule):
        reclass(gm, PicklableGraphModule)
    return gm


def reclass(gm: torch.fx.GraphModule, base: type) -> None:
    """Make ``gm`` an instance of ``base`` (a GraphModule class), in place; deep copies keep it.

    fx gives every GraphModule instance its own ``GraphModuleImpl`` subclass holding its
    generated ``forward``; ``gm`` gets a fresh one under ``base`` and regenerates it."""
    # qualname "GraphModuleImpl": fx's __new__ (deepcopy) skips such classes to find the real
    # base; __name__ stays the model's class name, as GraphModule.__init__ set it
    impl = type("GraphModuleImpl", (base,), {})
    impl.__name__ = type(gm).__name__
    gm.__class__ = impl
    gm.recompile()
