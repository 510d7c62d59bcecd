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

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

import attrs
import torch

from passes.builtin_names import BUILTIN_PASSES
from qir.ir.graph import Graph, Node, Value
from qir.ir.op import IRError


@attrs.frozen
class PassRecord:
    """One pass that ran: the pass, whether it reported a change, and its wall time
    (``apply`` alone, without instruments)."""

    pass_: Pass
    changed: bool
    seconds: float


@attrs.define
class PassContext:
    """State shared by the passes of one pipeline run.

    ``options`` carries run-wide settings (``march``, ``qconfig``...) that passes may read;
    ``stats`` collects counters passes want to report (``stats["fuse.matched"] += 1``);
    ``history`` lists the passes that already ran with this context, oldest first (the pass
    manager appends to it), so a pass can check that a prerequisite ran.
    """

    options: dict[str, Any] = attrs.field(factory=dict)
    stats: dict[str, int] = attrs.field(factory=dict)
    history: list[PassRecord] = attrs.field(factory=list)

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def ran(self, name: str) -> bool:
        """Whether a pass called ``name`` already ran with this context."""
        return any(r.pass_.name == name for r in self.history)


@attrs.frozen
class Pass:
    """Base class of all passes. Subclasses set ``name`` and implement :meth:`apply`."""

    name: ClassVar[str] = ""
    #: One-line description shown by ``qir passes``.
    summary: ClassVar[str] = ""

    def apply(self, ctx: PassContext, graph: Graph) -> bool:
        raise NotImplementedError(f"pass {self.name!r} does not implement apply()")

    def __str__(self) -> str:
        """The pass in pipeline syntax: ``fuse{max_iters=3}`` (options at defaults omitted)."""
        # passes.pipeline (which builds on this module) installs the formatter on import;
        # importing any passes module runs passes/__init__.py, which imports it
        return _FORMATTER[0](self)


PASS_REGISTRY: dict[str, type[Pass]] = {}

#: ``str(pass)``: the pipeline-syntax formatter, set by :func:`set_pass_formatter`.
_FORMATTER: list[Callable[[Pass], str]] = [lambda p: p.name]


def set_pass_formatter(formatter: Callable[[Pass], str]) -> None:
    """Install how ``str(pass)`` spells a pass (``passes.pipeline.format_pass``)."""
    _FORMATTER[0] = formatter


P = TypeVar("P", bound=type[Pass])


def register_pass(cls: P) -> P:
    """Class decorator: make a pass available by name in pipeline strings.

    Names of built-in passes (``passes.builtin_names.BUILTIN_PASSES``) are reserved for their
    modules. Re-running a class definition (a notebook cell, a reloaded module) replaces
    the earlier class of the same module and qualified name.
    """
    if not cls.name:
        raise ValueError(f"pass class {cls.__qualname__} has no name")
    if "__attrs_attrs__" not in cls.__dict__:
        # options are attrs fields: annotated attributes of a plain subclass would be dropped silently
        fields = [n for n, t in inspect.get_annotations(cls).items() if "ClassVar" not in str(t)]
        if fields:
            raise ValueError(
                f"pass class {cls.__qualname__} declares option(s) {', '.join(fields)} but is not an attrs class, "
                "so pipelines could not set them; decorate it with @attrs.frozen (under @register_pass)"
            )
    home = BUILTIN_PASSES.get(cls.name)
    if home is not None and cls.__module__ != home:
        raise ValueError(
            f"pass name {cls.name!r} is reserved for the built-in pass in {home}; give {cls.__qualname__} another name"
        )
    old = PASS_REGISTRY.get(cls.name)
    if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"pass name {cls.name!r} is taken by {old.__module__}.{old.__qualname__}; "
            f"give {cls.__qualname__} another name"
        )
    PASS_REGISTRY[cls.name] = cls
    return cls


# -- layer state as constants (the passes that swap a layer's op and state) ---------------------


def read_state(
    graph: Graph, roles: Sequence[str], values: Sequence[Value], where: str, error: type[IRError] = IRError
) -> tuple[dict[str, torch.Tensor], dict[str, Node]]:
    """A layer's state by role: its tensors and their ``constant`` nodes.

    ``values`` are the layer's state operands, one per role; one that is not a constant raises
    ``error`` prefixed with ``where`` (the pass and node, for the message)."""
    tensors: dict[str, torch.Tensor] = {}
    nodes: dict[str, Node] = {}
    for role, v in zip(roles, values, strict=True):
        t = graph.constant_value(v)
        if t is None:
            raise error(f"{where}: state operand {role} is not a constant; cannot convert")
        assert isinstance(v, Node)  # constant_value is None for anything else
        tensors[role] = t
        nodes[role] = v
    return tensors, nodes


def drop_unused_constants(graph: Graph, nodes: Iterable[Node]) -> None:
    """Erase those of ``nodes`` still in ``graph`` that nothing reads, with their tensors."""
    for c in nodes:
        if c.graph is graph and not c.users:
            graph.erase_node(c)
            graph.constants.pop(c.op.key, None)  # type: ignore[attr-defined]


def add_state_constant(graph: Graph, key: str, tensor: torch.Tensor, error: type[IRError] = IRError) -> Node:
    """Add ``tensor`` as a layer-state constant under its state-dict ``key`` (a ``parameter``
    for an ``nn.Parameter``, else a ``buffer``); a key bound to another tensor raises ``error``."""
    if key in graph.constants and graph.constants[key] is not tensor:
        raise error(f"state key {key!r} is already held by another tensor; two layers would share one module path")
    kind = "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"
    return graph.add_constant(key, tensor, kind, name=key.replace(".", "_"))
