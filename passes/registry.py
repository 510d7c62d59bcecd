"""Pass lookup by name, loading built-in passes lazily.

Built-in passes live one per module and are imported only when a pipeline names them
(as xDSL's name -> loader table does), so ``import passes`` stays cheap. User passes
register themselves with :func:`passes.base.register_pass` when their module is imported.

Adding a built-in pass is one line in :data:`passes.builtin_names.BUILTIN_PASSES`.
"""

from __future__ import annotations

import difflib
import importlib

from passes.base import PASS_REGISTRY, Pass
from passes.builtin_names import BUILTIN_PASSES
from passes.errors import PipelineError
from passes.plugins import load_entry_point, plugin_entry_points


def available_passes() -> list[str]:
    """Names usable in a pipeline: built-in (loaded or not), user-registered and installed plugins, sorted."""
    return sorted(set(BUILTIN_PASSES) | set(PASS_REGISTRY) | set(plugin_entry_points()))


def get_pass_class(name: str) -> type[Pass]:
    """The pass class registered as ``name``, importing its built-in module on first use.

    Raises :class:`PipelineError` naming the close matches and all valid names when
    ``name`` is unknown.
    """
    cls = PASS_REGISTRY.get(name)
    if cls is not None:
        return cls
    module = BUILTIN_PASSES.get(name)
    if module is None:
        ep = plugin_entry_points().get(name)
        if ep is not None:
            return load_entry_point(name, ep)
        raise PipelineError(unknown_pass_message(name))
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # a dependency of the pass module is missing: show that error as is
        raise PipelineError(
            f"built-in pass {name!r} is listed in passes.registry.BUILTIN_PASSES but its module "
            f"{module} does not exist; add the module or remove the entry"
        ) from None
    cls = PASS_REGISTRY.get(name)
    if cls is None:
        raise PipelineError(
            f"module {module} was imported for built-in pass {name!r} but registered no pass of that "
            f"name; decorate its class with @register_pass and set name = {name!r}"
        )
    return cls


def load_all() -> dict[str, type[Pass]]:
    """Import every built-in pass; return name -> class for all known passes (for tools, docs).

    Raises on the first plugin that fails to load; :func:`load_all_reporting` collects them instead.
    """
    return {name: get_pass_class(name) for name in available_passes()}


def load_all_reporting() -> tuple[dict[str, type[Pass]], dict[str, str]]:
    """Like :func:`load_all`, but a plugin that fails to load is returned as name -> error message."""
    loaded: dict[str, type[Pass]] = {}
    broken: dict[str, str] = {}
    for name in available_passes():
        try:
            loaded[name] = get_pass_class(name)
        except PipelineError as e:
            if name in BUILTIN_PASSES:
                raise
            broken[name] = str(e)
    return loaded, broken


def unknown_pass_message(name: str) -> str:
    names = available_passes()
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown pass {name!r}{hint} available passes: {', '.join(names)}"
