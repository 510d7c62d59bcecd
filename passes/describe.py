"""``qir passes``'s listing: every known pass with its options and summary."""

from __future__ import annotations

from passes.base import Pass
from passes.builtin_names import BUILTIN_PASSES
from passes.pipeline import option_specs
from passes.plugins import distribution_of, plugin_entry_points
from passes.registry import load_all_reporting


def describe_passes() -> str:
    """One line per pass: name with its options (type and default), then its summary."""
    plugins = plugin_entry_points()
    loaded, broken = load_all_reporting()
    lines = []
    for name, cls in loaded.items():
        opts = ", ".join(o.describe() for o in option_specs(cls).values())
        head = f"{name}{{{opts}}}" if opts else name
        if len(head) >= 40:  # keep summaries in one column: long heads get their own line
            lines.append(head)
            head = ""
        summary = summary_of(cls)
        if name in plugins and name not in BUILTIN_PASSES:
            summary = f"{summary} [plugin: {distribution_of(plugins[name])}]".lstrip()
        lines.append(f"{head:40} {summary}".rstrip())
    for name, message in broken.items():
        lines.append(f"{name:40} BROKEN PLUGIN: {message}")
    return "\n".join(lines)


def summary_of(cls: type[Pass]) -> str:
    """``cls.summary``, else the first line of its docstring."""
    if cls.summary:
        return cls.summary
    doc = (cls.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""
