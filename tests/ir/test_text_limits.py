"""Bounds on what parsing IR text may allocate: a declared constant is not zero-filled past a limit."""

from __future__ import annotations

import pytest

from qir.ir import ParseError, parse_graph
from qir.ir.parser import MAX_CONSTANT_BYTES

HUGE = 'graph @m(%x: tensor<2xf32>) {\n  %c: tensor<30000x30000xf32> = constant(key="w")\n  return %c\n}'


def test_huge_unbound_constant_is_refused_not_allocated() -> None:
    with pytest.raises(ParseError, match=r"<text>:2:3: .*3,600,000,000 bytes of zeros exceeds"):
        parse_graph(HUGE, allow_unbound=True)


def test_limit_is_configurable() -> None:
    small = HUGE.replace("30000x30000", "4x4")
    assert parse_graph(small, allow_unbound=True).constants["w"].shape == (4, 4)
    with pytest.raises(ParseError, match="64 bytes of zeros exceeds the limit of 63 bytes"):
        parse_graph(small, allow_unbound=True, max_constant_bytes=63)
    assert MAX_CONSTANT_BYTES == 256 * 2**20


def test_dimension_beyond_int64_is_a_parse_error() -> None:
    text = "graph @m(%x: tensor<99999999999999999999xf32>) {\n  %y = relu(%x)\n  return %y\n}"
    with pytest.raises(ParseError, match=r"<text>:1:.*dimension must be below 2\*\*62"):
        parse_graph(text)
