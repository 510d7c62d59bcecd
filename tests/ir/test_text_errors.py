"""Parse errors: line, column and what was expected; nothing in the text is evaluated."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qir.ir import ParseError, parse_graph, print_graph

HEAD = "graph @m(%x: tensor<2xf32>) {\n"


@pytest.mark.parametrize(
    "body, line, column, message",
    [
        ("  %y = relu(%z)\n  return %y\n}", 2, 13, "use of undefined value %z"),
        ("  %y = rleu(%x)\n  return %y\n}", 2, 8, "unknown op 'rleu'; did you mean relu"),
        ("  %y = relu(%x, inplce=True)\n  return %y\n}", 2, 24, "no attribute 'inplce'; did you mean inplace?"),
        ("  %y = relu(%x, inplace=True, inplace=False)\n  return %y\n}", 2, 39, "given twice"),
        ("  %y: tensor<2xf32 = relu(%x)\n  return %y\n}", 2, 7, "bad type 'tensor<2xf32'"),
        ("  %y = relu(%x, 3)\n  return %y\n}", 2, 17, "expected an operand %name"),
        ("  %y = relu(%x,,)\n  return %y\n}", 2, 16, "bad expression"),
        ("  %y = relu\n  return %y\n}", 2, 12, "expected '(' after op name 'relu'"),
        ("  %y relu(%x)\n  return %y\n}", 2, 6, "expected '=' after the value name"),
        ("  y = relu(%x)\n  return %y\n}", 2, 3, "expected a node"),
        ("  %x = relu(%x)\n  return %x\n}", 2, 3, "%x is already defined on line 1"),
        ("  %y = relu(%x) junk\n  return %y\n}", 2, 17, "unexpected text after the node"),
        ("  %y = relu(%x) @\n  return %y\n}", 2, 18, "expected a scope name"),
        ("  %y = constant()\n  return %y\n}", 2, 8, "needs attribute(s) key"),
        ('  %y = constant(key="k", kind="weird")\n  return %y\n}', 2, 8, "kind must be"),
        ("  %y = getitem(%x, index=%q)\n  return %y\n}", 2, 26, "%q is not an operand of this node"),
        ("  %y = getitem(%x, index=%x + 1)\n  return %y\n}", 2, 26, "unsupported expression (BinOp)"),
        ("  %y = getitem(%x, index=open)\n  return %y\n}", 2, 26, "unknown name 'open'"),
        ('  %y = getitem(%x, index=__import__("os"))\n  return %y\n}', 2, 26, "cannot call __import__"),
        ("  %y = getitem(%x, index=torch.zeros)\n  return %y\n}", 2, 26, "not a torch dtype"),
        ("  %y = getitem(%x, index=DType.qint9)\n  return %y\n}", 2, 26, "did you mean qint8"),
        ("  %y = getitem(%x, index=(1).real)\n  return %y\n}", 2, 26, "unsupported expression (Attribute)"),
        ("  %y = getitem(%x, index=-%x)\n  return %y\n}", 2, 26, "a sign only applies to a number"),
        ("  %y = getitem(%x, index=[*%x])\n  return %y\n}", 2, 27, "'*' unpacking"),
        ("  %y = getitem(%x, index=b'x')\n  return %y\n}", 2, 26, "unsupported literal b'x'"),
        ("  %y = getitem(%x, index={[1]: 2})\n  return %y\n}", 2, 27, "dict key [1] is not hashable"),
        ('  %y = getitem(%x, index="abc)\n  return %y\n}', 2, 26, "unterminated string"),
        ("  %y = getitem(%x, index=(1, 2)\n  return %y\n}", 2, 15, "unclosed bracket"),
        ("  %y = relu(%x)\n}", 3, 1, "expected 'return <outputs>' before '}'"),
        ("  %y = relu(%x)\n  return %y\n", 3, 12, "expected '}' to close the graph"),
        ("  %y = relu(%x)\n  return %y %x\n}", 3, 13, "bad expression: invalid syntax"),
        ("  %y = relu(%x)\n  return %w\n}", 3, 10, "use of undefined value %w"),
        ("  %y = relu(%x)\n  return\n}", 3, 9, "expected the output after 'return'"),
        ("  %y = relu(%x)\n  return %y\n} x", 4, 3, "unexpected text after '}'"),
        ("  %y = relu(%x)\n  return %y\n}\ngraph @n() {", 5, 1, "one graph per text"),
        ("  %y = getitem(%x, index=%3x)\n  return %y\n}", 2, 26, "%3x is not an operand"),
        ("  %y = add(%1, %x)\n  return %y\n}", 2, 12, "%<index> only refers to an operand inside an attribute"),
    ],
)
def test_node_errors(body: str, line: int, column: int, message: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_graph(HEAD + body, source="t.qir")
    e = info.value
    assert message in e.reason, e.reason
    assert (e.line, e.column) == (line, column), str(e)
    assert str(e).startswith(f"t.qir:{line}:{column}: ")


@pytest.mark.parametrize(
    "src, column, message",
    [
        ("grph @m() {", 1, "expected 'graph @name(...) {'"),
        ("graph m() {", 7, "expected '@' and the graph name"),
        ("graph @m(x: tensor<2xf32>) {", 10, "expected a value name like %x"),
        ("graph @m(%x tensor<2xf32>) {", 13, "expected ':' and the input's type"),
        ("graph @m(%x: ) {", 14, "expected a type"),
        ("graph @m(%x: tensor<2xf32> %y: int) {", 28, "expected ',' or ')' in the input list"),
        ("graph @m(%x: int = ) {", 20, "expected a default value"),
        ("graph @m(%x: int = %y) {", 20, "values cannot appear here"),
        ("graph @m(%x: int, %x: int) {", 19, "%x is already defined"),
        ("graph @m() attributes(train=True) {", 29, "unknown graph attribute 'train'"),
        ("graph @m() attributes(training=1) {", 32, "training must be True or False"),
        ("graph @m() { %y = relu(%x)", 14, "put each node on its own line"),
        ("graph @m()", 11, "expected '{' to open the graph body"),
    ],
)
def test_header_errors(src: str, column: int, message: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_graph(src + "\n  return None\n}")
    assert message in info.value.reason, info.value.reason
    assert (info.value.line, info.value.column) == (1, column), str(info.value)


def test_empty_text() -> None:
    with pytest.raises(ParseError, match="found no graph"):
        parse_graph("// only a comment\n")


def test_error_shows_the_line_and_a_caret() -> None:
    with pytest.raises(ParseError) as info:
        parse_graph(HEAD + "  %y = rleu(%x)\n  return %y\n}")
    assert str(info.value).splitlines()[1:] == ["    %y = rleu(%x)", "         ^"]


def test_columns_count_characters_not_bytes() -> None:
    with pytest.raises(ParseError) as info:
        parse_graph(HEAD + '  %y = call(%x, kind="function", target="é", args=bad)\n  return %y\n}')
    assert info.value.column == 51


def test_nothing_is_evaluated() -> None:
    calls: list[int] = []
    import builtins

    original = builtins.print
    try:
        builtins.print = lambda *a, **k: calls.append(1)  # type: ignore[assignment]
        with pytest.raises(ParseError):
            parse_graph(HEAD + '  %y = getitem(%x, index=print("x"))\n  return %y\n}')
    finally:
        builtins.print = original
    assert calls == []


SAMPLE = """graph @main(%x: tensor<1x2x4x4xf32>, %k: int = 2) {
  %w: tensor<3x2x1x1xf32> = constant(key="conv.weight") @conv
  %c: tensor<1x3x4x4xf32> = conv2d(%x, %w, bias=False) @conv
  %g: tensor<1x3x2x4xf32> = getitem(%c, %k, index=(slice(None, %k, None), ..., {"a": [1.5, -inf]}))
  %t: tensor<1x3x4x4xf32> = call(%c, %c, kind="function", target="torch.add", args=(%c, %1), kwargs={"d": torch.int8})
  return (%c, {"g": %g, "t": %t})
}"""

_PIECES = st.lists(
    st.sampled_from([*"%@(){}[]<>,.:=\"'/ \n\\x0123456789-_abcdefgiknrstuxé\x00", "tensor<", "//", "%1"]), max_size=3
).map("".join)


@given(st.lists(st.tuples(st.integers(0, len(SAMPLE)), st.integers(0, 3), _PIECES), min_size=1, max_size=3))
def test_mangled_text_parses_or_raises_parse_error(edits: list[tuple[int, int, str]]) -> None:
    text = SAMPLE
    for pos, cut, insert in edits:
        text = text[:pos] + insert + text[pos + cut :]
    try:
        g = parse_graph(text, allow_unbound=True)
    except ParseError as e:
        assert e.line >= 1 and e.column >= 1
    else:
        assert parse_graph(print_graph(g), allow_unbound=True) is not None
