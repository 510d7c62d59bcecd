"""Operator-table rules and their evaluation against a dict of facts.

A rule states one constraint of a march's operator table ("kernel <= 7",
"stride = 1 when dilation != 1") over named *facts*: values the legality pass reads off
an IR node (:data:`FIELDS` is the vocabulary, documented in ``docs/operators.md``).
:meth:`Rule.check` returns a :class:`Verdict`; it never raises for a rule that does not
hold, and reports ``ok=None`` when a fact it needs is absent, so the caller decides
whether an unknown is an error.

Facts that are sequences (``kernel``, ``stride``, ``input_shape``…) are checked element by
element: the rule holds when it holds for every element. A bound that is itself a
sequence (``padding <= kernel / 2``) pairs up with the fact element by element.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs

Facts = Mapping[str, Any]


@attrs.frozen
class FieldSpec:
    """One fact name of the rule vocabulary: its value kind and precise meaning."""

    kind: str
    description: str


# The vocabulary rules may use. Dims follow torch's layouts: inputs N, C, (D,) H, W;
# weights as torch stores them. Spatial tuples are ordered like torch's (H, W) or (D, H, W).
FIELDS: dict[str, FieldSpec] = {
    "input_dtype": FieldSpec("dtype", "Dtype of the first tensor operand (the data input)."),
    "other_dtype": FieldSpec(
        "dtype", "Dtype of the second tensor operand: `other` of maximum/minimum, `grid` of grid_sample."
    ),
    "output_dtype": FieldSpec("dtype", "Dtype of the (first) result."),
    "weight_dtype": FieldSpec("dtype", "Dtype of the weight operand of conv/linear ops."),
    "has_bias": FieldSpec("bool", "A conv/linear op has a bias operand."),
    "bias_dtype": FieldSpec("dtype", "Dtype of the bias operand of conv/linear ops (read only when `has_bias`)."),
    "sumin_dtype": FieldSpec("dtype", "Dtype of the fused addend of a conv (see `sumin`); absent without one."),
    "input_count": FieldSpec("int", "Number of tensor operands (for cat: the number of tensors concatenated)."),
    "input_rank": FieldSpec("int", "Number of dims of the first input."),
    "input_shape": FieldSpec("int_seq", "Full shape of the first input; a rule on it applies to every dim."),
    "input_n": FieldSpec(
        "int",
        "Batch of the first input read as the tables' [N, C, (D,) H, W]: ranks 1-5 are (C), (N, C), "
        "(N, C, W), (N, C, H, W), (N, C, D, H, W), a dim a rank lacks being 1; absent for other ranks.",
    ),
    "input_c": FieldSpec("int", "Channels of the first input: dim 1 (dim 0 of a 1-D input); see `input_n`."),
    "input_d": FieldSpec("int", "Depth dim of a 5-D first input (N, C, D, H, W): dim 2."),
    "input_h": FieldSpec("int", "Height of the first input: dim 2 of a 4-D, dim 3 of a 5-D one, 1 below 4-D."),
    "input_w": FieldSpec("int", "Width of the first input: the last dim of a 3- to 5-D input, 1 below 3-D."),
    "input_bytes": FieldSpec(
        "int", "Bytes of the largest tensor operand: element count times the element size of its dtype."
    ),
    "input_abs_max": FieldSpec(
        "float", "Largest magnitude the first input's quantization represents: scale x qmax (127 or 32767)."
    ),
    "in_channels": FieldSpec(
        "int",
        "Input channels. Conv family: the module's in_channels (weight dim 1 x groups, or weight dim 0 for "
        "transposed convs). Other ops: `input_c`.",
    ),
    "out_channels": FieldSpec("int", "Output channels of a conv-family op (dim 1 of its result)."),
    "in_features": FieldSpec("int", "Linear: in_features (weight dim 1)."),
    "out_features": FieldSpec("int", "Linear: out_features (weight dim 0)."),
    "kernel": FieldSpec("int_seq", "Spatial kernel size, one entry per spatial dim (weight dims 2..)."),
    "stride": FieldSpec("int_seq", "Stride, one entry per spatial dim."),
    "padding": FieldSpec("int_seq", "Explicit padding per spatial dim ('same'/'valid' resolved to numbers)."),
    "dilation": FieldSpec("int_seq", "Dilation per spatial dim."),
    "output_padding": FieldSpec("int_seq", "Transposed conv output_padding per spatial dim."),
    "groups": FieldSpec("int", "Conv groups."),
    "weight_n": FieldSpec(
        "int", "Weight dim 0, as torch stores it (conv: out channels; transposed conv: in channels)."
    ),
    "weight_c": FieldSpec("int", "Weight dim 1 (conv: in channels / groups; transposed conv: out channels / groups)."),
    "weight_d": FieldSpec("int", "Weight depth dim of a 3-D conv (dim 2)."),
    "weight_h": FieldSpec("int", "Weight height (dim -2)."),
    "weight_w": FieldSpec("int", "Weight width (dim -1)."),
    "sumin": FieldSpec("bool", "The conv carries a fused elementwise-add operand (conv + add in one kernel)."),
    "scale_factor": FieldSpec(
        "float_seq", "Interpolate: output size / input size per spatial dim (whether size or scale_factor was given)."
    ),
    "mode": FieldSpec(
        "str",
        "The op's `mode` argument: interpolate/grid_sample ('nearest', 'bilinear'…), pad ('constant', "
        "'reflect', 'replicate', 'circular').",
    ),
    "padding_mode": FieldSpec("str", "`padding_mode` argument (grid_sample: 'zeros', 'border', 'reflection')."),
    "align_corners": FieldSpec("bool_or_none", "`align_corners` argument as given (None when not given)."),
    "is_model_output": FieldSpec("bool", "The op's result is one of the graph's outputs."),
    "index_used_internally": FieldSpec(
        "bool", "An index result (max/argmax/min/argmin) feeds another op instead of only the graph outputs."
    ),
    "reduce_dims": FieldSpec(
        "int_seq",
        "Dims reduced by mean/sum as positions of [N, C, H, W] (reducing the last dim of an (N, C, W) input "
        "is 3); absent when a 5-D input's D is reduced.",
    ),
    "broadcast_input_count": FieldSpec("int", "Number of operands whose shape is broadcast up to the result's shape."),
    "broadcasts_batch": FieldSpec("bool", "Some operand is broadcast along dim 0 (N) of a result of rank 2 or more."),
    "has_constant_operand": FieldSpec(
        "bool", "Some operand is a constant (scalar or stored tensor) rather than a computed value."
    ),
    "add_bias_kv": FieldSpec("bool", "MultiheadAttention add_bias_kv."),
    "add_zero_attn": FieldSpec("bool", "MultiheadAttention add_zero_attn."),
    "qkv_same_embed_dim": FieldSpec("bool", "MultiheadAttention: kdim and vdim equal embed_dim."),
    "normalized_h": FieldSpec("int", "LayerNorm: normalized_shape[-2] (1 when normalized_shape has one dim)."),
    "normalized_w": FieldSpec("int", "LayerNorm: normalized_shape[-1]."),
    "moves_batch_dim": FieldSpec("bool", "transpose/permute: dim 0 is one of the dims moved."),
    "static_shape": FieldSpec("bool", "Every operand shape is known when the graph is compiled."),
    "feature_count": FieldSpec("int", "RoIAlign family: number of feature maps given."),
}


class FactError(ValueError):
    """A fact has a value the rule cannot compare (a legality-pass bug, not a table violation)."""


class _Missing(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


@attrs.frozen
class Verdict:
    """Result of :meth:`Rule.check`.

    ``ok`` is True (holds), False (violated) or None (a needed fact is absent; ``message``
    names it). ``actual`` is the fact value checked, ``bound`` what it was checked against.
    """

    ok: bool | None
    actual: Any
    bound: Any
    message: str

    @property
    def failed(self) -> bool:
        return self.ok is False


def _fact(facts: Facts, name: str) -> Any:
    if name not in facts:
        raise _Missing(name)
    return facts[name]


def _is_seq(v: Any) -> bool:
    return isinstance(v, (list, tuple))


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FactError(f"{what} must be a number, got {v!r}")
    return v


# ----------------------------------------------------------------------------- operands


@attrs.frozen
class Field:
    """The left side of a rule: one fact."""

    name: str

    def value(self, facts: Facts) -> Any:
        return _fact(facts, self.name)

    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def __str__(self) -> str:
        return self.name


@attrs.frozen
class Product:
    """The left side of a rule: the product of several integer facts (``H*W*C``)."""

    factors: tuple[str, ...]

    def value(self, facts: Facts) -> Any:
        out: float = 1
        for n in self.factors:
            out *= _number(_fact(facts, n), f"fact {n!r}")
        return out

    def names(self) -> tuple[str, ...]:
        return self.factors

    def __str__(self) -> str:
        return "*".join(self.factors)


Operand = Field | Product


@attrs.frozen
class Const:
    """A bound given in the table."""

    value: Any

    def resolve(self, facts: Facts) -> Any:
        return self.value

    def names(self) -> tuple[str, ...]:
        return ()

    def __str__(self) -> str:
        return _show(self.value)


@attrs.frozen
class FieldBound:
    """A bound computed from another fact: ``(ref + add) * mul / div_ref``.

    With ``add=0, mul=1`` and no ``div`` it is the referenced fact itself, of any type
    (``output_dtype == input_dtype``). Sequences are combined element by element.
    """

    ref: str
    add: float = 0
    mul: float = 1
    div: str | None = None

    def _arith(self) -> bool:
        return self.add != 0 or self.mul != 1 or self.div is not None

    def resolve(self, facts: Facts) -> Any:
        base = _fact(facts, self.ref)
        if not self._arith():
            return base
        divisor = _fact(facts, self.div) if self.div is not None else 1
        return _zip_map(
            base, divisor, lambda b, d: (_number(b, self.ref) + self.add) * self.mul / _number(d, "divisor")
        )

    def names(self) -> tuple[str, ...]:
        return (self.ref,) if self.div is None else (self.ref, self.div)

    def __str__(self) -> str:
        s = self.ref
        if self.add:
            s = f"({s} {'+' if self.add > 0 else '-'} {_show(abs(self.add))})"
        if self.mul != 1:
            s = f"{s} * {_show(self.mul)}"
        if self.div is not None:
            s = f"{s} / {self.div}"
        return s


Bound = Const | FieldBound


def _zip_map(a: Any, b: Any, fn: Callable[[Any, Any], Any]) -> Any:
    if _is_seq(a) and _is_seq(b):
        if len(a) != len(b):
            raise FactError(f"cannot pair {a!r} with {b!r}: lengths differ")
        return tuple(fn(x, y) for x, y in zip(a, b, strict=True))
    if _is_seq(a):
        return tuple(fn(x, b) for x in a)
    if _is_seq(b):
        return tuple(fn(a, y) for y in b)
    return fn(a, b)


def _pairs(actual: Any, bound: Any) -> list[tuple[Any, Any]]:
    """(element, bound element) pairs for element-wise checking."""
    if _is_seq(actual) and _is_seq(bound):
        if len(actual) != len(bound):
            raise FactError(f"cannot compare {actual!r} with {bound!r}: lengths differ")
        return list(zip(actual, bound, strict=True))
    if _is_seq(actual):
        return [(a, bound) for a in actual]
    if _is_seq(bound):
        return [(actual, b) for b in bound]
    return [(actual, bound)]


def _show(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    if isinstance(v, tuple):
        return "(" + ", ".join(_show(x) for x in v) + ")"
    return repr(v) if isinstance(v, str) else str(v)


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps True apart from 1 and False from 0 and None."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    return bool(a == b)


def _divisible(a: Any, b: Any) -> bool:
    return _number(b, "divisor") != 0 and _number(a, "value") % b == 0


_ORDERED = ("<", "<=", ">", ">=")
OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    "==": _same,
    "!=": lambda a, b: not _same(a, b),
    ">=": operator.ge,
    ">": operator.gt,
    "divisible_by": _divisible,
}


def _apply(op: str, a: Any, b: Any) -> bool:
    if op in _ORDERED:
        _number(a, "value")
        _number(b, "bound")
    return OPS[op](a, b)


# ----------------------------------------------------------------------------- rules


@attrs.frozen
class Rule:
    """Base of the rule variants. ``text`` is the table's original wording."""

    kind: ClassVar[str] = ""
    text: str = attrs.field(default="", kw_only=True)

    @property
    def checkable(self) -> bool:
        return True

    def fields(self) -> frozenset[str]:
        """Facts this rule reads."""
        raise NotImplementedError

    def check(self, facts: Facts) -> Verdict:
        try:
            return self._check(facts)
        except _Missing as m:
            return Verdict(None, None, None, f"{self}: fact {m.name!r} not provided")

    def _check(self, facts: Facts) -> Verdict:
        raise NotImplementedError


