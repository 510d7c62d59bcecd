"""The integer IR ops bayes lowers, each to the shared rule in backends/common that emits its kernels.

The march's lowering is this list: an op missing here (and from the common fallbacks) is a
LoweringError naming the node on bayes. A march-specific rule replaces the shared one by
registering a different function under the same op name.
"""

from __future__ import annotations

from backends.common.lower import register_op_rule
from backends.common.rules_functional import FUNCTIONAL_RULES

MARCH = "bayes"

for _name, _rule in FUNCTIONAL_RULES.items():  # FloatFunctional arithmetic (qadd, qcat, qreduce, ...)
    register_op_rule(_name, _rule, march=MARCH)
