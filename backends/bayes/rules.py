"""The IR ops Bayes lowers with op rules (``register_op_rule(op_name, rule, march="bayes")``).

Each list names IR ops (docs/ir-ops.md) and the module of backends/common whose shared rule
lowers them; a Bayes-specific rule would be defined here and registered instead. Ops not
listed are lowered by the common legacy rules until their family is ported.
"""

from __future__ import annotations

from backends.common import rules_layers, rules_math
from backends.common.lower import register_op_rule
from backends.common.rules_conv import lower_qconv
from backends.common.rules_functional import FUNCTIONAL_RULES

MARCH = "bayes"

#: stubs, scale-keeping layers, table lookups, pools, resize, division (backends/common/rules_layers.py)
LAYER_OPS = (
    "qquant_stub",
    "qdequant_stub",
    "qrelu",
    "qrelu6",
    "qidentity",
    "qlut",
    "qdiv",
    "qmax_pool2d",
    "max_pool2d",  # a torch MaxPool2d left in an eager-converted model: pools codes
    "qavg_pool2d",
    "qadaptive_avg_pool2d",
    "qinterpolate",
)

for _name in LAYER_OPS:
    register_op_rule(_name, rules_layers.OP_RULES[_name], march=MARCH)

for _name, _rule in FUNCTIONAL_RULES.items():  # FloatFunctional arithmetic (qadd, qcat, qreduce, ...)
    register_op_rule(_name, _rule, march=MARCH)

#: PReLU, GLU, Softmax, LayerNorm (backends/common/rules_math.py)
MATH_OPS = ("qprelu", "qglu", "qsoftmax", "qlayer_norm")

for _name in MATH_OPS:
    register_op_rule(_name, rules_math.OP_RULES[_name], march=MARCH)

register_op_rule("qconv", lower_qconv, march=MARCH)  # integer conv / linear (+ add, + ReLU / ReLU6)
