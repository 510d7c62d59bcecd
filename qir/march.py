"""The target BPU architecture ("march") that prepare, convert and compile read.

A process-wide march is set with :func:`set_march` (as the seeds do before
``prepare_qat_fx``); :func:`march_scope` overrides it for one block, per thread and per
asyncio task (a :mod:`contextvars` variable), so concurrent flows can target different
marches.
"""

from __future__ import annotations

import contextvars
import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeAlias, TypeVar, overload

__all__ = ["March", "MarchLike", "get_march", "march_scope", "set_march"]


class March(str, enum.Enum):
    """Supported BPU architectures. Members compare equal to their lowercase string value."""

    BERNOULLI2 = "bernoulli2"
    BAYES = "bayes"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, march: MarchLike) -> March:
        """Accept a :class:`March` or its name/value in any case (``"bayes"``, ``"BAYES"``)."""
        if isinstance(march, March):
            return march
        if isinstance(march, str):
            key = march.strip().lower()
            for m in cls:
                if key == m.value:
                    return m
        raise ValueError(f"unknown march {march!r}; valid marches: {', '.join(m.value for m in cls)}")


MarchLike: TypeAlias = "March | str"

_global_lock = threading.Lock()
_global_march: March | None = None
# Holds a tuple so that "scoped to no override" and "scoped to a march" are distinguishable.
_scoped: contextvars.ContextVar[tuple[March] | None] = contextvars.ContextVar("qir_march_scope", default=None)


class _Missing(enum.Enum):
    token = 0


_MISSING = _Missing.token


def set_march(march: MarchLike | None) -> None:
    """Set the process-wide march (``None`` clears it). ``march_scope`` blocks still win inside them."""
    global _global_march
    value = None if march is None else March.parse(march)
    with _global_lock:
        _global_march = value


_T = TypeVar("_T")


@overload
def get_march() -> March: ...
@overload
def get_march(default: _T) -> March | _T: ...
def get_march(default: object = _MISSING) -> object:
    """The march in effect: the innermost :func:`march_scope`, else the one from :func:`set_march`.

    With no march set, returns ``default`` if one was given (``get_march(default=None)``
    queries without raising) and otherwise raises a :class:`RuntimeError` saying how to
    set one.
    """
    scoped = _scoped.get()
    if scoped is not None:
        return scoped[0]
    current = _global_march
    if current is not None:
        return current
    if default is not _MISSING:
        return default
    raise RuntimeError(
        "no march is set; call qir.set_march(qir.March.BAYES) (or 'bernoulli2') before preparing, "
        "converting or compiling a model, or run the flow inside `with qir.march.march_scope('bayes'):`"
    )


@contextmanager
def march_scope(march: MarchLike) -> Iterator[March]:
    """Use ``march`` inside the block (this thread / task only), then restore what was there."""
    token = _scoped.set((March.parse(march),))
    try:
        yield _scoped.get()[0]  # type: ignore[index]
    finally:
        _scoped.reset(token)
