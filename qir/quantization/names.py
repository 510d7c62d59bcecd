"""Stable names for modules the fx flow generates (``_generated_add_0``).

A generated module lives in the module that owns the operation it replaces: a ``+`` in
``layer1.0``'s forward becomes ``layer1.0._generated_add_0``, one at the root
``_generated_add_0``. Numbers count per owner and per kind only, so editing another
module's forward (or adding a ``cat`` beside an ``add``) does not renumber anything, and
checkpoints keep loading.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["GENERATED_PREFIX", "NameAllocator", "join", "owner_of_stack"]

GENERATED_PREFIX = "_generated_"


def join(owner: str, leaf: str) -> str:
    """``owner.leaf``, or ``leaf`` at the root."""
    return f"{owner}.{leaf}" if owner else leaf


def owner_of_stack(stack: Mapping[str, Any] | None, *, is_module_call: bool = False) -> str:
    """The qualified name of the module whose forward an fx node was recorded in.

    ``stack`` is fx's ``node.meta["nn_module_stack"]`` (outermost first); a leaf module
    call's own entry is its last one, so it is dropped when ``is_module_call``.
    """
    if not stack:
        return ""
    paths = [v[0] if isinstance(v, tuple) else str(k) for k, v in stack.items()]
    if is_module_call:
        paths = paths[:-1]
    return paths[-1] if paths else ""


class NameAllocator:
    """Hands out ``<owner>._generated_<kind>_<i>`` names that are not taken yet."""

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self.taken = set(taken)
        self._next: dict[tuple[str, str], int] = {}

    def claim(self, path: str) -> None:
        self.taken.add(path)

    def new(self, owner: str, kind: str) -> str:
        i = self._next.get((owner, kind), 0)
        while True:
            path = join(owner, f"{GENERATED_PREFIX}{kind}_{i}")
            i += 1
            if path not in self.taken:
                break
        self._next[(owner, kind)] = i
        self.taken.add(path)
        return path
