"""Per-march op-rule registrations and rules keyed by a function's qualified name."""

from __future__ import annotations

import pytest

from backends.common.lower import function_rule, get_kernel_policy, op_rule
from backends.common.rules_conv import lower_qconv
from backends.common.rules_functional import FUNCTIONAL_RULES
from qir.quantization.code_ops import abs_codes, clamp_codes, compare_codes
from qir.quantization.convert import nearest_interpolate_codes, relu6_codes


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_each_march_registers_its_integer_op_rules(march: str) -> None:
    get_kernel_policy(march)  # loads the march's backend
    assert op_rule(march, "qconv") is lower_qconv
    for name, rule in FUNCTIONAL_RULES.items():
        assert op_rule(march, name) is rule
    assert op_rule("no-such-march", "qconv") is None  # registered per march, not for every march


@pytest.mark.parametrize("fn", [abs_codes, clamp_codes, compare_codes, relu6_codes, nearest_interpolate_codes])
def test_code_functions_find_their_rules_by_qualified_name(fn: object) -> None:
    import backends.common.lower_rules  # noqa: F401  (registers the common rules)

    rule = function_rule("bayes", fn)
    assert rule is not None
    assert function_rule("bayes", f"{fn.__module__}.{fn.__qualname__}") is rule  # type: ignore[attr-defined]


def test_an_unknown_function_has_no_rule() -> None:
    def helper() -> None: ...

    assert function_rule("bayes", helper) is None
