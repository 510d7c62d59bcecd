"""A context that the outermost forward of a model enters and leaves (also when the forward raises):
the mode in which a QAT model records its calls (:mod:`qir.quantization.eager_record`) and the one in
which a converted model passes scale tags (:mod:`qir.nn.quantized.scale_tags`).

Each user keeps one :class:`OuterForward` and registers two module-level hooks on the model's root
that call :meth:`OuterForward.enter` and :meth:`OuterForward.leave`: plain functions, so that a deep
copy shares them and a pickled model names them, and so that they can be found again to remove. A
nested call (the root called inside its own forward, or another root while one is active) finds the
outer context active and leaves it alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from torch import nn

__all__ = ["OuterForward"]


class _RootContext(Protocol):
    root: nn.Module

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> Any: ...


C = TypeVar("C", bound=_RootContext)


class OuterForward(Generic[C]):
    """The context (made by ``make(root)``) of the forward running outermost, or None between forwards."""

    def __init__(self, make: Callable[[nn.Module], C]) -> None:
        self.make = make
        self.active: C | None = None

    def enter(self, root: nn.Module) -> None:
        """For the root's forward pre-hook."""
        if self.active is not None:
            return  # a nested call: the outer forward's context serves it
        context = self.make(root)
        context.__enter__()
        self.active = context

    def leave(self, root: nn.Module) -> None:
        """For the root's forward hook (registered with ``always_call=True``)."""
        context = self.active
        if context is None or context.root is not root:
            return
        self.active = None
        context.__exit__(None, None, None)
