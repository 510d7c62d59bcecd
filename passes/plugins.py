"""User passes from outside the tree: a module or file loaded by hand, or an installed package.

Two ways in, both ending in :func:`passes.base.register_pass`:

- :func:`load_pass_module` imports a file path (``my_passes.py``) or a module name
  (``my_pkg.my_passes``); ``qir opt --load`` calls it before parsing the pipeline.
- An installed distribution declares an entry point in the group :data:`ENTRY_POINT_GROUP`
  whose name is the pass name and whose value is the module (or ``module:Class``) that
  registers it. :func:`plugin_entry_points` finds them without importing anything; the
  registry loads one only when a pipeline names it, so a broken plugin fails only the
  pipelines that use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from passes.base import PASS_REGISTRY, Pass
from passes.errors import PipelineError

#: importlib.metadata entry-point group through which installed packages contribute passes.
ENTRY_POINT_GROUP = "qir.passes"


def plugin_entry_points() -> dict[str, EntryPoint]:
    """Pass name -> entry point, for every installed distribution declaring one (nothing imported)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)  # first on sys.path wins, as for imports
    return found


def distribution_of(ep: EntryPoint) -> str:
    """``name version`` of the distribution that declares ``ep`` (``?`` when unknown)."""
    dist = ep.dist
    if dist is None:
        return "?"
    return f"{dist.metadata['Name']} {dist.version}"


def load_entry_point(name: str, ep: EntryPoint) -> type[Pass]:
    """Import the plugin behind ``ep`` and return the pass it registered as ``name``.

    Raises :class:`PipelineError` naming the pass, the distribution and the cause when the
    import fails or registers no pass of that name.
    """
    where = f"plugin pass {name!r} (entry point {ep.value!r} of {distribution_of(ep)})"
    try:
        obj = ep.load()
    except Exception as e:  # any failure of third-party code is reported, not propagated raw
        raise PipelineError(f"{where} failed to load: {type(e).__name__}: {e}") from e
    cls = PASS_REGISTRY.get(name)
    if cls is None:
        if isinstance(obj, type) and issubclass(obj, Pass):
            detail = f"it names class {obj.__qualname__} with name = {obj.name!r}, not decorated with @register_pass"
        else:
            detail = "the module it names registered no pass of that name"
        raise PipelineError(f"{where} did not register a pass named {name!r}: {detail}")
    return cls


def load_pass_module(spec: str) -> None:
    """Import a user pass module given as a file path (``*.py`` or containing ``/``) or a module name.

    Its ``@register_pass`` classes become available by name. Raises :class:`PipelineError`
    naming ``spec`` and the exception (one line) when the file is missing or the import fails.
    """
    looks_like_path = spec.endswith(".py") or "/" in spec or "\\" in spec
    try:
        if looks_like_path:
            path = Path(spec)
            if not path.is_file():
                raise PipelineError(f"--load {spec}: no such file")
            module_name = f"qir_user_passes_{path.stem}_{abs(hash(str(path.resolve())))}"
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise PipelineError(f"--load {spec}: not an importable Python file")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module  # dataclasses / attrs look their module up here
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        else:
            importlib.import_module(spec)
    except PipelineError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise PipelineError(f"--load {spec}: {type(e).__name__}: {first}") from e
