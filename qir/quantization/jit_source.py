"""The live ``nn.Module`` behind a ``torch.jit.trace`` (or ``torch.jit.script``) of it.

The seeds trace the converted model and hand the trace to ``check_model`` and
``compile_model``. A TorchScript module inlines FloatFunctional arithmetic into anonymous
aten ops and loses the module paths reports are named by, so qir does not read it: it
shares its parameter and buffer tensors with the module it was made from (the same
tensor objects), and that module is found among the live ``nn.Module`` objects by tensor
identity (docs/backends.md "Compiling a jit trace").

Nothing holds the traced module: the trace keeps its tensors, its module tree and each module's
class name (``original_name``), not the Python object. Tensor identity alone is not enough, because
every ``torch.fx.GraphModule`` built over the model (qir's own compile and check steps build them
over the converted model's submodules; a user's ``symbolic_trace``) shares the same tensors, and a
GraphModule and its Graph reference each other, so such a temporary stays on the heap until the
cyclic garbage collector runs. So a candidate must also have the trace's module tree (every path,
each module's class name), which a GraphModule over the model lacks at its root; when several live
candidates still match, unreachable ones are collected first, and equivalent ones (the same tree,
and the same code for GraphModules) are one answer. Different live candidates are refused, naming
them.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import torch
import torch.fx
from torch import nn

__all__ = ["TracedSourceError", "traced_original"]


class TracedSourceError(RuntimeError):
    """The module a TorchScript module was made from cannot be found; the message says why and the fix."""


def traced_original(sm: torch.jit.ScriptModule, what: str) -> nn.Module:
    """The live ``nn.Module`` that ``torch.jit.trace`` turned into ``sm``; ``what`` names the caller."""
    state: dict[str, torch.Tensor] = dict(sm.named_parameters())
    state.update(dict(sm.named_buffers()))
    if not state:
        raise TracedSourceError(
            f"{what}: this TorchScript module has no parameters or buffers to identify the module it was "
            "traced from; pass the converted module itself"
        )
    tree = _tree(sm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on arbitrary heap objects can trigger deprecation shims
        found = _scan(state, tree)
        if len(found) > 1:
            # GraphModules built over the model and dropped: reference cycles the collector has not reached yet
            refs = [weakref.ref(m) for m in found]
            del found
            gc.collect()
            found = [m for m in (r() for r in refs) if m is not None]
    if found and all(_same(found[0], m) for m in found[1:]):
        return found[0]
    if found:
        kinds = ", ".join(f"{type(m).__name__} at 0x{id(m):x}" for m in found)
        raise TracedSourceError(
            f"{what}: {len(found)} different live modules share this TorchScript module's tensors and module tree "
            f"({kinds}), so which one was traced is unknown; pass the converted module itself"
        )
    raise TracedSourceError(
        f"{what}: the module this TorchScript module was traced from is no longer alive (qir reads the traced "
        "nn.Module, found by the tensors the trace shares with it; a torch.jit.load-ed file has none). Keep the "
        "converted model and pass it, or its torch.jit.trace, while it exists"
    )


def _tree(sm: torch.jit.ScriptModule) -> dict[str, str]:
    """Module path -> class name, as the trace recorded them."""
    return {name: str(getattr(m, "original_name", type(m).__name__)) for name, m in sm.named_modules()}


def _scan(state: dict[str, torch.Tensor], tree: dict[str, str]) -> list[nn.Module]:
    probe_name, probe = next(iter(state.items()))
    out: list[nn.Module] = []
    for obj in gc.get_objects():
        if not isinstance(obj, nn.Module) or isinstance(obj, torch.jit.ScriptModule):
            continue
        cur: object = obj
        for part in probe_name.split("."):
            cur = getattr(cur, part, None)
            if cur is None:
                break
        if cur is not probe:
            continue
        mine: dict[str, torch.Tensor] = dict(obj.named_parameters())
        mine.update(dict(obj.named_buffers()))
        if mine.keys() != state.keys() or any(mine[k] is not state[k] for k in state):
            continue
        if {name: type(m).__name__ for name, m in obj.named_modules(remove_duplicate=False)} == tree:
            out.append(obj)
    return out


def _same(a: nn.Module, b: nn.Module) -> bool:
    """Two candidates that compute the same: the same class and tensors (so far), and for GraphModules the same code."""
    if type(a).__name__ != type(b).__name__:
        return False
    if isinstance(a, torch.fx.GraphModule) or isinstance(b, torch.fx.GraphModule):
        return isinstance(a, torch.fx.GraphModule) and isinstance(b, torch.fx.GraphModule) and a.code == b.code
    return type(a) is type(b)
