"""The integer IR ops Bayes lowers: the families of shared op rules it registers
(backends/common/op_families.py; docs/ir-ops.md names the ops).

A Bayes-specific rule would be defined here and registered after the families under the same op
name. Ops in no family are lowered by the common legacy rules until their family is ported.
"""

from __future__ import annotations

from backends.common.op_families import register_families

MARCH = "bayes"

register_families(MARCH, ("conv", "layers", "functional", "math", "sampling", "sequence"))