@attrs.frozen
class Compare(Rule):
    """``lhs op bound`` with op one of :data:`OPS`.

    On a sequence fact the rule must hold for every element, or with ``quantifier="any"``
    for at least one ("dilation != 1" as a condition means some dim is dilated).
    """

    kind: ClassVar[str] = "compare"
    lhs: Operand
    op: str
    bound: Bound
    quantifier: str = "all"

    def fields(self) -> frozenset[str]:
        return frozenset(self.lhs.names() + self.bound.names())

    def _check(self, facts: Facts) -> Verdict:
        actual = self.lhs.value(facts)
        bound = self.bound.resolve(facts)
        results = [_apply(self.op, a, b) for a, b in _pairs(actual, bound)]
        ok = any(results) if self.quantifier == "any" else all(results)
        verb = "satisfies" if ok else "violates"
        return Verdict(ok, actual, bound, f"{self.lhs} = {_show(actual)} {verb} {self}")

    def __str__(self) -> str:
        op = "divisible by" if self.op == "divisible_by" else self.op
        some = "some " if self.quantifier == "any" else ""
        return f"{some}{self.lhs} {op} {self.bound}"


@attrs.frozen
class Range(Rule):
    """``low <= lhs <= high``; either end may be exclusive."""

    kind: ClassVar[str] = "range"
    lhs: Operand
    low: Bound
    high: Bound
    low_inclusive: bool = True
    high_inclusive: bool = True

    def fields(self) -> frozenset[str]:
        return frozenset(self.lhs.names() + self.low.names() + self.high.names())

    def _check(self, facts: Facts) -> Verdict:
        actual = self.lhs.value(facts)
        low, high = self.low.resolve(facts), self.high.resolve(facts)
        lo_op = "<=" if self.low_inclusive else "<"
        hi_op = "<=" if self.high_inclusive else "<"
        for a, lo in _pairs(actual, low):
            if not _apply(lo_op, lo, a):
                return Verdict(False, actual, (low, high), f"{self.lhs} = {_show(actual)} violates {self}")
        for a, hi in _pairs(actual, high):
            if not _apply(hi_op, a, hi):
                return Verdict(False, actual, (low, high), f"{self.lhs} = {_show(actual)} violates {self}")
        return Verdict(True, actual, (low, high), f"{self.lhs} = {_show(actual)} satisfies {self}")

    def __str__(self) -> str:
        lo_op = "<=" if self.low_inclusive else "<"
        hi_op = "<=" if self.high_inclusive else "<"
        return f"{self.low} {lo_op} {self.lhs} {hi_op} {self.high}"


