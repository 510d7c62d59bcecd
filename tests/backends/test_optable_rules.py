"""Rule evaluation: each variant, and a property test that every numeric bound in both
march tables flips its verdict exactly at the bound."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.common.optable import MARCHES, OpEntry, load_table
from backends.common.rules import (
    FIELDS,
    Advisory,
    Compare,
    Conditional,
    Const,
    FactError,
    Field,
    FieldBound,
    Member,
    Product,
    Range,
    Rule,
)

PY: dict[str, Callable[[Any, Any], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    ">": operator.gt,
}

# ----------------------------------------------------------------------------- variants


def test_compare_scalar_and_elementwise() -> None:
    r = Compare(Field("kernel"), "<", Const(32), text="kernel<32")
    assert r.check({"kernel": 31}).ok is True
    v = r.check({"kernel": (3, 32)})
    assert (v.ok, v.actual, v.bound) == (False, (3, 32), 32)
    assert "kernel = (3, 32) violates kernel < 32" in v.message
    assert r.check({"kernel": ()}).ok is True  # no spatial dims, nothing to violate


def test_compare_any_quantifier() -> None:
    r = Compare(Field("dilation"), "!=", Const(1), "any")
    assert [r.check({"dilation": d}).ok for d in ((1, 1), (2, 1), (1, 3))] == [False, True, True]
    assert str(r) == "some dilation != 1"


def test_product_and_field_bounds() -> None:
    r = Compare(Product(("input_h", "input_w", "input_c")), "<=", Const(65536))
    assert r.check({"input_h": 16, "input_w": 16, "input_c": 256}).ok is True
    v = r.check({"input_h": 16, "input_w": 16, "input_c": 257})
    assert (v.ok, v.actual) == (False, 65792)
    half = Compare(Field("padding"), "<=", FieldBound("kernel", mul=0.5))
    assert half.check({"padding": (1, 2, 3), "kernel": (3, 4, 6)}).ok is True
    assert half.check({"padding": (1, 3, 3), "kernel": (3, 4, 6)}).ok is False
    per = Compare(Field("padding"), "<=", FieldBound("kernel", div="stride"))
    assert per.check({"padding": (2, 2), "kernel": (4, 6), "stride": (2, 3)}).ok is True
    assert per.check({"padding": (3, 2), "kernel": (4, 6), "stride": (2, 3)}).ok is False
    assert str(FieldBound("kernel", add=-1, mul=0.5)) == "(kernel - 1) * 0.5"
    with pytest.raises(FactError, match="lengths differ"):
        half.check({"padding": (1, 2), "kernel": (3, 4, 6)})


def test_same_as_input() -> None:
    r = Compare(Field("output_dtype"), "==", FieldBound("input_dtype"))
    assert r.check({"input_dtype": "qint8", "output_dtype": "qint8"}).ok is True
    assert r.check({"input_dtype": "qint8", "output_dtype": "qint16"}).ok is False


def test_range_exclusive_ends() -> None:
    r = Range(Field("input_shape"), Const(1), Const(65536), high_inclusive=False)
    assert r.check({"input_shape": (1, 3, 65535)}).ok is True
    assert r.check({"input_shape": (1, 3, 65536)}).ok is False
    assert r.check({"input_shape": (0, 3)}).ok is False
    assert str(r) == "1 <= input_shape < 65536"


def test_member() -> None:
    dims = Member(Field("reduce_dims"), (1, 2, 3))
    assert dims.check({"reduce_dims": (2, 3)}).ok is True
    assert dims.check({"reduce_dims": (0, 1)}).ok is False
    whole = Member(Field("stride"), ((1, 1), (2, 2)))
    assert [whole.check({"stride": s}).ok for s in ((1, 1), [2, 2], (1, 2))] == [True, True, False]
    no_reflect = Member(Field("mode"), ("reflect",), negate=True)
    assert no_reflect.check({"mode": "constant"}).ok is True
    assert no_reflect.check({"mode": "reflect"}).ok is False
    corners = Member(Field("align_corners"), (False, None))
    assert [corners.check({"align_corners": a}).ok for a in (False, None, True, 0)] == [True, True, False, False]


def test_bool_is_not_int() -> None:
    r = Compare(Field("is_model_output"), "==", Const(True))
    assert r.check({"is_model_output": 1}).ok is False
    assert r.check({"is_model_output": True}).ok is True


def test_conditional() -> None:
    r = Conditional(
        Compare(Field("dilation"), "!=", Const(1), "any"),
        Compare(Field("stride"), "==", Const(1)),
        text="stride=1 when dilation!=1",
    )
    assert r.check({"dilation": (1, 1), "stride": (2, 2)}).ok is True
    assert "does not apply" in r.check({"dilation": (1, 1), "stride": (2, 2)}).message
    v = r.check({"dilation": (2, 2), "stride": (2, 1)})
    assert (v.ok, v.actual, v.bound) == (False, (2, 1), 1)
    assert v.message.startswith("when some dilation != 1: ")
    assert r.check({"dilation": (2, 2)}).ok is None
    assert r.fields() == {"dilation", "stride"}


def test_missing_fact_and_bad_fact() -> None:
    r = Compare(Field("groups"), "<=", Const(4))
    v = r.check({})
    assert v.ok is None and "fact 'groups' not provided" in v.message
    with pytest.raises(FactError, match="must be a number"):
        r.check({"groups": "four"})
    with pytest.raises(FactError, match="must be a number"):
        r.check({"groups": True})


def test_divisible_by() -> None:
    r = Compare(Field("in_channels"), "divisible_by", FieldBound("groups"))
    assert r.check({"in_channels": 64, "groups": 8}).ok is True
    assert r.check({"in_channels": 64, "groups": 6}).ok is False
    assert r.check({"in_channels": 64, "groups": 0}).ok is False


def test_advisory_never_fails() -> None:
    a = Advisory(text="Uses table lookup, has precision risk", reason="accuracy risk")
    assert not a.checkable and a.check({}).ok is True and a.fields() == frozenset()


# ----------------------------------------------------------------------------- every table rule


def _rules() -> list[tuple[str, OpEntry, Rule]]:
    out: list[tuple[str, OpEntry, Rule]] = []
    for m in MARCHES:
        for e in load_table(m):
            if e.refer is None:
                out.extend((m, e, r) for r in e.checks())
    return out


ALL = _rules()


def _numeric(r: Rule) -> bool:
    """A bound on a number: ranges, and comparisons against a number or a computed bound."""
    if isinstance(r, Range):
        return True
    if not isinstance(r, Compare) or r.op == "divisible_by":
        return False
    if isinstance(r.bound, Const):
        return isinstance(r.bound.value, (int, float)) and not isinstance(r.bound.value, bool)
    return r.op in ("<", "<=", ">=", ">")


def _kind(r: Rule) -> str:
    if isinstance(r, Advisory):
        return "advisory"
    if isinstance(r, Conditional):
        return "conditional-numeric" if _numeric(r.require) else "conditional-other"
    if _numeric(r):
        return "numeric"
    if isinstance(r, (Member, Compare)):
        return "equality"
    return "unclassified"


def test_every_table_rule_is_classified() -> None:
    kinds: dict[str, int] = {}
    for _, _, r in ALL:
        kinds[_kind(r)] = kinds.get(_kind(r), 0) + 1
    assert "unclassified" not in kinds, kinds
    assert kinds["numeric"] >= 60 and kinds["conditional-numeric"] >= 8


NUMERIC = [(m, e, r) for m, e, r in ALL if _kind(r) == "numeric"]
COND = [(m, e, r) for m, e, r in ALL if _kind(r) == "conditional-numeric"]


def _ids(items: list[tuple[str, OpEntry, Rule]]) -> list[str]:
    return [f"{m}:{e.spelling}:{r}" for m, e, r in items]


def _near(b: float, delta: int) -> list[float]:
    """Values at, just around, and ``delta`` away from a bound."""
    vals = [b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf), b + delta, b - delta]
    if float(b).is_integer():
        vals += [b - 1, b + 1]
    else:
        vals += [math.floor(b), math.ceil(b)]
    return vals


def _bound_facts(bound: Any, refs: tuple[int, int]) -> tuple[float, dict[str, Any]]:
    """The numeric bound and the facts it reads (``refs`` supply referenced facts)."""
    if isinstance(bound, Const):
        return bound.value, {}
    facts = {bound.ref: refs[0]}
    b = (refs[0] + bound.add) * bound.mul
    if bound.div is not None:
        facts[bound.div] = refs[1]
        b /= refs[1]
    return b, facts


def _lhs_facts(lhs: Field | Product, x: float, slot: int) -> dict[str, Any]:
    """Facts giving the rule's left side the value ``x``; ``slot`` varies how (which factor
    of a product holds it, or a scalar versus a sequence for per-dim facts)."""
    if isinstance(lhs, Field):
        if FIELDS[lhs.name].kind.endswith("_seq") and slot:
            return {lhs.name: (x,) * (slot + 1)}
        return {lhs.name: x}
    names = lhs.factors
    return {n: (x if i == slot % len(names) else 1) for i, n in enumerate(names)}


def _expected(r: Compare | Range, x: float, bounds: tuple[float, ...]) -> bool:
    if isinstance(r, Compare):
        return PY[r.op](x, bounds[0])
    lo, hi = bounds
    lo_ok = lo <= x if r.low_inclusive else lo < x
    hi_ok = x <= hi if r.high_inclusive else x < hi
    return lo_ok and hi_ok


def _flip_checks(r: Compare | Range, refs: tuple[int, int], delta: int, slot: int, extra: dict[str, Any]) -> None:
    """Check the verdict at and around each bound against Python's own comparison."""
    if isinstance(r, Compare):
        b, bf = _bound_facts(r.bound, refs)
        bounds: tuple[float, ...] = (b,)
        lhs = r.lhs
        points = _near(b, delta)
    else:
        lo, lf = _bound_facts(r.low, refs)
        hi, hf = _bound_facts(r.high, refs)
        bf = {**lf, **hf}
        bounds = (lo, hi)
        lhs = r.lhs
        points = _near(lo, delta) + _near(hi, delta)
    outcomes = set()
    for x in points:
        if isinstance(lhs, Product) and x < 0:
            continue
        facts = {**extra, **bf, **_lhs_facts(lhs, x, slot)}
        want = _expected(r, x, bounds)
        got = r.check(facts)
        assert got.ok is want, f"{r} at {x} (bounds {bounds}, facts {facts}): {got.message}"
        outcomes.add(want)
    # Both sides of every bound were visited, so the verdict flipped.
    assert outcomes == {True, False}, f"{r}: no flip around {bounds}"


