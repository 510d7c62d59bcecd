"""The shared op rules of the integer IR ops, grouped in families a march registers by name.

A march's ``rules.py`` names the families it lowers (``register_families("bayes", ("conv",
...))``); each family maps IR op names to the rule in backends/common that emits their
kernels. A march-specific rule is registered after the families, under the same op name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from backends.common import rules_layers, rules_math, rules_sampling, rules_sequence
from backends.common.lower import OpRule, register_op_rule
from backends.common.rules_conv import lower_qconv
from backends.common.rules_functional import FUNCTIONAL_RULES

__all__ = ["FAMILIES", "register_families"]

#: family -> {IR op name: shared rule}
FAMILIES: dict[str, Mapping[str, OpRule]] = {
    # integer conv / linear (+ fused add, + ReLU / ReLU6)
    "conv": {"qconv": lower_qconv},
    # stubs, scale-keeping layers, table lookups, pools, resize, division
    "layers": rules_layers.OP_RULES,
    # FloatFunctional arithmetic (qadd, qcat, qreduce, ...)
    "functional": FUNCTIONAL_RULES,
    # PReLU, GLU, Softmax, LayerNorm
    "math": rules_math.OP_RULES,
    # GridSample, RoIAlign, MultiScaleRoIAlign, AnchorGenerator
    "sampling": rules_sampling.OP_RULES,
    # LSTMCell, MultiheadAttention (composed of the linear, add, lut, mul, matmul, softmax kernels)
    "sequence": rules_sequence.OP_RULES,
}


def register_families(march: str, families: Iterable[str]) -> None:
    """Register every op rule of ``families`` for ``march``."""
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"unknown op-rule family {family!r}; known: {', '.join(FAMILIES)}")
        for name, rule in FAMILIES[family].items():
            register_op_rule(name, rule, march=march)
