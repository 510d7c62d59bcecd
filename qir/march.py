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

__all__ = ["UNSUPPORTED_MARCHES", "March", "MarchLike", "get_march", "march_scope", "set_march"]


#: The plugin's march names qir does not target, with why. Naming one is an error that says
#: so (never a silent fallback to another march's rules).
UNSUPPORTED_MARCHES: dict[str, str] = {
    "BERNOULLI": "the oldest march (power-of-two scales) is out of qir's scope",
    "NASH": "qir has no operator table or integer rules for the Nash BPU family",
    "NASH_E": "qir has no operator table or integer rules for the Nash BPU family",
    "NASH_M": "qir has no operator table or integer rules for the Nash BPU family",
    "NASH_P": "qir has no operator table or integer rules for the Nash BPU family",
    "META": "the plugin's internal test march has no hardware rules",
}


def _supported_text() -> str:
    return "bernoulli2, bayes (March.BERNOULLI2, March.BAYES; March.BAYES_E is an alias of March.BAYES)"


def _unsupported_error(name: str, exc: type[Exception]) -> Exception:
    return exc(
        f"March.{name} is not supported by qir: {UNSUPPORTED_MARCHES[name]}; supported marches: {_supported_text()}"
    )


def _march_key(text: str) -> str:
    """``"nash-e"``, ``"NASH_E"``, ``"Nash_e "`` -> ``"NASH_E"``."""
    return text.strip().upper().replace("-", "_")


class _MarchMeta(enum.EnumMeta):
    # Enum members are plain class attributes, so this runs only for names that are not
    # members: the plugin's other marches get an error that names them and the fix.
    def __getattr__(cls, name: str) -> object:
        if name in UNSUPPORTED_MARCHES:
            raise _unsupported_error(name, AttributeError)
        raise AttributeError(f"type object 'March' has no attribute {name!r}")


class March(str, enum.Enum, metaclass=_MarchMeta):
    """Supported BPU architectures. Members compare equal to their lowercase string value.

    ``BAYES_E`` (the plugin's name for the Bayes-E variant of RDK X5-class boards) is an
    alias: ``March.BAYES_E is March.BAYES``, and qir checks, converts and compiles it with
    Bayes's operator table and integer rules (docs/migration.md). The plugin's NASH_*
    marches, BERNOULLI and META raise an error naming the supported ones.
    """

    BERNOULLI2 = "bernoulli2"
    BAYES = "bayes"
    BAYES_E = "bayes"  # an alias (same value): the plugin's Bayes-E runs Bayes's rules

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, march: MarchLike) -> March:
        """Accept a :class:`March` or its name/value in any case (``"bayes"``, ``"BAYES"``, ``"bayes-e"``)."""
        if isinstance(march, March):
            return march
        if isinstance(march, str):
            key = _march_key(march)
            if key in cls.__members__:
                return cls.__members__[key]
            if key in UNSUPPORTED_MARCHES:
                raise _unsupported_error(key, ValueError)
        raise ValueError(f"unknown march {march!r}; valid marches: {_supported_text()}")


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