@attrs.frozen
class Member(Rule):
    """``lhs in values`` (or ``not in``).

    Scalar values: a sequence fact is checked element by element (``reduce_dims`` each in
    ``[1, 2, 3]``). Sequence values: the whole fact must equal one of them
    (``stride in [(1, 1), (2, 2)]``).
    """

    kind: ClassVar[str] = "member"
    lhs: Field
    values: tuple[Any, ...]
    negate: bool = False

    def fields(self) -> frozenset[str]:
        return frozenset(self.lhs.names())

    def _whole(self) -> bool:
        return any(_is_seq(v) for v in self.values)

    def _check(self, facts: Facts) -> Verdict:
        actual = self.lhs.value(facts)
        if self._whole():
            items = [tuple(actual) if _is_seq(actual) else actual]
            vals = tuple(tuple(x) if _is_seq(x) else x for x in self.values)
            inside = [it in vals for it in items]
        else:
            items = list(actual) if _is_seq(actual) else [actual]
            inside = [any(_same(it, x) for x in self.values) for it in items]
        ok = not any(inside) if self.negate else all(inside)
        verb = "satisfies" if ok else "violates"
        return Verdict(ok, actual, self.values, f"{self.lhs} = {_show(actual)} {verb} {self}")

    def __str__(self) -> str:
        vals = ", ".join(_show(tuple(v)) if _is_seq(v) else _show(v) for v in self.values)
        return f"{self.lhs} {'not in' if self.negate else 'in'} [{vals}]"


