"""The Bayes (RDK Ultra) backend: its operator table (``ops.json``), registered for the legality pass."""

from __future__ import annotations

from backends.common.optable import OpTable, load_table
from passes.legality_registry import register_march_table

MARCH = "bayes"


def operator_table() -> OpTable:
    """This march's operator table (parsed once per process)."""
    return load_table(MARCH)


register_march_table(MARCH, operator_table)

# kernel choices (backends/bayes/lower.py) and the IR ops this march lowers with op rules (rules.py)
from backends.bayes import lower as _lower  # noqa: E402,F401
from backends.bayes import rules as _rules  # noqa: E402,F401
