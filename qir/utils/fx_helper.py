"""Keep a function or method out of tracing: ``wrap`` makes it one opaque node.

Use it on code fx cannot trace (data-dependent control flow, numpy, ``self.training``
branches) or that should stay verbatim (pre/post-processing)::

    @wrap
    def post(x): ...

    class Net(nn.Module):
        @wrap()
        def _post_process(self, feat): ...

    wrap(helper)          # also patches the name ``helper`` in the calling module

While tracing, a call whose arguments hold traced values records ONE node calling the
original (for methods: the original bound to the module); the IR keeps it as an opaque
``call`` op, and the interpreter and emitted modules execute it verbatim.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch.fx
from torch import nn

F = TypeVar("F", bound=Callable[..., Any])

#: attribute set on wrappers; its value is the original function
WRAPPED_ATTR = "__qir_fx_wrapped__"


def _find_proxy(args: Any, kwargs: Any) -> torch.fx.Proxy | None:
    found: list[torch.fx.Proxy] = []

    def visit(a: Any) -> None:
        if isinstance(a, torch.fx.Proxy):
            found.append(a)

    torch.fx.node.map_aggregate((args, kwargs), visit)
    return found[0] if found else None


def _make_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxy = _find_proxy(args, kwargs)
        if proxy is None:
            return fn(*args, **kwargs)
        tracer = proxy.tracer
        if args and isinstance(args[0], nn.Module):
            # a method: record the original bound to its module, without ``self`` as an argument
            bound = types.MethodType(wrapper, args[0])
            return tracer.create_proxy("call_function", bound, tuple(args[1:]), kwargs)
        return tracer.create_proxy("call_function", wrapper, args, kwargs)

    setattr(wrapper, WRAPPED_ATTR, fn)
    return wrapper


@overload
def wrap(fn: F) -> F: ...
@overload
def wrap(fn: None = None) -> Callable[[F], F]: ...
@overload
def wrap(fn: str) -> Callable[..., Any]: ...


def wrap(fn: Any = None) -> Any:
    """Mark ``fn`` (a function, a method, or the name of a function in the calling module)
    as one opaque node when traced. Works as ``@wrap``, ``@wrap()`` and ``wrap(fn)``.

    ``wrap(fn)`` and ``wrap("name")`` called at module level also rebind that name in the
    calling module, like ``torch.fx.wrap``, so existing call sites are covered.
    """
    if fn is None:
        return _make_wrapper
    caller = inspect.currentframe()
    frame = caller.f_back if caller is not None else None
    if isinstance(fn, str):
        if frame is None or fn not in frame.f_globals:
            raise NameError(f"wrap({fn!r}): no function named {fn!r} in the calling module")
        wrapped = _make_wrapper(frame.f_globals[fn])
        frame.f_globals[fn] = wrapped
        return wrapped
    if not callable(fn):
        raise TypeError(f"wrap expects a function, a method or a function name, got {type(fn).__name__}")
    wrapped = _make_wrapper(fn)
    # at module level, rebind an existing global of that name (decorators bind it afterwards anyway)
    if frame is not None and frame.f_globals is frame.f_locals:
        name = getattr(fn, "__name__", None)
        if name is not None and frame.f_globals.get(name) is fn:
            frame.f_globals[name] = wrapped
    return wrapped


def wrapped_original(fn: Any) -> Callable[..., Any] | None:
    """The original function behind a wrapper (or a method bound from one), else None."""
    target = fn.__func__ if isinstance(fn, types.MethodType) else fn
    return getattr(target, WRAPPED_ATTR, None)


def torch_fx_wrapped(fn: Any) -> bool:
    """Whether ``fn`` is a plain function registered with ``torch.fx.wrap`` (torchvision's Swin helpers).

    torch.fx records such a call as one ``call_function`` of the function itself (no wrapper object
    to recognise): its registry, ``{(id(globals), name): globals}``, says which functions it patches."""
    if not isinstance(fn, types.FunctionType) or wrapped_original(fn) is not None:
        return False
    import torch.fx._symbolic_trace as fx_trace

    registry = getattr(fx_trace, "_wrapped_fns_to_patch", None)
    if not isinstance(registry, dict):
        return False
    g = fn.__globals__
    return (id(g), fn.__name__) in registry and g.get(fn.__name__) is fn