@attrs.frozen
class Conditional(Rule):
    """``require`` must hold whenever ``when`` holds."""

    kind: ClassVar[str] = "conditional"
    when: Rule
    require: Rule

    def fields(self) -> frozenset[str]:
        return self.when.fields() | self.require.fields()

    def _check(self, facts: Facts) -> Verdict:
        cond = self.when.check(facts)
        if cond.ok is None:
            return Verdict(None, cond.actual, None, f"{self}: {cond.message}")
        if not cond.ok:
            return Verdict(True, cond.actual, None, f"{self}: does not apply ({self.when} is false)")
        v = self.require.check(facts)
        return Verdict(v.ok, v.actual, v.bound, f"when {self.when}: {v.message}")

    def __str__(self) -> str:
        return f"{self.require} when {self.when}"


@attrs.frozen
class Advisory(Rule):
    """A constraint that cannot be checked statically; kept for documentation and reports."""

    kind: ClassVar[str] = "advisory"
    reason: str = ""

    @property
    def checkable(self) -> bool:
        return False

    def fields(self) -> frozenset[str]:
        return frozenset()

    def _check(self, facts: Facts) -> Verdict:
        return Verdict(True, None, None, f"advisory, not checked: {self.text}")

    def __str__(self) -> str:
        return f"advisory: {self.text}"


def walk(rule: Rule) -> Sequence[Rule]:
    """The rule and, for conditionals, its parts (for statistics and tests)."""
    if isinstance(rule, Conditional):
        return [rule, *walk(rule.when), *walk(rule.require)]
    return [rule]
