"""A module built for a node before emit, handed to the emit that would build the same one.

``insert-observers`` builds each QAT layer's module with the QAT class's ``from_float`` (the
arithmetic module swapping uses, and the one random initialization a seeded script expects)
and reads its op and state back. Emit would then build the same module a second time from the
op and those tensors (``op.to_module``). The pass leaves the module it built in the new node's
``meta[PREBUILT_MODULE_KEY]`` instead; emit takes it when the node still has exactly the op
the module was read as and the very state tensors it holds, and builds from the op otherwise
(a later pass changed the layer, or bound another tensor to it).

The box is taken once: graph copies share it (``Graph.copy`` copies ``meta`` shallowly), and
only the first model emitted gets the module; any other emit builds its own, so no two emitted
models share a module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["PREBUILT_MODULE_KEY", "PrebuiltModule"]

#: ``Node.meta`` key of a :class:`PrebuiltModule`
PREBUILT_MODULE_KEY = "prebuilt_module"


class PrebuiltModule:
    """``module``, built for ``op``: handed to emit only while it holds exactly the tensors emit gives."""

    __slots__ = ("_module", "op")

    def __init__(self, op: Any, module: torch.nn.Module) -> None:
        self.op = op
        self._module: torch.nn.Module | None = module

    def take(self, op: Any, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module | None:
        """The module, once, if it is what ``op.to_module(tensors)`` would build: ``op`` equals
        the op it was read as and it holds the very ``tensors`` (and no other state); else None."""
        m = self._module
        if m is None or op != self.op:
            return None
        held = dict(m.named_parameters(remove_duplicate=False)) | dict(m.named_buffers(remove_duplicate=False))
        if held.keys() != tensors.keys() or any(held[role] is not t for role, t in tensors.items()):
            return None  # changed since it was built: build from the op
        self._module = None
        return m
