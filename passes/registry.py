"""Pass lookup by name, loading built-in passes lazily.

Built-in passes live one per module and are imported only when a pipeline names them
(as xDSL's name -> loader table does), so ``import passes`` stays cheap. User passes
register themselves with :func:`passes.base.register_pass` when their module is imported.

Adding a built-in pass is one line in :data:`BUILTIN_PASSES`.
"""

from __future__ import annotations

import difflib
import importlib

from passes.base import PASS_REGISTRY, Pass
from passes.errors import PipelineError

#: Built-in pass name -> the module that defines and registers it.
BUILTIN_PASSES: dict[str, str] = {
    "absorb-bn": "passes.absorb_bn",
    "dce": "passes.dce",
    "fuse": "passes.fuse",
    "legalize": "passes.legalize",
    "remove-identity": "passes.remove_identity",
}


def available_passes() -> list[str]:
    """Names usable in a pipeline: built-in (loaded or not) and user-registered, sorted."""
    return sorted(set(BUILTIN_PASSES) | set(PASS_REGISTRY))


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
    """Import every built-in pass; return name -> class for all known passes (for tools, docs)."""
    return {name: get_pass_class(name) for name in available_passes()}


def unknown_pass_message(name: str) -> str:
    names = available_passes()
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown pass {name!r}{hint} available passes: {', '.join(names)}"


def describe_passes() -> str:
    """One line per pass: name with its options (type and default), then its summary."""
    from passes.pipeline import option_specs

    lines = []
    for name, cls in load_all().items():
        opts = ", ".join(o.describe() for o in option_specs(cls).values())
        head = f"{name}{{{opts}}}" if opts else name
        if len(head) >= 40:  # keep summaries in one column: long heads get their own line
            lines.append(head)
            head = ""
        lines.append(f"{head:40} {summary_of(cls)}".rstrip())
    return "\n".join(lines)


def summary_of(cls: type[Pass]) -> str:
    """``cls.summary``, else the first line of its docstring."""
    if cls.summary:
        return cls.summary
    doc = (cls.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""
