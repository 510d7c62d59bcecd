"""The pass contract: a named, frozen attrs class whose fields are its options.

    @register_pass
    @attrs.frozen
    class MyPass(Pass):
        name: ClassVar[str] = "my-pass"
        threshold: int = 3            # option: "my-pass{threshold=5}"

        def apply(self, ctx: PassContext, graph: Graph) -> bool:
            ...mutate graph in place...
            return changed

A pass mutates the graph it is given and returns whether it changed anything; the
pass manager hands it a copy unless the caller asked for ``inplace=True``. Every pass
must leave a graph that verifies.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import attrs

from qir.ir.graph import Graph


@attrs.define
class PassContext:
    """State shared by the passes of one pipeline run.

    ``options`` carries run-wide settings (``march``, ``qconfig``...) that passes may read;
    ``stats`` collects counters passes want to report (``stats["fuse.matched"] += 1``).
    """

    options: dict[str, Any] = attrs.field(factory=dict)
    stats: dict[str, int] = attrs.field(factory=dict)

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n


@attrs.frozen
class Pass:
    """Base class of all passes. Subclasses set ``name`` and implement :meth:`apply`."""

    name: ClassVar[str] = ""
    #: One-line description shown by ``qir passes``.
    summary: ClassVar[str] = ""

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        raise NotImplementedError(f"pass {self.name!r} does not implement apply()")


PASS_REGISTRY: dict[str, type[Pass]] = {}

P = TypeVar("P", bound=type[Pass])


def register_pass(cls: P) -> P:
    """Class decorator: make a pass available by name in pipeline strings."""
    if not cls.name:
        raise ValueError(f"pass class {cls.__qualname__} has no name")
    if cls.name in PASS_REGISTRY and PASS_REGISTRY[cls.name] is not cls:
        raise ValueError(f"pass name {cls.name!r} is taken by {PASS_REGISTRY[cls.name].__qualname__}")
    PASS_REGISTRY[cls.name] = cls
    return cls