# Every example checks the fixed points at and around the bounds; examples vary the
# referenced facts, the far offsets and the fact layout, so a few dozen suffice.
@pytest.mark.parametrize(("march", "entry", "rule"), NUMERIC, ids=_ids(NUMERIC))
@settings(max_examples=40)
@given(
    refs=st.tuples(st.integers(1, 64), st.integers(1, 16)),
    delta=st.integers(1, 10**6),
    slot=st.integers(0, 2),
)
def test_numeric_bound_flips_exactly(
    march: str, entry: OpEntry, rule: Compare | Range, refs: tuple[int, int], delta: int, slot: int
) -> None:
    _flip_checks(rule, refs, delta, slot, {})


def _when_cases(when: Rule) -> tuple[dict[str, Any], dict[str, Any]]:
    """Facts that make a condition true, and facts that make it false."""
    assert isinstance(when, Compare) and isinstance(when.lhs, Field) and isinstance(when.bound, Const)
    v, name = when.bound.value, when.lhs.name
    other = (not v) if isinstance(v, bool) else v + "_other" if isinstance(v, str) else v + 1
    yes, no = ({name: v}, {name: other}) if when.op == "==" else ({name: other}, {name: v})
    assert when.check(yes).ok is True and when.check(no).ok is False
    return yes, no


