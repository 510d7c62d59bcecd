"""FloatFunctional methods called with fx-traced values record themselves as one method call.

A graph calls a FloatFunctional (float, QAT or integer) by method: ``get_attr(ff)`` then
``call_method("add", ff, x, y)``. fx's ``torch.load`` of a GraphModule (and any
``torch.fx.symbolic_trace`` of one) re-traces the generated code with every submodule a leaf,
but a method is not a module call: without this the tracer ran the method body on proxies,
which the integer methods cannot (``mean`` computes its divisor from the shapes) and which
turned a QAT method into loose float ops that ``convert_fx`` no longer recognises. Recording
the call as it was written gives back the graph that was saved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch.fx
from torch import nn

from qir.utils.fx_helper import _find_proxy

__all__ = ["record_method_calls", "traced_as_method_call"]


def traced_as_method_call(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (named ``name`` on its class) that, called with fx proxies, records
    ``call_method(name, get_attr(self), *args)`` instead of running (a tracer without module paths
    runs the body, as before)."""

    @functools.wraps(method)
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        proxy = _find_proxy(args, kwargs)
        if proxy is None:
            return method(self, *args, **kwargs)
        tracer = proxy.tracer
        path_of_module = getattr(tracer, "path_of_module", None)
        if path_of_module is None:
            return method(self, *args, **kwargs)
        # a FloatFunctional outside the traced model raises fx's NameError naming it, as its
        # output fake quant's module call did before
        owner = tracer.create_proxy("get_attr", path_of_module(self), (), {})
        out: torch.fx.Proxy = tracer.create_proxy("call_method", name, (owner, *args), kwargs)
        return out

    return call


def record_method_calls(cls: type, names: Iterable[str]) -> None:
    """Make each of ``cls``'s methods ``names`` a :func:`traced_as_method_call`."""
    for name in names:
        setattr(cls, name, traced_as_method_call(name, getattr(cls, name)))
