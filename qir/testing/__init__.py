"""Public testing helpers: hypothesis strategies for graphs and property assertions.

``graphs``, ``inputs_for`` (strategies), ``check_golden`` / ``golden_files`` (golden IR text
tests of passes, :mod:`qir.testing.golden`) and ``assert_preserves_semantics``,
``assert_roundtrip``, ``assert_graphs_equal`` (properties) are documented in
docs/testing.md. The strategies (which need hypothesis) and the pattern helpers of
``qir.testing.patterns`` load on first use, so the property assertions work without
hypothesis installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from qir.testing.golden import GoldenMismatch, check_golden, golden_files
from qir.testing.properties import (
    assert_graphs_equal,
    assert_outputs_close,
    assert_preserves_semantics,
    assert_roundtrip,
    random_inputs,
    run_pipeline,
)

__all__ = [
    "DEFAULT_OPS",
    "GoldenMismatch",
    "assert_graphs_equal",
    "assert_outputs_close",
    "assert_preserves_semantics",
    "assert_roundtrip",
    "check_golden",
    "golden_files",
    "graphs",
    "inputs_for",
    "random_inputs",
    "run_pipeline",
    "supported_ops",
]

_STRATEGIES = ("DEFAULT_OPS", "graphs", "inputs_for", "supported_ops")


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        return getattr(importlib.import_module("qir.testing.strategies"), name)
    # qir.testing.patterns is written separately and may not exist in every checkout
    try:
        patterns = importlib.import_module("qir.testing.patterns")
    except ModuleNotFoundError as e:
        if e.name != "qir.testing.patterns":
            raise
        raise AttributeError(f"module 'qir.testing' has no attribute {name!r}") from None
    if name in getattr(patterns, "__all__", ()) or (not name.startswith("_") and hasattr(patterns, name)):
        return getattr(patterns, name)
    raise AttributeError(f"module 'qir.testing' has no attribute {name!r}")
