"""The live ``nn.Module`` behind a ``torch.jit.trace`` (or ``torch.jit.script``) of it.

The seeds trace the converted model and hand the trace to ``check_model`` and
``compile_model``. A TorchScript module inlines FloatFunctional arithmetic into anonymous
aten ops and loses the module paths reports are named by, so qir does not read it: it
shares its parameter and buffer tensors with the module it was made from (the same
tensor objects), and that module is found among the live ``nn.Module`` objects by tensor
identity (docs/backends.md "Compiling a jit trace").
"""

from __future__ import annotations

import gc
import warnings

import torch
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
    probe_name, probe = next(iter(state.items()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on arbitrary heap objects can trigger deprecation shims
        found = _scan(probe_name, probe, state)
    if found is not None:
        return found
    raise TracedSourceError(
        f"{what}: the module this TorchScript module was traced from is no longer alive (qir reads the traced "
        "nn.Module, found by the tensors the trace shares with it; a torch.jit.load-ed file has none). Keep the "
        "converted model and pass it, or its torch.jit.trace, while it exists"
    )


def _scan(probe_name: str, probe: torch.Tensor, state: dict[str, torch.Tensor]) -> nn.Module | None:
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
        if mine.keys() == state.keys() and all(mine[k] is state[k] for k in state):
            return obj
    return None
