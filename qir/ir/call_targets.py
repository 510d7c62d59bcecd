"""Which callables an opaque ``call`` node may name: an allowlist, never an import.

IR text is shared like data, so a ``call(kind="function", target=...)`` in it must not be
able to reach ``os.system``, ``builtins.eval`` or ``torch.load``. A function target
resolves, in order, through

1. the graph's ``objects`` (callables the user bound: the front end puts every opaque
   function it traces there; ``parse_graph(objects=...)`` passes them in),
2. :func:`register_call_target` (the user's explicit, process-wide registrations),
3. the built-in allowlist: tensor operations of ``torch``, ``torch.nn.functional``,
   ``torch.linalg``, ``torch.fft``, ``torch.special`` (the functions torch itself lists
   as tensor operations, ``torch.overrides.get_overridable_functions``, plus tensor
   factories such as ``torch.zeros``), ``torch.Tensor`` methods, the public functions of
   ``math`` and the arithmetic / comparison / item functions of ``operator``.

A dotted name is looked up in one namespace of a fixed table, one attribute deep, and the
object found must itself be on the list: resolving attribute chains from ``torch`` would
reach ``torch.os.system``, ``torch.load`` (unpickling runs code) or ``torch.from_file``.

A ``call(kind="method", target=...)`` names a method of its first operand; in IR text the
name must be a ``torch.Tensor`` method that only computes (see :func:`method_allowed`).
"""

from __future__ import annotations

import functools
import keyword
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from qir.ir.op import IRError

_REGISTERED: dict[str, Callable[..., Any]] = {}
_REGISTERED_METHODS: set[str] = set()

#: namespaces a dotted target may name, by the spellings torch.fx and users write
_NAMESPACES: dict[str, Any] = {
    "torch": torch,
    "torch.functional": torch.functional,
    "torch.nn.functional": F,
    "torch._C._nn": torch._C._nn,
    "torch.linalg": torch.linalg,
    "torch._C._linalg": torch._C._linalg,  # type: ignore[attr-defined]
    "torch.fft": torch.fft,
    "torch._C._fft": torch._C._fft,  # type: ignore[attr-defined]
    "torch.special": torch.special,
    "torch._C._special": torch._C._special,  # type: ignore[attr-defined]
    "math": math,
    "operator": operator,
    "_operator": operator,
}

#: tensor factories torch does not list as overridable (they take no tensor argument)
_TORCH_FACTORIES = (
    "arange",
    "as_tensor",
    "bartlett_window",
    "blackman_window",
    "broadcast_shapes",
    "can_cast",
    "empty",
    "eye",
    "full",
    "hamming_window",
    "hann_window",
    "is_tensor",
    "kaiser_window",
    "linspace",
    "logspace",
    "normal",
    "ones",
    "promote_types",
    "rand",
    "rand_like",
    "randint",
    "randint_like",
    "randn",
    "randn_like",
    "randperm",
    "result_type",
    "scalar_tensor",
    "tensor",
    "tril_indices",
    "triu_indices",
    "zeros",
)

#: ``operator`` functions that compute on their arguments (not attrgetter, methodcaller, call)
_OPERATOR_FUNCTIONS = (
    "abs",
    "add",
    "and_",
    "concat",
    "contains",
    "eq",
    "floordiv",
    "ge",
    "getitem",
    "gt",
    "iadd",
    "iand",
    "ifloordiv",
    "ilshift",
    "imatmul",
    "imod",
    "imul",
    "index",
    "inv",
    "invert",
    "ior",
    "ipow",
    "irshift",
    "is_",
    "is_not",
    "isub",
    "itruediv",
    "ixor",
    "le",
    "lshift",
    "lt",
    "matmul",
    "mod",
    "mul",
    "ne",
    "neg",
    "not_",
    "or_",
    "pos",
    "pow",
    "rshift",
    "setitem",
    "sub",
    "truediv",
    "truth",
    "xor",
)

#: Tensor methods that reach storage, files, hooks or callables: not callable from IR text
_DENIED_METHODS = frozenset(
    {
        "apply_",
        "backward",
        "cuda",
        "data_ptr",
        "const_data_ptr",
        "map2_",
        "map_",
        "module_load",
        "numpy",
        "pin_memory",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "retain_grad",
        "set_",
        "share_memory_",
        "storage",
        "storage_type",
        "untyped_storage",
    }
)


@functools.cache
def _builtin_objects() -> frozenset[int]:
    """ids of every callable the built-in allowlist admits (computed once, on first use)."""
    from torch.overrides import get_overridable_functions

    table = get_overridable_functions()
    allowed: list[Any] = []
    for ns in (torch, torch.functional, F, torch.linalg, torch.fft, torch.special):
        allowed.extend(table.get(ns, ()))
    allowed.extend(getattr(torch, n) for n in _TORCH_FACTORIES if hasattr(torch, n))
    # torch.nn.functional's own Python functions are all tensor operations
    allowed.extend(
        f for n, f in vars(F).items() if callable(f) and getattr(f, "__module__", None) == F.__name__ and n[:1] != "_"
    )
    allowed.extend(f for n, f in vars(math).items() if callable(f) and n[:1] != "_")
    allowed.extend(getattr(operator, n) for n in _OPERATOR_FUNCTIONS if hasattr(operator, n))
    return frozenset(id(f) for f in allowed)