@pytest.mark.parametrize(("march", "entry", "rule"), COND, ids=_ids(COND))
@settings(max_examples=40)
@given(
    refs=st.tuples(st.integers(1, 64), st.integers(1, 16)),
    delta=st.integers(1, 10**6),
    slot=st.integers(0, 2),
)
def test_conditional_bound_flips_only_when_it_applies(
    march: str, entry: OpEntry, rule: Conditional, refs: tuple[int, int], delta: int, slot: int
) -> None:
    yes, no = _when_cases(rule.when)
    req = rule.require
    assert isinstance(req, (Compare, Range))
    _flip_checks(req, refs, delta, slot, {})
    # Applies: the conditional's verdict is the requirement's.
    for x in (-delta, 0, delta, 10**9):
        bounds = [req.bound] if isinstance(req, Compare) else [req.low, req.high]
        facts = _lhs_facts(req.lhs, x, slot)
        for b in bounds:
            facts.update(_bound_facts(b, refs)[1])
        assert rule.check({**yes, **facts}).ok is req.check(facts).ok
        # Does not apply: always holds.
        assert rule.check({**no, **facts}).ok is True


def test_bounds_of_named_rows() -> None:
    """The exact bounds the tables state, read back through the rule objects."""
    bayes, b2 = load_table("bayes"), load_table("bernoulli2")

    def rule(t: Any, spelling: str, text: str) -> Rule:
        [r] = [r for r in t.lookup(spelling).rules if r.text == text]
        return r

    r = rule(b2, "torch.add", "in_channel<=2048")
    assert isinstance(r, Compare) and (r.op, r.bound) == ("<=", Const(2048))
    r = rule(bayes, "torch.nn.Conv2d", "kernel<32")
    assert isinstance(r, Compare) and (r.op, r.bound) == ("<", Const(32))
    r = rule(bayes, "torch.nn.Conv2d", "dilation<=16")
    assert isinstance(r, Compare) and (r.op, r.bound) == ("<=", Const(16))
    r = rule(bayes, "torch.nn.Conv2d", "Padding<=256.")
    assert isinstance(r, Compare) and (r.op, r.bound) == ("<=", Const(256))
    r = rule(bayes, "torch.nn.Conv2d", "out_channel<=8192")
    assert isinstance(r, Conditional) and r.require == Compare(Field("out_channels"), "<=", Const(8192))
    r = rule(b2, "torch.nn.ConvTranspose2d", "Padding H*W=[0, (kernel_h-1)/2] * [0, (kernel_w-1)/2]")
    assert isinstance(r, Range) and r.high == FieldBound("kernel", add=-1, mul=0.5)
    r = rule(bayes, "torch.nn.functional.grid_sample", "HW≤7201024")
    assert isinstance(r, Compare) and r.lhs == Product(("input_h", "input_w")) and r.bound == Const(737280)
