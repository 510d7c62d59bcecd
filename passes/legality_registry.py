"""Per-march operator tables, registered by backends and read by the legality pass.

Passes never import a backend. A backend module registers a loader for its table when
it is imported::

    # backends/bayes/__init__.py
    register_march_table("bayes", lambda: load_table("bayes"))

:func:`get_table` imports the backend on first use, found through a plugin table:
:data:`BUILTIN_MARCH_PLUGINS` (march -> module path, the same lazy name -> module scheme
as :data:`passes.registry.BUILTIN_PASSES`), then any installed distribution's
``qir.marches`` entry points, then :func:`register_march_plugin` calls. The module path is
data, so this file names no backend module in an import statement, and a new march is
one line here or an entry point in its own package.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol


class LegalityTable(Protocol):
    """What the legality pass reads from a march's table (backends.common.optable.OpTable).

    Entries come back untyped here so that passes need no backend import; they are
    ``OpEntry`` objects with ``supported``, ``checks()`` and ``violations(facts)``.
    """

    @property
    def march(self) -> str: ...

    def get(self, spelling: str) -> Any: ...

    def lookup(self, spelling: str) -> Any: ...

    def by_ir_op(self, name: str) -> tuple[Any, ...]: ...

    def __iter__(self) -> Any: ...


class UnknownMarchError(LookupError):
    """No backend provides a table for the requested march."""


#: Built-in march -> the module that registers its table when imported.
BUILTIN_MARCH_PLUGINS: dict[str, str] = {
    "bernoulli2": "backends.bernoulli2",
    "bayes": "backends.bayes",
}
ENTRY_POINT_GROUP = "qir.marches"

_loaders: dict[str, Callable[[], LegalityTable]] = {}
_tables: dict[str, LegalityTable] = {}
_plugins: dict[str, str] = {}
_lock = threading.RLock()


def normalize_march(march: Any) -> str:
    """``"BAYES"``, ``"bayes"`` and a str-valued enum member all name ``"bayes"``."""
    return str(getattr(march, "value", march)).strip().lower()


def register_march_table(march: str, loader: Callable[[], LegalityTable]) -> None:
    """Make ``loader`` the source of ``march``'s table; it runs once, on first :func:`get_table`."""
    key = normalize_march(march)
    with _lock:
        _loaders[key] = loader
        _tables.pop(key, None)


def register_march_plugin(march: str, module: str) -> None:
    """Name the module that registers ``march``'s table (for marches defined outside qir)."""
    with _lock:
        _plugins[normalize_march(march)] = module


def _entry_point_plugins() -> dict[str, str]:
    eps: Iterable[Any] = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {normalize_march(ep.name): ep.value for ep in eps}


def _plugin_for(march: str) -> str | None:
    if march in _plugins:
        return _plugins[march]
    if march in BUILTIN_MARCH_PLUGINS:
        return BUILTIN_MARCH_PLUGINS[march]
    return _entry_point_plugins().get(march)


def available_marches() -> list[str]:
    """Marches with a registered table or a known plugin, sorted."""
    return sorted(set(_loaders) | set(BUILTIN_MARCH_PLUGINS) | set(_plugins) | set(_entry_point_plugins()))


def get_table(march: Any) -> LegalityTable:
    """The operator table of ``march``, importing the backend that registers it if needed."""
    key = normalize_march(march)
    with _lock:
        if key in _tables:
            return _tables[key]
        if key not in _loaders:
            module = _plugin_for(key)
            if module is None:
                raise UnknownMarchError(
                    f"no operator table for march {key!r}; known marches: {', '.join(available_marches())}"
                )
            importlib.import_module(module)
            if key not in _loaders:
                raise UnknownMarchError(
                    f"module {module} was imported for march {key!r} but did not call "
                    f"register_march_table({key!r}, ...)"
                )
        table = _loaders[key]()
        _tables[key] = table
        return table
