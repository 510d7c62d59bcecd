"""The Bernoulli2 (RDK X3) backend: its operator table (``ops.json``), registered for the legality pass."""

from __future__ import annotations

from backends.common.optable import OpTable, load_table
from passes.legality_registry import register_march_table

MARCH = "bernoulli2"


def operator_table() -> OpTable:
    """This march's operator table (parsed once per process)."""
    return load_table(MARCH)


register_march_table(MARCH, operator_table)

# kernel choices (backends/bernoulli2/lower.py) and the IR ops this march lowers with op rules (rules.py)
from backends.bernoulli2 import lower as _lower  # noqa: E402,F401
from backends.bernoulli2 import rules as _rules  # noqa: E402,F401