def _public_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("_")


def method_allowed(name: str) -> bool:
    """True when IR text may call method ``name`` on an operand (``x.transpose(0, 1)``).

    Allowed: public ``torch.Tensor`` methods except those that reach storage, files,
    hooks or foreign callables (``numpy``, ``untyped_storage``, ``register_hook``,
    ``apply_``, ...), and names given to :func:`register_call_method`.
    """
    return name in _REGISTERED_METHODS or _tensor_method(name)


def _tensor_method(name: str) -> bool:
    return _public_name(name) and name not in _DENIED_METHODS and callable(getattr(torch.Tensor, name, None))


def attribute_allowed(name: str) -> bool:
    """True when IR text may read attribute ``name`` of a run-time value (``getattr`` op).

    Public names only (no ``_``-prefixed or dunder names: ``__class__`` / ``__globals__``
    chains are how sandboxed expressions escape), and not the storage-reaching methods
    :func:`method_allowed` refuses."""
    return _public_name(name) and name not in _DENIED_METHODS


def builtin_call_target(target: str) -> Callable[..., Any] | None:
    """The allowlisted callable ``target`` names, or None (nothing is imported)."""
    ns_name, _, attr = target.rpartition(".")
    if ns_name == "torch.Tensor":
        return getattr(torch.Tensor, attr) if _tensor_method(attr) else None  # type: ignore[no-any-return]
    ns = _NAMESPACES.get(ns_name)
    if ns is None or not attr.isidentifier() or attr.startswith("__"):
        return None
    # the module's own dict, not getattr: torch's module __getattr__ imports submodules
    obj = vars(ns).get(attr)
    if obj is None or id(obj) not in _builtin_objects():
        return None
    return obj  # type: ignore[no-any-return]


def lookup_call_target(target: str, objects: Mapping[str, Any] | None = None) -> Callable[..., Any] | None:
    """The callable a ``call(kind="function")`` target resolves to, or None when it is not allowed."""
    if objects is not None and target in objects:
        return objects[target]  # type: ignore[no-any-return]
    if target in _REGISTERED:
        return _REGISTERED[target]
    return builtin_call_target(target)


def refusal(target: str) -> str:
    """Why ``target`` does not resolve, and how to make it resolve."""
    return (
        f"call target {target!r} is not allowed: IR text may call tensor operations of torch, "
        "torch.nn.functional, torch.linalg, torch.fft, torch.special and torch.Tensor, functions of "
        "math and operator, and callables registered by the program that reads it; if you trust "
        f"this function, register it first with qir.ir.register_call_target(fn, {target!r}) or pass "
        f"it in parse_graph(objects={{{target!r}: fn}})"
    )


def resolve_call_target(target: str, objects: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Like :func:`lookup_call_target`, raising :class:`IRError` (with the fix) when not allowed."""
    fn = lookup_call_target(target, objects)
    if fn is None:
        raise IRError(refusal(target))
    return fn


def register_call_target(fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """Allow IR text to call ``fn`` as ``call(kind="function", target=name)``.

    ``name`` defaults to ``fn.__module__ + "." + fn.__qualname__`` (the name the front end
    writes for an opaque call of ``fn``). Registration is process-wide; use it for
    functions you trust, before parsing text that names them. Returns ``fn``, so it
    works as a decorator. Registering another callable under a taken name is an error.
    """
    if not callable(fn):
        raise TypeError(f"register_call_target: {fn!r} is not callable")
    if name is None:
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname:
            raise ValueError(f"register_call_target: {fn!r} has no module/qualname; pass name=")
        name = f"{module}.{qualname}"
    if not name or any(not part.isidentifier() for part in name.split(".")):
        raise ValueError(f"register_call_target: name {name!r} is not a dotted identifier path")
    known = _REGISTERED.get(name)
    if known is not None and known is not fn:
        raise ValueError(f"register_call_target: {name!r} is already registered to {known!r}")
    _REGISTERED[name] = fn
    return fn


def register_call_method(name: str) -> None:
    """Allow IR text to call method ``name`` on an operand (``call(kind="method", target=name)``).

    For methods of non-tensor values your graphs produce (a result object's ``.boxes()``).
    Names starting with ``_`` cannot be registered: dunder methods reach the interpreter.
    """
    if not _public_name(name):
        raise ValueError(f"register_call_method: {name!r} must be a public identifier (no leading '_')")
    _REGISTERED_METHODS.add(name)


def unregister_call_target(name: str) -> None:
    """Remove a registration made by :func:`register_call_target` (tests, plugins that unload)."""
    _REGISTERED.pop(name, None)
