"""Hostile literals in IR text are ParseErrors with line and column, never other exceptions."""

from __future__ import annotations

import pytest

from qir.ir import ParseError, QuantSpec, parse_graph
from qir.ir.parser import MAX_INT_LITERAL, parse_value
from qir.ir.types import MAX_TYPE_DEPTH, DType, parse_type


def _with_kwargs(literal: str) -> str:
    return (
        "graph @m(%x: tensor<2x3xf32>) {\n"
        f'  %y: tensor<6xf32> = call(%x, kind="function", target="torch.flatten", args=(%x,), kwargs={literal})\n'
        "  return %y\n"
        "}"
    )


@pytest.mark.parametrize(
    ("literal", "reason"),
    [
        ('{"a\x00": 1}', "null bytes"),
        ('{"\\N{no such name}": 1}', "unicode error"),
        ('{"a": ' + "9" * 5000 + "}", "Exceeds the limit"),
        ('{"a": ' + "9" * 30 + "}", "integer literal with 30 digits is out of range"),
        ('{"a": -' + "9" * 30 + "}", "out of range"),
        ('{"a": slice(' + "9" * 25 + ")}", "out of range"),
        ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "too many nested parentheses"),
        ('{"a": 1, "a": 2}', "dict key 'a' appears twice"),
        ("{[1]: 2}", "not hashable"),
        ("{{1: 2}: 3}", "not hashable"),
        ('{"a": b"x"}', "unsupported literal"),
        ('{"a": 1j}', "unsupported literal"),
        ('{"a": f"{1}"}', "unsupported expression"),
        ('{"a": lambda: 1}', "unsupported expression"),
        ('{"a": (b := 1)}', "unsupported expression"),
        ('{"a": {1, 2}}', "unsupported expression"),
        ('{"a": torch.nn.functional}', "unsupported expression"),
        ('{"a": Type("' + "tuple<" * 3000 + "int" + ">" * 3000 + '")}', "nested deeper than 64"),
        ('{"a": torch.device("cuda:99999999999999999999")}', "bad torch.device"),
    ],
)
def test_hostile_attribute_literals(literal: str, reason: str) -> None:
    with pytest.raises(ParseError) as e:
        parse_graph(_with_kwargs(literal))
    assert e.value.line == 2 and e.value.column > 1
    assert reason in e.value.reason


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('graph @"a\x00"(%x: tensor<2xf32>) {\n  return %x\n}', 1),
        ('graph @"\\N{nope}"(%x: tensor<2xf32>) {\n  return %x\n}', 1),
        ('graph @m(%x: tensor<2xf32>) {\n  %y = relu(%x) @"\\N{x}"\n  return %y\n}', 2),
        ("graph @m(%x: " + "tuple<" * 3000 + "int" + ">" * 3000 + ") {\n  return %x\n}", 1),
        ("graph @m(%x: tensor<2xf32,scale=[inf]>) {\n  return %x\n}", 1),
        ("graph @m(%x: tensor<2xqi8,scale=[inf]>) {\n  return %x\n}", 1),
        ("graph @m(%x: tensor<2xqi8,scale=[nan]>) {\n  return %x\n}", 1),
        ("graph @m(%x: tensor<2xqi8,scale=[1.0],axis=" + "9" * 5000 + ">) {\n  return %x\n}", 1),
        ("graph @m(%x: int = " + "[" * 3000 + "]" * 3000 + ") {\n  return %x\n}", 1),
        ("graph @m(%x: int) {\n  return " + "(" * 900 + "%x," + ")" * 900 + "\n}", 2),
    ],
)
def test_hostile_names_types_and_defaults(text: str, line: int) -> None:
    with pytest.raises(ParseError) as e:
        parse_graph(text)
    assert e.value.line == line


def test_bounds_are_inclusive_where_documented() -> None:
    assert parse_value(str(MAX_INT_LITERAL)) == 2**64
    assert parse_value(f"-{MAX_INT_LITERAL}") == -(2**64)
    deep = "tuple<" * MAX_TYPE_DEPTH + "int" + ">" * MAX_TYPE_DEPTH
    assert str(parse_type(deep)) == deep
    with pytest.raises(ValueError, match="nested deeper"):
        parse_type("tuple<" + deep + ">")


def test_string_data_may_hold_escaped_control_characters() -> None:
    # an escaped NUL is data, not a hazard: it parses and round-trips
    assert parse_value('"a\\x00b"') == "a\x00b"
    assert parse_value('{"k": "\\u2028"}') == {"k": "\u2028"}


def test_quant_spec_scales_must_be_finite() -> None:
    for bad in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match="positive and finite"):
            QuantSpec((bad,), DType.qint8)
